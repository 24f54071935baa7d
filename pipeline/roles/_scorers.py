"""The two roles between the generators and the trainer: the Scorer (the verifier's rewards) and the RefModel (β > 0)."""

from __future__ import annotations

import dataclasses

import torch

from actors import Actor, Channel, Port, ReceivesWeights, WeightManifest, endpoint

from ..config import Config
from ..models import compile_blocks, hold_weights, weights_dtype
from ..tasks import Scores, load_task, to_device
from ._devices import compact_gpu_allocator, role_device
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
    async def run(self, out: Port[ScoredRollout], producers: int = 1) -> int:
        """Score rollouts until each of the ``producers`` (the generators) has ended its stream, then end ours."""
        if isinstance(producers, bool) or not isinstance(producers, int) or producers < 1:
            raise ValueError(f"producers must be a positive int, got {producers!r}")
        count = 0
        while producers:
            rollout = await self.inbox.recv()
            if rollout is None:
                producers -= 1
                continue
            scores = await self.score(rollout)
            accuracy = None if scores.accuracy is None else scores.accuracy.cpu()
            components = scores.components or {}
            total = None if scores.total is None else scores.total.cpu()
            out.send(
                ScoredRollout(
                    rollout,
                    scores.rewards.cpu(),
                    accuracy,
                    self.inbox.qsize(),
                    reward_components=components,
                    reward_metrics=scores.metrics or {},
                    reward_total=total,
                )
            )
            count += 1
        out.send(None)
        return count


class RefModel(ReceivesWeights):
    """Adds the reference policy's log-probabilities of each rollout's samples.

    The reference is the policy as initialised; with ``--sync-ref-model``
    the trainer sends a mixed one every few steps to ``update_weights``
    (queue-backed, as a generator's), installed before the next rollout.
    """

    def __init__(self, config: Config, initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "ref")
        compact_gpu_allocator(self.device)
        model = hold_weights(self.task.build_policy(), self.device, weights_dtype(config.dtype))
        self.model = model.requires_grad_(False).eval()
        if config.compile:
            compile_blocks(self.model)
        self.weight_inbox.put(initial)
        if self.weight_inbox.install_newest(self.model) is None:
            raise RuntimeError(f"the reference's weights (version {initial.version}) were overwritten before install")
        self.version = initial.version  # of the reference the model holds
        self.port, self.inbox = Channel.open(ScoredRollout)

    @endpoint
    async def inlet(self) -> Port[ScoredRollout]:
        return self.port

    def reference_logps(self, rollout: Rollout) -> torch.Tensor:
        return self.task.reference_logps(self.model, to_device(rollout.samples, self.device)).cpu()

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (scored := await self.inbox.recv()) is not None:
            installed = await self.weight_inbox.install_newest_async(self.model)  # a synced reference, if one came
            if installed is not None:
                self.version = installed.version
            ref = self.reference_logps(scored.rollout)
            out.send(dataclasses.replace(scored, ref_logps=ref, ref_queue=self.inbox.qsize()))
            count += 1
        out.send(None)
        return count
