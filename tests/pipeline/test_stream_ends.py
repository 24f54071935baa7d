"""The rollout stream's end: the scorer, fed by every generator, ends once each of them has ended its stream."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors import ActorError, Channel, this_host
from pipeline import BanditTask, Config, Scorer, resolve
from pipeline.roles import Rollout, ScoredRollout


def _rollout(task: BanditTask, generator: int) -> Rollout:
    samples = task.sample(task.build_policy(), torch.Generator().manual_seed(generator))
    return Rollout(generator=generator, rollout_id=0, version=0, samples=samples)


async def test_the_scorer_ends_once_every_generator_has_ended_not_at_the_first_end():
    """Two generators feed one scorer; the first ends its stream before the second's last rollout arrives. The
    scorer scores that rollout too and ends its own stream once, after the second end (before, it stopped at the
    first generator's None, and the second's rollouts behind it were never scored)."""
    config = resolve(Config(task="bandit", generators=2))
    task = BanditTask(config)
    procs = this_host().spawn_procs({"procs": 1}, name="scorer")
    try:
        scorer = procs.spawn("scorer", Scorer, config)
        inlet = await scorer.inlet.call_one()
        port, scored = Channel.open(ScoredRollout)
        with pytest.raises(ActorError, match="producers must be a positive int, got 0"):
            await asyncio.wait_for(scorer.run.call_one(port, 0), 60)
        run = asyncio.ensure_future(scorer.run.call_one(port, config.generators))
        for sent in (_rollout(task, 0), None, _rollout(task, 1), None):
            inlet.send(sent)
        received = []
        while (item := await asyncio.wait_for(scored.recv(), 60)) is not None:
            received.append(item.rollout.generator)
        assert received == [0, 1]
        assert await asyncio.wait_for(run, 60) == 2
    finally:
        await procs.stop()
