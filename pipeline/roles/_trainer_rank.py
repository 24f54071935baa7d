"""A trainer rank past the first (``--trainer-ranks N``): trains its share of every rollout beside the Trainer.

Rank 0 is the :class:`~pipeline.roles.Trainer`: it receives the rollouts,
publishes, evaluates and checkpoints. Ranks 1..N-1 are these: each holds the
same policy and optimizer (the same seed, or the same checkpoint), trains
its block of each rollout's rows when the Trainer hands it the rollout, and
sums gradients with the others (:class:`~pipeline.learning.DataParallel`),
so every rank takes the same step.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from actors import Actor, current_rank, endpoint

from ..config import Config
from ..learning import DataParallel, Learner, RankShare, checkpoint
from ..tasks import load_task, to_device
from ._devices import role_device

__all__ = ["TrainerRank"]


class TrainerRank(Actor):
    """One of ranks 1..N-1 of the trainer: its share of each update, nothing else."""

    def __init__(self, config: Config, resume: bool = False) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "trainer")
        self.learner = Learner(self.task, self.device)
        if resume:
            self.learner.load_state(checkpoint.load(config.run_dir))
        self.parallel: DataParallel | None = None

    @endpoint
    async def join(self, address: list[Any], world: int) -> int:
        """Join the group at rank 0's ``address`` (this mesh's rank + 1); returns the rank. Waits for every rank."""
        share = RankShare(current_rank().rank + 1, world)
        where = (str(address[0]), int(address[1]))
        self.parallel = await asyncio.to_thread(DataParallel, share, where, self.device)
        self.learner.share_with(self.parallel)
        return share.rank

    @endpoint
    async def train(self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor | None) -> float:
        """This rank's share of one rollout's update (beside the others'); the gradient norm, the same on every rank."""
        device = self.device
        ref = None if ref_logps is None else ref_logps.to(device)
        update = await asyncio.to_thread(self.learner.update, to_device(samples, device), rewards.to(device), ref)
        return update.grad_norm

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self.parallel is not None:
            self.parallel.close()
