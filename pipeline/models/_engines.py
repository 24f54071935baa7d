"""Generation engines: prompts in; token ids, behaviour log-probabilities and text out.

A generator holds one :class:`Engine`, which its task builds
(:meth:`pipeline.tasks.Task.build_engine`) as ``--engine`` says. The interface
is small — :meth:`Engine.generate` and :meth:`Engine.load_weights` — so the
roles do not change with the engine:

- ``builtin`` — :class:`BuiltinEngine`, this project's sampler over a Hugging
  Face model's KV cache: left-padded prompts, temperature, top-k, top-p, any
  end token;
- ``hf`` — :class:`GenerateEngine`, the model's own ``generate``;
- ``vllm`` — :class:`pipeline.models.VLLMEngine`.

Each records a token's log-probability under the whole temperature-scaled
distribution — what the trainer's :func:`~pipeline.models.causal_logps`
computes — so the ratio is 1 at lag 0 whatever the top-k/top-p (those
belong to the sampler, not the policy)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from actors import WeightInbox, WeightManifest

from ..algorithm import RepeatPenalty, draw
from ._decode_choice import DecodePath, DecoderChoice
from ._decoders import ModelCall

__all__ = [
    "BuiltinEngine",
    "Completions",
    "Engine",
    "GenerateEngine",
    "SamplingParams",
    "decode_completions",
    "end_tokens",
    "left_pad",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 are off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # the seen tokens' logits bent by it before the draw (1: off)
    samples: int = 1  # completions per prompt

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "samples"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"SamplingParams.{name} is a positive int, not {value!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k is an int >= 0 (0: off), not {self.top_k!r}")
        checks = (
            ("temperature", 0.0 <= self.temperature < math.inf, ">= 0 (0: greedy)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1] (1: off)"),
            ("min_p", 0.0 <= self.min_p < 1.0, "in [0, 1) (0: off)"),
            ("repetition_penalty", 0.0 < self.repetition_penalty < math.inf, "> 0 (1: off)"),
        )
        for name, fits, rule in checks:
            if not fits:  # (NaN fits no rule)
                raise ValueError(f"SamplingParams.{name} is {rule}, not {getattr(self, name)!r}")


@dataclass
class Completions:
    """``samples`` completions per prompt, prompt-major: ``tokens`` [N, P + T] (left-padded prompt, then completion),
    ``prompt_mask`` [N, P], behaviour ``logps`` and completion ``mask`` [N, T] (1 up to and including the end token),
    and the completions decoded (without the end token)."""

    tokens: torch.Tensor
    prompt_mask: torch.Tensor
    logps: torch.Tensor
    mask: torch.Tensor
    texts: list[str]


class Engine(Protocol):
    """What a generator needs from whatever produces its completions."""

    eos: list[int]  # the tokens that end a completion

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> Completions:
        """Completions of ``prompts`` (token ids each, any lengths)."""
        ...

    async def load_weights(self, inbox: WeightInbox, *, alias: bool = False) -> WeightManifest | None:
        """Install the newest manifest waiting in ``inbox`` into the engine's parameters; None if none waited.

        The inbox acknowledges, rejects and releases the update; the engine
        decides how its tensors reach the parameters it samples with. A
        manifest that does not fit is raised, the engine's weights unchanged.
        """
        ...


def end_tokens(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Every token that ends a completion: the tokenizer's end token and the model's generation config's
    (chat models often have several)."""
    ends = {tokenizer.eos_token_id}
    generation_eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(generation_eos, int):
        ends.add(generation_eos)
    elif isinstance(generation_eos, (list, tuple)):
        ends.update(generation_eos)
    return sorted(token for token in ends if isinstance(token, int))


def decode_completions(tokenizer: Any, completion: torch.Tensor, mask: torch.Tensor, eos: list[int]) -> list[str]:
    """Each completion row as text, without its end token and padding (``mask`` marks the generated tokens)."""
    ends = set(eos)
    texts = []
    for row, keep in zip(completion.tolist(), mask.tolist(), strict=True):
        ids = [token for token, kept in zip(row, keep, strict=True) if kept and token not in ends]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def left_pad(
    prompts: list[list[int]], pad: int, device: torch.device, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one [B, P] tensor padded on the left, and its attention mask; with ``vocab``, a token outside
    ``[0, vocab)`` is refused here (on a GPU the embedding's lookup would be a device-side assert)."""
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for row, prompt in enumerate(prompts):
        tokens = torch.tensor(prompt, dtype=torch.long, device="cpu")
        if vocab is not None and not bool(((tokens >= 0) & (tokens < vocab)).all()):
            bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
            raise ValueError(f"prompt {row} has token {bad}, outside the model's vocabulary of {vocab}")
        ids[row, width - len(prompt) :] = tokens
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def vocabulary_size(model: torch.nn.Module) -> int | None:
    """How many token ids the model's input embedding takes (None where it has no such table)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    rows = getattr(table, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


class BuiltinEngine:
    """Batched sampling with a Hugging Face causal LM and its KV cache.

    ``decode`` picks how each step's logits are made (:mod:`the decode
    choice <pipeline.models._decode_choice>`): ``auto`` replays a captured
    CUDA graph over a static cache on a GPU and runs the model's dynamic
    cache elsewhere; the tokens drawn and their log-probabilities are the
    same either way for the same seed, up to rounding (in bfloat16 the
    static cache's grouped attention rounds differently, and a sampled
    token can differ).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, decode: DecodePath = "auto") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos = end_tokens(tokenizer, getattr(model, "generation_config", None))
        self.pad = int(tokenizer.pad_token_id)
        self.vocab = vocabulary_size(model)
        self.decoding = DecoderChoice(model, ModelCall.of(model), decode)

    async def load_weights(self, inbox: WeightInbox, *, alias: bool = False) -> WeightManifest | None:
        # a copy lands in the storage a captured graph reads; an alias is new storage, and the graph is captured anew
        return await inbox.install_newest_async(self.model, alias=alias)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> Completions:
        device = next(self.model.parameters()).device
        ids, prompt_mask = left_pad(prompts, self.pad, device, self.vocab)
        ids = ids.repeat_interleave(params.samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(params.samples, dim=0)
        decoder = self.decoding.decoder(ids, prompt_mask, params.max_new_tokens)
        check_every = self.decoding.check_every
        count = ids.shape[0]
        step_logits = decoder.prefill(ids, prompt_mask)
        repeats = RepeatPenalty.of(ids, prompt_mask, step_logits.shape[-1], params.repetition_penalty)
        eos = torch.tensor(self.eos, dtype=torch.long, device=device)
        done = torch.zeros(count, dtype=torch.bool, device=device)
        tokens, logps, masks, ended = [], [], [], []
        # where the generator stood after each draw, when the host looks seldom: draws past the end are undone
        drawn: list[torch.Tensor] | None = [] if generator is not None and check_every > 1 else None
        for step in range(params.max_new_tokens):
            token, logp = draw(
                step_logits, params.temperature, generator, params.top_k, params.top_p, params.min_p, repeats
            )
            if drawn is not None:
                assert generator is not None
                drawn.append(generator.get_state())  # (host-side, a CUDA generator's too: no wait for the device)
            token = token.masked_fill(done, self.pad)
            tokens.append(token)
            logps.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0))
            masks.append(~done)
            done = done | torch.isin(token, eos)
            ended.append(done.all())  # stays on the device: the host looks every ``check_every`` steps
            if step + 1 == params.max_new_tokens or ((step + 1) % check_every == 0 and bool(ended[-1])):
                break
            step_logits = decoder.step(token)
        # the completions end where every row had ended (steps drawn after that, between two looks, are dropped)
        finished = torch.stack(ended)
        steps = int(finished.int().argmax()) + 1 if bool(finished.any()) else len(tokens)
        if drawn is not None and steps < len(drawn):  # the generator as a look every step leaves it
            assert generator is not None
            generator.set_state(drawn[steps - 1])
        completion = torch.stack(tokens[:steps], dim=1)
        mask = torch.stack(masks[:steps], dim=1)
        texts = self.decode(completion, mask)
        return Completions(
            torch.cat([ids, completion], dim=1), prompt_mask, torch.stack(logps[:steps], dim=1), mask.float(), texts
        )

    def decode(self, completion: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Each completion as text, without its end token and padding."""
        return decode_completions(self.tokenizer, completion, mask, self.eos)


class _StepLogps:
    """The log-probability of each token ``generate`` samples, under the temperature-scaled raw logits, with
    one step's [N, V] distribution in memory at a time.

    ``generate(output_logits=True)`` would keep a float32 copy of every
    step's logits until it returns: [T, N, V], 40 GB for 256 rows x 256
    tokens at a 151,936-token vocabulary. Instead a forward hook on the
    model takes each step's raw logits (the model's output: any soft-capping
    included, before any sampler's processing) as log-probabilities, and a
    logits processor, last in ``generate``'s list, gathers the previous
    step's at the token that step drew (the last of the ids it is shown).
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.latest: torch.Tensor | None = None  # the step just run, its token not drawn yet
        self.pending: torch.Tensor | None = None  # the step before, whose token the processor now sees
        self.steps: list[torch.Tensor] = []

    def on_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        logits = output.logits if hasattr(output, "logits") else output[0]
        self.latest = torch.log_softmax(logits[:, -1, :].float() / self.scale, dim=-1)

    def processors(self) -> Any:
        """The logits processors ``generate`` is given: one that gathers the drawn tokens' log-probabilities."""
        from transformers import LogitsProcessor, LogitsProcessorList

        steps = self

        class GatherDrawn(LogitsProcessor):  # type: ignore[misc]
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                steps.gather(input_ids[:, -1:])
                steps.pending, steps.latest = steps.latest, None
                return scores

        return LogitsProcessorList([GatherDrawn()])

    def gather(self, drawn: torch.Tensor) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, drawn).squeeze(-1))
            self.pending = None

    def finish(self, completion: torch.Tensor) -> torch.Tensor:
        """[N, T]: the last step's gathered at the completion's last token."""
        self.gather(completion[:, -1:])
        if len(self.steps) != completion.shape[1]:
            raise RuntimeError(
                f"generate ran {len(self.steps)} model steps for {completion.shape[1]} tokens: the behaviour "
                "log-probabilities cannot be matched to the tokens (a decoding strategy this engine does not support)"
            )
        return torch.stack(self.steps, dim=1)


class GenerateEngine(BuiltinEngine):
    """Sampling with the model's own ``generate`` (``--engine hf``): transformers' samplers and stopping rules.

    The behaviour log-probabilities are those of the raw logits, under the
    temperature-scaled distribution, as the other engines record them,
    taken one step at a time (:class:`_StepLogps`); the randomness is drawn
    from ``generator`` (``generate`` uses torch's global generator, so it is
    forked and seeded for the call).
    """

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> Completions:
        device = next(self.model.parameters()).device
        ids, prompt_mask = left_pad(prompts, self.pad, device, self.vocab)
        greedy = params.temperature == 0
        penalty = params.repetition_penalty if params.repetition_penalty != 1.0 else None  # None: no processor
        sampling: dict[str, Any] = {"do_sample": not greedy, "repetition_penalty": penalty}
        if not greedy:
            sampling.update(
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p or None,  # None: no processor (0 would add one that keeps everything)
            )
        seed = None
        if generator is not None:  # drawn where the generator lives (a CUDA generator on a GPU)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        devices = [device] if device.type == "cuda" else []
        steps = _StepLogps(1.0 if greedy else params.temperature)
        hook = self.model.register_forward_hook(steps.on_forward)
        try:
            with torch.random.fork_rng(devices=devices, enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                sequences = self.model.generate(  # type: ignore[operator]
                    input_ids=ids,
                    attention_mask=prompt_mask,
                    max_new_tokens=params.max_new_tokens,
                    num_return_sequences=params.samples,
                    eos_token_id=self.eos,
                    pad_token_id=self.pad,
                    logits_processor=steps.processors(),
                    **sampling,
                )
        finally:
            hook.remove()
        completion = sequences[:, ids.shape[1] :]
        logps = steps.finish(completion)
        ended = torch.isin(completion, torch.tensor(self.eos, device=device)).long()
        mask = (ended.cumsum(1) - ended) == 0  # up to and including the first end token
        prompt_mask = prompt_mask.repeat_interleave(params.samples, dim=0)
        texts = self.decode(completion, mask)
        return Completions(sequences, prompt_mask, logps.masked_fill(~mask, 0.0), mask.float(), texts)
