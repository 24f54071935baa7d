"""An actor that holds a :class:`pipeline.models.VLLMEngine` in its own process, for the vLLM tests.

vLLM binds threads and sets global state in the process that imports it,
so the tests never import it themselves: they talk to this actor.
"""

from __future__ import annotations

from typing import Any

import torch

from actors import ReceivesWeights, endpoint
from pipeline.models import SamplingParams, VLLMEngine, load_model, load_tokenizer


class VLLMHost(ReceivesWeights):
    """Samples with vLLM and installs the manifests sent to ``update_weights``."""

    def __init__(
        self, model: str, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, device: str = "cpu"
    ) -> None:
        self.tokenizer = load_tokenizer(model)
        policy = load_model(model).to(device).eval()
        self.engine = VLLMEngine(
            model,
            self.tokenizer,
            policy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            device=torch.device(device),
            gpu_memory_utilization=0.2,
        )
        self.version = -1

    @endpoint
    async def generate(
        self, prompts: list[list[int]], samples: int, max_new_tokens: int, temperature: float, seed: int
    ) -> dict[str, Any]:
        params = SamplingParams(max_new_tokens, temperature, samples=samples)
        out = self.engine.generate(prompts, params, torch.Generator().manual_seed(seed))
        return {
            "tokens": out.tokens.tolist(),
            "prompt_mask": out.prompt_mask.tolist(),
            "logps": out.logps.tolist(),
            "mask": out.mask.tolist(),
            "texts": out.texts,
            "eos": self.engine.eos,
            "mode": self.engine.mode,
        }

    @endpoint
    async def install_pending(self) -> int | None:
        """Install the newest waiting update; its version, or None if none waited (a refused one raises)."""
        manifest = await self.engine.load_weights(self.weight_inbox)
        if manifest is not None:
            self.version = manifest.version
        return None if manifest is None else manifest.version

    @endpoint
    async def update_state(self, update_id: str) -> str | None:
        """What this process's consumer did with ``update_id`` (acknowledged, rejected, released)."""
        return self.weight_inbox.consumer.state(update_id)

    @endpoint
    async def updates(self) -> int:
        return self.engine.updates
