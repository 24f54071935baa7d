"""The two roles between the generators and the trainer: the Scorer (the verifier's rewards) and the RefModel (β > 0)."""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from actors import Actor, Channel, Port, WeightConsumer, WeightManifest, endpoint

from ..config import Config
from ..tasks import Scores, load_task, to_device
from ._devices import compact_gpu_allocator, hold_weights, role_device, weights_dtype
from ._messages import Rollout, ScoredRollout

__all__ = ["RefModel", "Scorer"]


class Scorer(Actor):
    """Scores each rollout with the task's verifier (or reward model)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "scorer")
        self.scorer = self.task.build_scorer(self.device)
        self.port, self.inbox = Channel.open(Rollout)

    @endpoint
    async def inlet(self) -> Port[Rollout]:
        return self.port

    async def score(self, rollout: Rollout) -> Scores:
        return await self.task.score_async(self.scorer, to_device(rollout.samples, self.device))

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (rollout := await self.inbox.recv()) is not None:
            scores = await self.score(rollout)
            accuracy = None if scores.accuracy is None else scores.accuracy.cpu()
            components = scores.components or {}
            out.send(
                ScoredRollout(rollout, scores.rewards.cpu(), accuracy, self.inbox.qsize(), reward_components=components)
            )
            count += 1
        out.send(None)
        return count


class RefModel(Actor):
    """Adds the frozen initial policy's log-probabilities of each rollout's samples."""

    def __init__(self, config: Config, initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "ref")
        compact_gpu_allocator(self.device)
        model = hold_weights(self.task.build_policy(), self.device, weights_dtype(config))
        self.model = model.requires_grad_(False).eval()
        consumer = WeightConsumer()
        consumer.install(initial, self.model)
        consumer.close()
        self.port, self.inbox = Channel.open(ScoredRollout)
        self._weights = asyncio.Lock()  # held while a synced reference installs: no rollout sees half of it
        self.syncs = 0

    @endpoint
    async def update_reference(self, manifest: WeightManifest) -> int:
        """Install a synced reference (``--sync-ref-model``) between two rollouts; the syncs so far."""
        async with self._weights:
            consumer = WeightConsumer()
            work = asyncio.ensure_future(asyncio.to_thread(consumer.install, manifest, self.model))
            try:
                await asyncio.shield(work)
            finally:
                if not work.done():  # cancelled: the copy still ends before the slot and the model are let go
                    await asyncio.wait([work])
                consumer.close()
        self.syncs += 1
        return self.syncs

    @endpoint
    async def inlet(self) -> Port[ScoredRollout]:
        return self.port

    def reference_logps(self, rollout: Rollout) -> torch.Tensor:
        return self.task.reference_logps(self.model, to_device(rollout.samples, self.device)).cpu()

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (scored := await self.inbox.recv()) is not None:
            async with self._weights:
                ref = self.reference_logps(scored.rollout)
            out.send(dataclasses.replace(scored, ref_logps=ref, ref_queue=self.inbox.qsize()))
            count += 1
        out.send(None)
        return count
