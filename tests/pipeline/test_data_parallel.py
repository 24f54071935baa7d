"""Several trainer ranks take the step one learner takes: rows shared out, gradients and reports summed (issue 39)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from harness import run_python
from pipeline_support import LATE_JOIN_S, LateJoiningRank, LearnerRank, ranks_step

from actors import this_host
from pipeline import Config, DigitsTask, Learner, resolve, run_pipeline
from pipeline.grpo import parse_args
from pipeline.learning import RankShare, Rendezvous
from pipeline.learning._sharded_state import missing_files
from pipeline.learning.checkpoint import load as load_checkpoint
from pipeline.roles import trainer_rank_device
from pipeline.run import PlacementError, check_placement, read_rows

SETTINGS = {"digits": 3, "prompts": 6, "group": 4, "eval_size": 16, "micro_batch": 5, "lr": 1e-2, "kl_coeff": 0.02}


def _rollout() -> tuple[DigitsTask, object, torch.Tensor, torch.Tensor]:
    task = DigitsTask(resolve(Config(**SETTINGS)))  # type: ignore[arg-type]
    torch.manual_seed(0)
    net = task.build_policy()
    batch = task.sample(net, torch.Generator().manual_seed(0))
    rewards = task.score(None, batch).rewards
    ref = task.reference_logps(net, batch) - 0.05  # not the policy itself: the KL term has a gradient
    return task, batch, rewards, ref


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_the_ranks_shares_cover_every_row_once_and_no_pass_grows(world):
    passes = [slice(0, 5), slice(5, 10), slice(10, 15), slice(15, 20), slice(20, 24)]
    seen: list[int] = []
    for rank in range(world):
        mine = RankShare(rank, world).passes(passes, 24)
        for part in mine:
            assert part.stop > part.start
            assert any(whole.start <= part.start and part.stop <= whole.stop for whole in passes), part
        seen += [row for part in mine for row in range(part.start, part.stop)]
    assert seen == list(range(24))
    assert RankShare(0, 2).passes([slice(None)], 7) == [slice(0, 3)], "one pass over all rows splits at the block"


def test_bad_ranks_and_unsplittable_samples_are_refused():
    for rank, world in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="need 0 <= rank < world"):
            RankShare(rank, world)
    with pytest.raises(ValueError, match="no rows to share out"):
        RankShare(0, 2).passes([slice(None)], None)


@pytest.mark.parametrize("shard", ["ddp", "fsdp"])
def test_two_ranks_take_the_step_one_learner_takes(shard):
    """Replicated (DDP) or sharded (FSDP2) over two gloo ranks: the one learner's gradients and loss."""
    task, batch, rewards, ref = _rollout()
    one = Learner(task, torch.device("cpu"))
    update = one.update(batch, rewards, ref)
    results = ranks_step(2, SETTINGS, batch, rewards, ref, shard)
    assert [r["passes"] for r in results] == [[[0, 5], [5, 10], [10, 12]], [[12, 15], [15, 20], [20, 24]]]
    assert [r["idle"] for r in results] == [0, 0]
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    # rank 0 alone publishes, mixes and saves the reference: it holds it, in host memory; the others drop theirs
    assert [r["reference_on"] for r in results] == [["cpu"], []]
    gradients = {name: p.grad for name, p in one.policy.named_parameters() if p.grad is not None}
    for result in results:
        assert set(result["gradients"]) == set(gradients)
        for name, value in gradients.items():  # the sum is the one-rank gradient, up to the order of additions
            torch.testing.assert_close(result["gradients"][name], value, atol=1e-7, rtol=1e-5)
        assert result["loss"] == pytest.approx(float(update.report.loss), abs=1e-6)
        assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-5)
        assert result["figures"] == pytest.approx(update.report.figures(), abs=1e-6)
    # every rank took the same step: the same summed gradients, bit for bit (Adam's first step divides by
    # |g|, so against the one learner the weights may differ by up to 2 lr where a gradient is ~0)
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name
        torch.testing.assert_close(value, one.policy.state_dict()[name], atol=2.1 * SETTINGS["lr"], rtol=0)


def test_shards_saved_by_two_ranks_load_whole_into_one_learner(tmp_path):
    """torch.distributed.checkpoint: each rank writes its shards; one process (no group) reads them whole."""
    task, batch, rewards, ref = _rollout()
    one = Learner(task, torch.device("cpu"))
    one.update(batch, rewards, ref)
    folder = str(tmp_path / "checkpoint-1.dcp")
    result = ranks_step(2, SETTINGS, batch, rewards, ref, "fsdp", folder)[0]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"], "each rank wrote its own"
    loaded = Learner(task, torch.device("cpu"))
    loaded.load_shards(folder)
    for name, value in loaded.policy.state_dict().items():
        assert torch.equal(value, result["weights"][name]), name
    for p, q in zip(loaded.policy.parameters(), one.policy.parameters(), strict=True):  # Adam's moments came too
        torch.testing.assert_close(
            loaded.optim.state[p]["exp_avg"], one.optim.state[q]["exp_avg"], atol=1e-8, rtol=1e-5
        )
        assert int(loaded.optim.state[p]["step"]) == 1
    os.remove(os.path.join(folder, "__1_0.distcp"))  # as if rank 1 had written to another host's disk
    assert missing_files(folder) == ["__1_0.distcp"], "what rank 0 checks after saving, to refuse a split checkpoint"


def test_a_resumed_learner_draws_the_randomness_an_uninterrupted_one_would(tmp_path, monkeypatch):
    """A loss that draws random numbers (a policy's dropout kept, ``--no-disable-dropout``; a task's own draws):
    resumed from a checkpoint, the learner drew the fresh run's first numbers again (seeded as it was built, and no
    checkpoint holds a random state), so the resumed steps were not the run's. Each update's randomness follows
    the optimiser steps taken, which the checkpoint restores."""
    from pipeline.learning import checkpoint

    task, batch, rewards, ref = _rollout()
    draws: list[float] = []
    loss = task.loss

    def drawing_loss(*args: object, **kwargs: object) -> object:
        draws.append(float(torch.rand(())))
        return loss(*args, **kwargs)

    monkeypatch.setattr(task, "loss", drawing_loss)
    whole = Learner(task, torch.device("cpu"))
    whole.update(batch, rewards, ref)
    checkpoint.save(str(tmp_path), {"step": 1, **whole.state()})
    first = len(draws)
    whole.update(batch, rewards, ref)
    resumed = Learner(task, torch.device("cpu"))
    resumed.resume(str(tmp_path))
    resumed.update(batch, rewards, ref)
    run_on, after_resume = draws[first : 2 * first], draws[2 * first :]
    assert run_on != draws[:first], "each update draws afresh"
    assert after_resume == run_on
    for name, value in whole.policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[name], value), name


def test_a_checkpoint_split_across_the_ranks_disks_is_refused_on_every_rank(tmp_path):
    """Ranks on hosts without a shared disk each write their shard to their own: rank 0 found the shards missing
    and raised alone, while the others went on into the next collective (the export's gather) and waited there
    until the collective timeout. Every rank hears the refusal now."""
    _task, batch, rewards, ref = _rollout()
    folder = str(tmp_path / "checkpoint-1{rank}.dcp")
    results = ranks_step(2, SETTINGS, batch, rewards, ref, "fsdp", folder)
    assert "__1_0.distcp are not in" in results[0]["saved"], results[0]["saved"]
    assert "rank 0 found the checkpoint's shards missing" in results[1]["saved"], results[1]["saved"]
    assert os.path.exists(str(tmp_path / "checkpoint-1-1.dcp" / "__1_0.distcp")), "rank 1 wrote to its own disk"


def test_sharded_ranks_with_uneven_passes_run_as_many_and_learn_the_same():
    """Passes of 7 rows over 24 rows split 12/12 give rank 0 two passes and rank 1 three: rank 0 runs one idle."""
    share = [RankShare(rank, 2) for rank in range(2)]
    slices = [slice(start, start + 1) for start in range(5)]
    assert [len(s.passes(slices, 5)) for s in share] == [2, 3]
    task, batch, rewards, ref = _rollout()
    settings = {**SETTINGS, "micro_batch": 7}  # 24 rows: passes of 7, 7, 7, 3 -> rank 0 gets 2, rank 1 gets 3
    task = DigitsTask(resolve(Config(**settings)))  # type: ignore[arg-type]
    one = Learner(task, torch.device("cpu"))
    update = one.update(batch, rewards, ref)
    results = ranks_step(2, settings, batch, rewards, ref, "fsdp")
    assert [len(r["passes"]) + r["idle"] for r in results] == [3, 3] and [r["idle"] for r in results] == [1, 0]
    for result in results:  # the idle pass adds nothing
        assert result["loss"] == pytest.approx(float(update.report.loss), abs=1e-6)
        assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-5)


def test_sharded_ranks_in_mini_batches_take_the_one_learners_steps():
    """--mini-batches 2 over two FSDP2 ranks: each mini-batch's rows shared between the ranks, two steps."""
    settings = {**SETTINGS, "mini_batches": 2}
    task = DigitsTask(resolve(Config(**settings)))  # type: ignore[arg-type]
    _, batch, rewards, ref = _rollout()
    one = Learner(task, torch.device("cpu"))
    update = one.update(batch, rewards, ref)
    assert RankShare(1, 2).passes([slice(12, 17), slice(17, 22), slice(22, 24)], 24, slice(12, 24)) == [
        slice(18, 22),
        slice(22, 24),
    ]
    results = ranks_step(2, settings, batch, rewards, ref, "fsdp")
    for result in results:
        assert result["loss"] == pytest.approx(float(update.report.loss), abs=1e-6)
        assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-5)
        for name, value in result["weights"].items():  # two Adam steps: within 2 lr each of the one learner's
            torch.testing.assert_close(value, one.policy.state_dict()[name], atol=4.2 * SETTINGS["lr"], rtol=0)
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name


def test_a_rank_whose_peers_never_come_fails_within_the_deadline():
    store = Rendezvous("127.0.0.1", 2)
    mesh = this_host().spawn_procs({"procs": 2}, name="lonely-rank")
    try:
        rank = mesh.spawn("rank", LearnerRank, SETTINGS).slice(procs=1)  # rank 1 of 2, rank 0 never comes
        error = rank.join.call_one(store.address, 2, 2.0).get(timeout=60)
    finally:
        mesh.stop().get(timeout=30)
    assert error.startswith("RuntimeError: trainer rank 1 of 2: the group at 127.0.0.1:") and "within 2 s" in error, (
        error
    )
    assert "timeout" in error, error


def test_a_process_outside_the_session_that_joins_the_group_is_refused():
    """The store has no key: a joiner that has the address but not the token (never in the store) is found out."""
    mesh = this_host().spawn_procs({"procs": 2}, name="ranks")
    try:
        ranks = mesh.spawn("ranks", LearnerRank, SETTINGS)
        address = ranks.slice(procs=0).serve.call_one(2).get(timeout=30)
        stranger = dataclasses.replace(address, token=b"guessed" * 2)
        joins = [
            ranks.slice(procs=0).join.call_one(address, 2, 10.0),
            ranks.slice(procs=1).join.call_one(stranger, 2, 10.0),
        ]
        errors = [join.get(timeout=60) for join in joins]
    finally:
        mesh.stop().get(timeout=30)
    for rank, error in enumerate(errors):
        assert (
            error.startswith(f"RuntimeError: trainer rank {rank} of 2: rank(s) ")
            and "a process outside the session" in error
        ), error
    assert "rank(s) 1 of the group" in errors[0], "rank 0 names the stranger"


async def test_the_pipeline_with_two_trainer_ranks_trains_as_with_one(tmp_path, sockets_dir):
    """On-policy (sync) runs of one seed: the same rollouts, so the same steps, one rank or two (sharded or not)."""
    rows = {}
    for ranks, shard in ((1, "fsdp"), (2, "fsdp"), (2, "ddp")):
        run_dir = tmp_path / f"ranks{ranks}-{shard}"
        config = Config(
            steps=8, mode="sync", trainer_ranks=ranks, trainer_shard=shard, target_score=None, run_dir=str(run_dir)
        )
        result = await run_pipeline(config, quiet=True)
        assert result.steps == 8
        rows[ranks, shard] = read_rows(str(run_dir))
        assert load_checkpoint(str(run_dir))["step"] == 8
    one = rows[1, "fsdp"]
    for two in (rows[2, "fsdp"], rows[2, "ddp"]):
        assert [r["reward/mean"] for r in one[:3]] == [r["reward/mean"] for r in two[:3]], "the same first rollouts"
        for a, b in zip(one[:3], two[:3], strict=True):  # the first steps agree to float noise (Adam amplifies it)
            assert b["actor/loss"] == pytest.approx(a["actor/loss"], abs=1e-6)
            assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)


async def test_a_resumed_run_continues_with_another_number_of_ranks(tmp_path, sockets_dir):
    """Shards of two ranks resume on three sharded ones, on one (read whole), and the one's whole checkpoint on two."""
    run_dir = tmp_path / "run"
    await run_pipeline(Config(steps=4, trainer_ranks=2, target_score=None, run_dir=str(run_dir)), quiet=True)

    def shard_folders() -> list[str]:
        return [name for name in os.listdir(run_dir) if name.endswith(".dcp")]

    state = load_checkpoint(str(run_dir))
    assert "policy" not in state and shard_folders() == [state["shards"]], "the policy and Adam state are in shards"
    for ranks, shard, steps, sharded in (
        (3, "fsdp", 6, True),
        (1, "fsdp", 8, False),
        (2, "fsdp", 10, True),
    ):
        config = Config(steps=steps, trainer_ranks=ranks, trainer_shard=shard, target_score=None, run_dir=str(run_dir))
        result = await run_pipeline(config, quiet=True, resume=True)
        state = load_checkpoint(str(run_dir))
        assert result.steps == steps and state["step"] == steps
        assert ("shards" in state) == sharded and len(shard_folders()) == int(sharded), "only the newest is kept"


def test_resume_may_change_the_number_of_ranks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(Config(trainer_ranks=2, steps=10).to_dict()))
    assert parse_args(["--resume", str(tmp_path)])[0].trainer_ranks == 2
    assert parse_args(["--resume", str(tmp_path), "--trainer-ranks", "3"])[0].trainer_ranks == 3
    assert parse_args(["--resume", str(tmp_path), "--trainer-shard", "ddp"])[0].trainer_shard == "ddp"
    assert parse_args(["--trainer-ranks", "2"])[0].trainer_shard == "fsdp", "sharded by default"


def test_ranks_on_gpus_take_one_gpu_each_and_a_machine_short_of_gpus_is_refused(monkeypatch):
    """NCCL needs a GPU a rank: ranks take cuda:K, cuda:K+1, ... from the trainer's; too few GPUs is one clear line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_placement(Config(device="cuda", trainer_ranks=2))["trainer"] == torch.device("cuda")
    with pytest.raises(PlacementError, match=r"--trainer-ranks 2 on cuda:1: .* cuda:1..cuda:2, but this machine has 2"):
        check_placement(Config(devices={"trainer": "cuda:1"}, trainer_ranks=2))
    with pytest.raises(PlacementError, match=r"--trainer-ranks 3 on cuda: .* cuda:0..cuda:2"):
        check_placement(Config(device="cuda", trainer_ranks=3))
    config = Config(devices={"trainer": "cuda:1"}, trainer_ranks=3)
    assert trainer_rank_device(config, 0) == torch.device("cuda", 1)  # on a host of its own (Ray): from K
    with pytest.raises(RuntimeError, match=r"a rank needs cuda:2, but its host has 2 CUDA device\(s\)"):
        trainer_rank_device(config, 1)
    assert trainer_rank_device(Config(trainer_ranks=3), 2) == torch.device("cpu"), "on CPUs every rank shares the CPU"


@pytest.mark.gpu
def test_more_trainer_ranks_than_gpus_is_refused_before_anything_starts(tmp_path):
    ranks = torch.cuda.device_count() + 1
    flags = ["--device", "cuda", "--transport", "cuda-ipc", "--trainer-ranks", str(ranks), "--steps", "3"]
    out = run_python("-m", "pipeline.grpo", *flags, "--run-dir", str(tmp_path / "run"), timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "the ranks take one GPU each" in lines[0], out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two trainer ranks on GPUs need two GPUs (NCCL: one a rank)")
@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_two_trainer_ranks_train_on_two_gpus_over_nccl(tmp_path, shard):
    run_dir = tmp_path / "run"
    flags = ["--device", "cuda", "--transport", "cuda-ipc", "--trainer-ranks", "2", "--trainer-shard", shard]
    out = run_python("-m", "pipeline.grpo", *flags, "--steps", "400", "--quiet", "--run-dir", str(run_dir), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "target 0.99 reached" in out.stdout, out.stdout
    rows = read_rows(str(run_dir))
    assert rows and all(r["weights/update_mb"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("shard", ["fsdp", "ddp"])
def test_a_rank_on_a_gpu_joins_over_nccl_and_takes_the_one_learner_step(shard):
    """One GPU is enough for one rank: NCCL bound to the rank's GPU, the policy staged on the host and sharded onto it."""
    task, batch, rewards, ref = _rollout()
    one = Learner(task, torch.device("cpu"))
    update = one.update(batch, rewards, ref)
    (result,) = ranks_step(1, SETTINGS, batch, rewards, ref, shard, timeout=180, device="cuda")
    assert result["backend"] == "nccl" and result["device"] == "cuda:0" and result["on_device"] == ["cuda:0"]
    assert result["reference_on"] == ["cpu"], "the reference copy takes no GPU memory"
    assert result["loss"] == pytest.approx(float(update.report.loss), rel=1e-4, abs=1e-5)
    assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-4)
    for name, value in result["weights"].items():
        torch.testing.assert_close(value, one.policy.state_dict()[name], atol=2.1 * SETTINGS["lr"], rtol=0)


def test_a_parameter_no_rank_used_keeps_no_gradient_so_adam_leaves_it_as_one_learner_would():
    """A parameter no rank's passes reached (an expert no token was routed to) has no gradient in one learner, and
    Adam skips it; the ranks' sum gave it zeros, and Adam moved it along its momentum. Whether any rank had a
    gradient is summed with the gradients: one that none had keeps none (one that some had is summed)."""
    from pipeline.learning import DataParallel

    rendezvous = Rendezvous("127.0.0.1", 1)
    group = DataParallel(RankShare(0, 1), rendezvous.address, torch.device("cpu"), rendezvous=rendezvous)
    try:
        used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        module = torch.nn.ModuleList([used, unused])
        optim = torch.optim.Adam(module.parameters(), lr=0.1)
        for step in range(2):  # the first step gives both momentum; the second reaches only ``used``
            optim.zero_grad()
            (used(torch.ones(1, 3)).sum() + (unused(torch.ones(1, 3)).sum() if step == 0 else 0)).backward()
            before = unused.weight.detach().clone()
            group.sum_gradients(module)
            assert (unused.weight.grad is None) == (step == 1)
            assert used.weight.grad is not None and torch.equal(used.weight.grad, torch.ones(3, 3))
            optim.step()
        assert torch.equal(unused.weight, before), "Adam skipped it, as in one learner"
    finally:
        group.close()


def test_sharded_ranks_routing_rows_to_different_experts_sum_each_experts_own_gradients():
    """FSDP2 reduce-scatters the gradients a rank has: rank 0's rows reached expert 0 only, rank 1's expert 1
    only, so rank 0 sent expert 0's and rank 1 expert 1's in the same collective, and the shapes being equal,
    each expert got the other's gradient added to its own (other shapes: a mismatch, or a wait to the timeout).
    An expert a rank did not use counts zero there; each expert's gradient is its own rows'."""
    from pipeline_support import ExpertRank

    mesh = this_host().spawn_procs({"procs": 2}, name="expert-ranks")
    try:
        ranks = mesh.spawn("ranks", ExpertRank)
        address = ranks.slice(procs=0).serve.call_one(2).get(timeout=30)
        results = [report for _, report in ranks.step.call(address).get(timeout=120).items()]
    finally:
        mesh.stop().get(timeout=30)
    # each expert's gradient in one process: its rows only (x of 1s through expert 0, of 2s through expert 1)
    for result in results:
        for expert, value in ((0, 1.0), (1, 2.0)):
            assert torch.equal(result[f"blocks.0.experts.{expert}.weight"], torch.full((4, 4), value)), (expert, result)
            assert torch.equal(result[f"blocks.0.experts.{expert}.bias"], torch.ones(4)), (expert, result)


def test_every_rank_rank_0_too_sends_gloo_over_its_session_address(monkeypatch):
    """Rank 0 left its gloo interface to the machine's name, which on a cluster may resolve to loopback (Debian's
    127.0.1.1): ranks on other hosts were sent there and the group did not form. Every rank now picks the interface
    of the address it serves the session on, unless the user chose one."""
    from pipeline.learning import DataParallel, _data_parallel

    chosen: list[str] = []
    monkeypatch.setattr(_data_parallel, "bind_host", lambda: "10.0.0.5")
    monkeypatch.setattr(_data_parallel, "use_interface_of", chosen.append)
    rendezvous = Rendezvous("127.0.0.1", 1)
    DataParallel(RankShare(0, 1), rendezvous.address, torch.device("cpu"), rendezvous=rendezvous).close()
    assert chosen == ["10.0.0.5"]


async def test_the_ranks_collectives_wait_as_long_as_collective_timeout_says(tmp_path, sockets_dir):
    """``--collective-timeout`` bounds each collective, the group's forming too (before: 60 s, fixed, however long
    the ranks' passes could differ): a rank later than it fails the run, naming the deadline."""
    from pipeline import Roles

    config = Config(steps=2, trainer_ranks=2, collective_timeout=1.5, run_dir=str(tmp_path))
    assert LATE_JOIN_S > 2 * config.collective_timeout
    with pytest.raises(Exception, match=r"did not form within 1\.5 s"):
        await run_pipeline(config, quiet=True, roles=Roles(trainer_rank=LateJoiningRank))
