"""An actor holding one generation engine (builtin, hf or vllm) in its own process, for bench_engines.py.

Each engine gets a fresh process: vLLM binds threads and sets global state
in the process that imports it, and every engine should start from the same
conditions.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from actors import ReceivesWeights, WeightConsumer, WeightManifest, endpoint
from pipeline.models import (
    SamplingParams,
    VLLMOptions,
    build_engine,
    causal_logps,
    load_model,
    load_tokenizer,
)


class EngineHost(ReceivesWeights):
    """Times one engine's generation and weight installs, and a plain copy of the same bytes."""

    def __init__(
        self, kind: str, folder: str, device: str = "cpu", threads: int = 1, vllm_dtype: str = "float32"
    ) -> None:
        torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(folder)
        self.policy = load_model(folder).to(self.device).eval().requires_grad_(False)
        started = time.perf_counter()
        self.engine = build_engine(kind, self.policy, self.tokenizer, folder, VLLMOptions(dtype=vllm_dtype))
        self.start_s = time.perf_counter() - started

    @endpoint
    async def generate(
        self, prompts: list[list[int]], samples: int, max_new_tokens: int, rounds: int
    ) -> dict[str, Any]:
        """``rounds`` timed batches after one warm-up: completion tokens/s and the lag-0 log-prob mismatch."""
        params = SamplingParams(max_new_tokens, 1.0, samples=samples)
        rng = torch.Generator().manual_seed(0)
        warm = time.perf_counter()
        self.engine.generate(prompts, params, rng)
        warm_s = time.perf_counter() - warm
        rates, gaps = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            out = self.engine.generate(prompts, params, rng)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            rates.append(float(out.mask.sum()) / (time.perf_counter() - started))
            with torch.no_grad():
                logps, _ = causal_logps(self.policy, out.tokens.to(self.device), out.prompt_mask.to(self.device), 1.0)
            mask = out.mask.to(self.device)
            gaps.append(float(((logps - out.logps.to(self.device)).abs() * mask).sum() / mask.sum()))
        return {
            "tokens_per_s": statistics.median(rates),
            "mismatch": statistics.median(gaps),
            "start_s": self.start_s,
            "first_batch_s": warm_s,
        }

    @endpoint
    async def install(self, manifest: WeightManifest) -> dict[str, float]:
        """Copy ``manifest``'s bytes once into plain buffers (the baseline), then install it through the engine."""
        baseline = WeightConsumer()  # a consumer of its own: the engine's inbox imports the update afresh
        try:
            tensors = baseline.import_update(manifest)
            targets = [torch.zeros_like(t) for t in tensors.values()]  # written once: no first-touch faults timed
            started = time.perf_counter()
            for target, tensor in zip(targets, tensors.values(), strict=True):
                target.copy_(tensor)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            copy_s = time.perf_counter() - started
            baseline.release(manifest.update_id, manifest.transport)
        finally:
            baseline.close()
        self.weight_inbox.put(manifest)
        started = time.perf_counter()
        installed = await self.engine.load_weights(self.weight_inbox)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        engine_s = time.perf_counter() - started
        assert installed is not None and installed.version == manifest.version
        return {"engine_ms": engine_s * 1000, "copy_ms": copy_s * 1000}
