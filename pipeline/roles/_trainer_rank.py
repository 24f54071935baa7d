"""A trainer rank past the first (``--trainer-ranks N``): trains its share of every rollout beside the Trainer.

Rank 0 is the :class:`~pipeline.roles.Trainer`: it receives the rollouts,
publishes, evaluates and checkpoints. Ranks 1..N-1 are these: each starts
from the same policy and optimizer (the same seed, or the same checkpoint),
trains its block of each rollout's rows when the Trainer hands it the
rollout, and sums gradients with the others, so every rank takes the same
step. With ``--trainer-shard fsdp`` each holds a shard of the policy
(:class:`~pipeline.learning.FullySharded`), so it also joins, at the
Trainer's call, every act that reads the policy whole: publishing,
evaluating, saving.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from actors import Actor, context, current_rank, endpoint, host_id, join_publish

from ..config import Config
from ..learning import DataParallel, GroupAddress, Learner, RankShare, group_kind
from ..tasks import load_task, to_device
from ._devices import trainer_rank_device

__all__ = ["TrainerRank"]


class TrainerRank(Actor):
    """One of ranks 1..N-1 of the trainer: its share of each update, nothing else."""

    def __init__(self, config: Config, resume: bool = False, first_gpu: int = 1) -> None:
        """``first_gpu``: the GPU offset (past the trainer's) of this host's first rank: 1 beside the trainer, else 0."""
        config = dataclasses.replace(config, log_completions=0)  # rank 0 logs what the ranks evaluate together
        self.config = config
        self.task = load_task(config)
        self.device = trainer_rank_device(config, first_gpu + current_rank()["procs"])
        self.learner = Learner(self.task, self.device, stage_on_host=config.sharded_trainer)
        self._shards_to_load: str | None = None  # a sharded checkpoint's, loaded once the ranks have sharded
        if resume:
            _, self._shards_to_load = self.learner.resume(config.run_dir, shard_later=config.sharded_trainer)
        self.parallel: DataParallel | None = None

    @endpoint
    async def join(self, address: GroupAddress, world: int) -> tuple[int, str]:
        """Join the group at rank 0's ``address`` as this mesh's rank + 1; that rank and this host. Waits for every rank."""
        share = RankShare(context().actor_instance.rank.rank + 1, world)  # (its own: not the message's place)

        def form() -> DataParallel:
            config = self.config
            group = group_kind(config.trainer_shard)(share, address, self.device, timeout=config.collective_timeout)
            self.learner.share_with(group)
            if self._shards_to_load is not None:  # as rank 0 does, which then publishes the policy
                self.learner.load_shards(self._shards_to_load)
                self._join_publishes(1)
            return group

        self.parallel = await asyncio.to_thread(form)
        return share.rank, host_id()

    @endpoint
    async def train(
        self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor | None, publishes: int = 0
    ) -> float:
        """This rank's share of one rollout's update, then its part in ``publishes`` publishes of the sharded policy.

        Returns the gradient norm, the same on every rank.
        """
        device = self.device
        ref = None if ref_logps is None else ref_logps.to(device)

        def step() -> float:
            update = self.learner.update(to_device(samples, device), rewards.to(device), ref)
            self._join_publishes(publishes)
            return update.grad_norm

        return await asyncio.to_thread(step)

    @endpoint
    async def publish(self, count: int) -> None:
        """Join ``count`` publishes of the sharded policy by the Trainer (a transport it starts to use)."""
        await asyncio.to_thread(self._join_publishes, count)

    def _join_publishes(self, count: int) -> None:
        """This rank's part in ``count`` publishes of the sharded policy by rank 0 (off the loop: collectives)."""
        for _ in range(count):
            join_publish(self.learner.policy)

    @endpoint
    async def evaluate(self, step: int) -> None:
        """Join the Trainer's evaluation of the sharded policy after ``step`` updates (its forwards gather every
        rank's shards)."""
        await asyncio.to_thread(self.learner.evaluate, step)

    @endpoint
    async def save(self, folder: str) -> None:
        """Join the Trainer's checkpoint of the sharded policy: this rank's shards into ``folder``, then the export."""

        def save() -> None:
            self.learner.save_shards(folder)
            self.learner.whole_policy_state()  # gathered into rank 0's copy

        await asyncio.to_thread(save)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self.parallel is not None:
            self.parallel.close()
