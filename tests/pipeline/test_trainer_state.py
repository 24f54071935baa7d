"""What a trainer holds and when it writes: the reference copy in host memory (none without a KL term), a step
that waits for a publish copying the policy, and one checkpoint per step."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch
from pipeline_support import SaveCountingTrainer

from pipeline import Config, DigitsTask, Learner, Roles, Trainer, resolve, run_pipeline

SMALL = {"digits": 3, "prompts": 4, "group": 2, "eval_size": 8}


def _learner(device: str = "cpu", **changes: object) -> Learner:
    return Learner(DigitsTask(resolve(Config(**{**SMALL, **changes}))), torch.device(device))  # type: ignore[arg-type]


def test_without_a_kl_term_the_learner_keeps_no_reference_copy():
    """β = 0: nothing reads the reference (no RefModel, no sync: refused with β = 0), so there is none to hold (it
    was a whole copy of the policy on the trainer's device)."""
    learner = _learner(kl_coeff=0.0)
    assert learner.reference_state == {}
    assert learner.state()["ref"] == {}


def test_the_reference_copy_is_the_initial_policy_in_host_memory_apart_from_it():
    learner = _learner(kl_coeff=0.02)
    policy = learner.policy.state_dict()
    assert set(learner.reference_state) == set(policy)
    for name, value in learner.reference_state.items():
        assert value.device.type == "cpu" and value.data_ptr() != policy[name].data_ptr(), name
        assert torch.equal(value, policy[name]), name


@pytest.mark.gpu
def test_on_a_gpu_the_reference_copy_takes_no_gpu_memory():
    """A trainer on a GPU held its reference (read only to publish it, mix it every N steps, and save it) there
    too: a second copy of the policy in GPU memory (2 GB for a 0.5 B model in float32)."""
    before = torch.cuda.memory_allocated()
    learner = _learner("cuda", kl_coeff=0.02)
    held = torch.cuda.memory_allocated() - before
    policy = sum(value.numel() * value.element_size() for value in learner.policy.state_dict().values())
    assert {value.device.type for value in learner.reference_state.values()} == {"cpu"}
    assert held < 1.5 * policy, (held, policy)


async def test_a_single_rank_step_waits_for_a_publish_that_copies_the_policy():
    """A publish under way (a restarted generator's ``manifest_for``, its copy off the loop) holds the weights lock:
    a one-rank step waits for it (before, only several ranks' steps did, so the optimiser changed the parameters
    while the publish copied them: a manifest of version v holding some of v + 1)."""
    trained: list[str] = []

    def train_step(item: str) -> str:
        trained.append(item)
        return "update"

    trainer = types.SimpleNamespace(ranks=None, _weights=asyncio.Lock(), train_step=train_step)
    async with trainer._weights:
        step = asyncio.ensure_future(Trainer.train(trainer, "rollout"))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)  # (turns of the loop: a step that did not wait would have run)
        assert trained == [], "the step waits for the publish"
    assert await asyncio.wait_for(step, 30) == ("update", 0.0)
    assert trained == ["rollout"]


async def test_each_step_is_checkpointed_once(tmp_path, sockets_dir):
    """The last step falls on a periodic checkpoint: the run's final checkpoint does not write it again (it did:
    two full writes of the policy, the optimiser and the export, back to back)."""
    config = Config(steps=4, checkpoint_every=2, run_dir=str(tmp_path), **SMALL)  # type: ignore[arg-type]
    result = await run_pipeline(config, quiet=True, roles=Roles(trainer=SaveCountingTrainer))
    assert result.steps == 4
    assert (tmp_path / "saves.txt").read_text().split() == ["2", "4"]


def test_held_out_metrics_of_tensors_are_plain_floats_and_a_non_number_is_refused_by_name(monkeypatch):
    """A task's evaluation returning a 0-d tensor (or a numpy scalar) reached the rows' JSON as it was: the first
    evaluation step failed the run ("writing the run's metrics failed", not JSON serialisable) and the trackers
    left it out. The learner hands plain floats on, and names a metric that is no number."""
    learner = _learner()
    primary = learner.task.primary
    monkeypatch.setattr(
        learner.task, "evaluate", lambda policy: {primary: torch.tensor(0.5), "loss": torch.tensor(1.0)}
    )
    metrics = learner.evaluate(3)
    assert metrics == {primary: 0.5, "loss": 1.0} and all(type(v) is float for v in metrics.values())
    monkeypatch.setattr(learner.task, "evaluate", lambda policy: {primary: 0.5, "sizes": [1, 2]})
    with pytest.raises(TypeError, match="metric 'sizes' must be a number under a str name, got list"):
        learner.evaluate(3)
    monkeypatch.setattr(learner.task, "evaluate", lambda policy: [0.5])
    with pytest.raises(TypeError, match="must return a dict of metric name -> number, got list"):
        learner.evaluate(3)


def test_a_checkpoint_that_fails_after_a_failed_export_raises_its_own_error_from_the_exports():
    """A save whose export failed writes the checkpoint all the same; if that fails too (the same full disk), its
    error is raised from the export's (before, a ``finally`` raised it with the export's only as its context)."""
    from pipeline.roles._trainer import _saved_despite

    export = OSError(28, "No space left on device (the export)")
    with pytest.raises(OSError, match="the checkpoint") as raised:
        _saved_despite(export, lambda: (_ for _ in ()).throw(OSError(28, "No space left on device (the checkpoint)")))
    assert raised.value.__cause__ is export
    written: list[str] = []
    _saved_despite(export, lambda: written.append("checkpoint.pt") or "checkpoint.pt")  # (the caller raises next)
    assert written == ["checkpoint.pt"]
