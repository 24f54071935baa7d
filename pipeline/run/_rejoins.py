"""A restarted generator's way back into a running pipeline: the launcher's side of a generator's restart."""

from __future__ import annotations

import asyncio
from typing import Any

from actors import ActorDied, Failure, ProcMesh

from ..roles import Generator, Trainer
from ._failures import PeerDied
from ._metrics import Progress

__all__ = ["Rejoins"]


class Rejoins:
    """Wires each restarted generator in again (its new grant port to the trainer, then its ``run``) as the task of
    its name in ``tasks``, and keeps ``producing``: the ranks drawing rollouts, not one still joining again.

    A generator that dies again before its rejoin is done supersedes that rejoin: the earlier one is cancelled
    (left going, it would start a second ``run`` loop on the newest process, beside the new rejoin's).
    """

    def __init__(
        self,
        gens: Generator,
        procs: ProcMesh,
        trainer: Trainer,
        tasks: dict[str, asyncio.Task[Any]],
        names: list[str],
        progress: Progress,
    ) -> None:
        self.gens = gens
        self.procs = procs
        self.trainer = trainer
        self.tasks = tasks
        self.names = names
        self.progress = progress
        #: The generators drawing rollouts: not one restarted and still joining again (its model loading).
        self.producing = set(range(len(names)))
        #: Times each generator was restarted, by name.
        self.restarts: dict[str, int] = {}
        #: Set once training ended (:meth:`end_training`): a generator that dies then is only stopped.
        self.training_over = False

    def end_training(self) -> None:
        """Training is over: a generator that dies from now on is not rejoined (its leftovers are not needed)."""
        self.training_over = True

    def on_failure(self, failure: Failure) -> bool:
        """The generators' failure handler: True when the failure is handled (a restart being rejoined)."""
        name = self.names[failure.rank]
        if self.training_over:
            self.progress.note(f"generator {failure.rank} died after training ended (pid {failure.pid})")
            return True
        if not failure.restarted:
            return False  # out of restarts: the run stops, naming the generator
        self.progress.note(f"generator {failure.rank} died (pid {failure.pid}): {failure.message}")
        self.producing.discard(failure.rank)
        superseded = self.tasks.get(name)
        if superseded is not None and not superseded.done():
            superseded.cancel()  # (its process is gone: a run call fails anyway, a rejoin must not go on)
        self.tasks[name] = asyncio.ensure_future(self._rejoin(failure.rank))
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return True

    async def _rejoin(self, rank: int) -> int:
        """New grant port, the open tickets again (the newest weights first), then produce."""
        gen = self.gens.slice(procs=rank)
        grants_in = await gen.grant_inlet.call_one()
        try:
            version = await self.trainer.generator_restarted.call_one(rank, grants_in)
        except ActorDied as exc:  # the trainer's death, which its own task names
            raise PeerDied(f"the trainer died as generator {rank} rejoined: {exc}") from exc
        self.progress.note(
            f"generator {rank} restarted (pid {self.procs.pids[rank]}); the trainer is at policy version {version}"
        )
        self.producing.add(rank)
        return await gen.run.call_one()  # type: ignore[no-any-return]
