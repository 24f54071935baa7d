"""The one place ``--engine`` is read: an engine of the named kind for a policy and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._decode_choice import DecodePath
from ._engines import BuiltinEngine, Engine, GenerateEngine

__all__ = ["VLLMOptions", "build_engine"]


@dataclass(frozen=True)
class VLLMOptions:
    """vLLM's own settings: its sampler (the run's), its precision and how much of the GPU it may take."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.3
    trust_remote_code: bool = False  # the model's own code (its auto_map) may run in the engine


def build_engine(
    kind: str,
    policy: torch.nn.Module,
    tokenizer: Any,
    model_path: str,
    vllm: VLLMOptions | None = None,
    decode: DecodePath = "auto",
) -> Engine:
    """The ``kind`` engine sampling ``policy`` (on its device); vLLM, imported only here, loads ``model_path``.

    ``builtin``: the pipeline's batched sampler over the model's KV cache (``decode`` says how);
    ``hf``: transformers' ``generate``; ``vllm``: a vLLM engine in this
    process whose weights follow ``policy``'s updates.
    """
    if kind == "builtin":
        return BuiltinEngine(policy, tokenizer, decode)
    if kind == "hf":
        return GenerateEngine(policy, tokenizer)
    if kind == "vllm":
        from ._vllm import VLLMEngine

        options = vllm or VLLMOptions()
        return VLLMEngine(
            model_path,
            tokenizer,
            policy,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            seed=options.seed,
            dtype=options.dtype,
            max_model_len=options.max_model_len,
            gpu_memory_utilization=options.gpu_memory_utilization,
            trust_remote_code=options.trust_remote_code,
            device=next(policy.parameters()).device,
        )
    raise ValueError(f"unknown engine {kind!r}: builtin, hf or vllm")
