"""Generation engines: prompts in; token ids, behaviour log-probabilities and text out.

A generator holds one :class:`Engine` (its task builds it:
:meth:`pipeline.task.Task.build_engine`). The interface is deliberately
small — :meth:`Engine.generate` and :meth:`Engine.load_weights` — so another
engine (vLLM) can take the generator's place without the roles changing. :class:`HFEngine` samples with a Hugging
Face model's own KV cache (``past_key_values``): left-padded prompts,
temperature, top-k and top-p, stopping at any end-of-sequence token or the
token limit. The log-probability it records for each token is under the whole
temperature-scaled distribution — what the trainer's
:func:`~pipeline.causal_lm.causal_logps` computes — so the ratio is 1 at lag 0
whatever the top-k/top-p (those belong to the sampler, not the policy).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from actors import WeightInbox, WeightManifest

from .causal_lm import positions
from .sampling import draw

__all__ = ["Completions", "Engine", "HFEngine", "SamplingParams", "left_pad"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    samples: int = 1  # completions per prompt


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


def left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` as one [B, P] tensor padded on the left, and its attention mask."""
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


class HFEngine:
    """Batched sampling with a Hugging Face causal LM and its KV cache."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        ends = {tokenizer.eos_token_id}  # and the model's own end tokens (chat models often have several)
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if isinstance(generation_eos, int):
            ends.add(generation_eos)
        elif isinstance(generation_eos, (list, tuple)):
            ends.update(generation_eos)
        self.eos = sorted(token for token in ends if isinstance(token, int))
        self.pad = int(tokenizer.pad_token_id)
        # transformers 5 names the KV cache ``cache``; 4.x ``past_key_values``
        forward = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward else "past_key_values"

    async def load_weights(self, inbox: WeightInbox, *, alias: bool = False) -> WeightManifest | None:
        return await inbox.install_newest_async(self.model, alias=alias)

    def _cache(self, out: Any) -> Any:
        return getattr(out, self._cache_argument)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> Completions:
        model = self.model
        device = next(model.parameters()).device
        ids, prompt_mask = left_pad(prompts, self.pad, device)
        ids = ids.repeat_interleave(params.samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(params.samples, dim=0)
        count = ids.shape[0]
        attention = prompt_mask
        position = positions(attention)
        out = model(input_ids=ids, attention_mask=attention, position_ids=position, use_cache=True)
        cache, step_logits = self._cache(out), out.logits[:, -1].float()
        next_position = position[:, -1:] + 1
        eos = torch.tensor(self.eos, dtype=torch.long, device=device)
        done = torch.zeros(count, dtype=torch.bool, device=device)
        tokens, logps, masks = [], [], []
        for _ in range(params.max_new_tokens):
            token, logp = draw(step_logits, params.temperature, generator, params.top_k, params.top_p)
            token = token.masked_fill(done, self.pad)
            tokens.append(token)
            logps.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0))
            masks.append(~done)
            done = done | torch.isin(token, eos)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones(count, 1, dtype=attention.dtype, device=device)], dim=1)
            out = model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_argument: cache},
            )
            cache, step_logits = self._cache(out), out.logits[:, -1].float()
            next_position = next_position + 1
        completion = torch.stack(tokens, dim=1)
        mask = torch.stack(masks, dim=1)
        texts = self.decode(completion, mask)
        return Completions(
            torch.cat([ids, completion], dim=1), prompt_mask, torch.stack(logps, dim=1), mask.float(), texts
        )

    def decode(self, completion: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Each completion as text, without its end token and padding."""
        ends = set(self.eos)
        texts = []
        for row, keep in zip(completion.tolist(), mask.tolist(), strict=True):
            ids = [token for token, kept in zip(row, keep, strict=True) if kept and token not in ends]
            texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
        return texts
