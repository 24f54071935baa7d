"""The GRPO pipeline: a real run, its outputs, its modes, resume, failures and Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from harness import ROOT, actor_pids, run_python, wait_for
from pipeline_support import (
    DrainFailingGenerator,
    DtypeGenerator,
    DtypeRefModel,
    DyingOnRejoinTrainer,
    FailingScorer,
    ForbiddenRefModel,
    HookedGenerator,
    ProbeGenerator,
    SlowCheckpointTrainer,
    StuckStartTrainer,
    SyncRecordingRefModel,
)

from pipeline import Config, DigitsTask, PipelineError, Roles, resolve, run_pipeline
from pipeline.learning.checkpoint import load as load_checkpoint
from pipeline.run import read_rows

#: Keys every metrics.jsonl row has (docs/pipeline.md defines each).
FIELDS = {
    "step",
    "time",
    "version",
    "generator",
    "reward/mean",
    "reward/std",
    "reward/group_std",
    "reward/frac_zero_std",
    "accuracy/train",
    "score",
    "actor/loss",
    "actor/pg_loss",
    "actor/kl",
    "actor/clip_fraction",
    "actor/dual_clip_fraction",
    "actor/off_policy_masked_fraction",
    "actor/vespo_weight",
    "actor/entropy",
    "actor/entropy_coef",
    "actor/entropy_trained",
    "actor/grad_norm",
    "actor/lr",
    "response_length/mean",
    "tokens/step",
    "staleness/lag",
    "staleness/mean",
    "staleness/max",
    "staleness/dropped",
    "timing/wait_batch_ms",
    "timing/train_ms",
    "timing/publish_ms",
    "timing/delivery_ms",
    "timing/install_ms",
    "timing/weight_sync_ms",
    "timing/wait_policy_ms",
    "timing/generate_ms",
    "weights/update_mb",
    "memory/trainer_peak_gpu_gb",
    "memory/generator_peak_gpu_gb",
    "memory/trainer_reserved_gpu_gb",
    "memory/generator_reserved_gpu_gb",
    "perf/steps_per_s",
    "perf/tokens_generated_per_s",
    "perf/tokens_trained_per_s",
    "perf/trainer_idle_ratio",
    "perf/generator_idle_ratio",
    "queue/trainer",
    "queue/scorer",
    "queue/ref",
}
BANDIT = "bandit"


def cli(*args: str, slow_export_s: float = 0, **kwargs) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
    path = os.pathsep.join([os.path.dirname(__file__), ROOT])
    env = dict(os.environ, PYTHONPATH=path, SLOW_EXPORT_S=str(slow_export_s))  # SlowExportBandit's export
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.grpo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        **kwargs,
    )


def test_the_default_run_learns_the_digit_task_and_writes_its_outputs(tmp_path):
    """``python -m pipeline.grpo`` as the README runs it: reverse 6 digits from ~0 to the 0.99 target."""
    run_dir = tmp_path / "run"
    proc = cli("--run-dir", str(run_dir), "--quiet", "--steps", "400")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert "target 0.99 reached" in out, out
    rows = read_rows(str(run_dir))
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(FIELDS <= set(r) for r in rows), FIELDS - set(rows[-1])
    evaluations = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert evaluations[0] < 0.2 and evaluations[-1] >= 0.99, evaluations
    assert rows[0]["reward/mean"] < 0.3 < rows[-1]["reward/mean"]
    assert all(0 <= r["reward/frac_zero_std"] <= 1 and r["reward/group_std"] <= r["reward/std"] + 1e-6 for r in rows)
    assert all(r["tokens/step"] > 0 and 1 <= r["response_length/mean"] <= 8 for r in rows)
    assert all(0 <= r["perf/trainer_idle_ratio"] <= 1 and 0 <= r["perf/generator_idle_ratio"] <= 1 for r in rows)
    assert all(r["staleness/max"] <= Config().max_staleness and r["actor/kl"] >= 0 for r in rows)
    assert rows[-1]["staleness/dropped"] == 0, "nothing is generated to be dropped"
    assert any(r["timing/delivery_ms"] is not None for r in rows), "generators report when updates reached them"
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["task"] == "reverse" and saved["lr"] == DigitsTask.defaults["lr"], "the task's defaults are recorded"
    assert (saved["loss"], saved["scale_rewards"], saved["epsilon_high"], saved["dual_clip"]) == (
        "dapo",
        "group",
        saved["clip"],
        3.0,
    ), "every setting of the run is recorded, resolved"
    for name in ("mask_truncated", "micro_batch", "max_grad_norm", "lr_schedule", "warmup_steps", "dtype"):
        assert name in saved, name
    state = load_checkpoint(str(run_dir))
    assert state["step"] == len(rows) and state["version"] == len(rows)


async def test_sync_mode_is_on_policy(tmp_path, sockets_dir):
    result = await run_pipeline(Config(steps=30, mode="sync", generators=2, run_dir=str(tmp_path)), quiet=True)
    rows = read_rows(str(tmp_path))
    assert result.steps == 30 and len(rows) == 30
    assert {r["staleness/lag"] for r in rows} == {0} and result.dropped == 0
    assert {r["generator"] for r in rows} == {0, 1}, "sync mode takes turns over the generators"


async def test_without_a_kl_term_no_reference_model_runs(tmp_path, sockets_dir):
    """β = 0: the scorer feeds the trainer; no RefModel process, no reference pass."""
    config = Config(steps=30, task=BANDIT, kl_coeff=0.0, run_dir=str(tmp_path))
    result = await run_pipeline(config, quiet=True, roles=Roles(ref=ForbiddenRefModel))
    rows = read_rows(str(tmp_path))
    assert result.steps == 30 and all(r["actor/kl"] == 0 and r["queue/ref"] == 0 for r in rows)


@pytest.mark.parametrize("staleness", [0, 2])
async def test_the_staleness_bound_holds_and_nothing_is_generated_to_be_dropped(tmp_path, sockets_dir, staleness):
    config = Config(steps=60, task=BANDIT, generators=2, max_staleness=staleness, max_inflight=3, run_dir=str(tmp_path))
    result = await run_pipeline(config, quiet=True)
    rows = read_rows(str(tmp_path))
    assert all(0 <= r["staleness/lag"] <= staleness for r in rows), "no rollout older than the bound is trained on"
    assert result.dropped == 0 and rows[-1]["staleness/dropped"] == 0
    assert sum(result.rollouts.values()) == 60, "one rollout per step: none wasted, none past the last step"
    assert {r["generator"] for r in rows} == {0, 1}


async def test_bfloat16_runs_hold_and_send_bfloat16_weights_and_train_float32_masters(tmp_path, sockets_dir):
    """--dtype bfloat16: generators and the reference hold bf16, each update is half the bytes, the trainer float32."""
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        run_dir = tmp_path / dtype
        config = Config(steps=20, dtype=dtype, kl_coeff=0.02, run_dir=str(run_dir), target_score=None)
        result = await run_pipeline(config, quiet=True, roles=Roles(generator=DtypeGenerator, ref=DtypeRefModel))
        rows = read_rows(str(run_dir))
        assert result.steps == 20
        assert set((run_dir / "dtypes").read_text().splitlines()) == {f"generator torch.{dtype}", f"ref torch.{dtype}"}
        assert all(r["mismatch/logp_abs"] >= 0 for r in rows) and all(r["actor/loss"] == r["actor/loss"] for r in rows)
        sizes[dtype] = {r["weights/update_mb"] for r in rows}
        assert all(r["memory/trainer_peak_gpu_gb"] is None for r in rows), "no GPU memory on a CPU"
        masters = load_checkpoint(str(run_dir))["policy"]
        assert {value.dtype for value in masters.values() if value.is_floating_point()} == {torch.float32}
    (fp32,), (bf16,) = sizes["float32"], sizes["bfloat16"]
    assert fp32 > 0 and bf16 == pytest.approx(fp32 / 2, rel=0.01), sizes


async def test_resume_continues_steps_and_versions(tmp_path, sockets_dir):
    """... and the count of duplicate rollouts dropped (``staleness/dropped``, cumulative: it restarted at 0), and
    the last held-out score until the next evaluation (it was none: ``score: null`` rows, and a ``--target-score``
    already met went unnoticed until then). A resume that asks for no step more is refused, its settings kept
    (before: it saved the same state again, and drew the abandoned run's rows past the checkpoint)."""
    from pipeline.config import SettingsError
    from pipeline.learning import checkpoint

    config = Config(steps=20, run_dir=str(tmp_path), checkpoint_every=10, eval_every=20)
    await run_pipeline(config, quiet=True)
    before = load_checkpoint(str(tmp_path))
    assert before["dropped"] == 0 and before["score"] == read_rows(str(tmp_path))[19]["score"] is not None
    checkpoint.save(str(tmp_path), {**before, "dropped": 3})  # (as if a restarted generator's tickets came twice)
    config.steps = 15
    with pytest.raises(SettingsError, match="its checkpoint is at step 20, and --steps 15 asks for no step more"):
        await run_pipeline(config, resume=True, quiet=True)
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 20
    config.steps = 30
    result = await run_pipeline(config, resume=True, quiet=True)
    rows = read_rows(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert rows[20]["version"] == before["version"] + 1, "versions continue monotonically"
    assert all(row["staleness/dropped"] >= 3 for row in rows[20:])
    assert rows[20]["score"] == before["score"], "the last score carried forward, as without the interruption"
    assert result.steps == 30 and load_checkpoint(str(tmp_path))["version"] == 30
    after = load_checkpoint(str(tmp_path))
    assert torch.equal(after["ref"]["embed.weight"], before["ref"]["embed.weight"]), "the reference stays frozen"
    assert not torch.equal(after["policy"]["embed.weight"], before["policy"]["embed.weight"])


def test_a_tasks_numpy_score_is_checkpointed_as_a_float_a_resume_loads(tmp_path):
    """A user task's ``evaluate`` returning numpy numbers (``np.mean``): kept as they came, they made every
    checkpoint one a weights-only load refuses, so the run could never be resumed."""
    from types import SimpleNamespace

    import numpy as np

    from pipeline.learning import checkpoint
    from pipeline.roles import Trainer

    trainer = SimpleNamespace(
        step=3, version=3, dropped=0, evaluation={"score": np.float64(0.5)}, score=np.float64(0.5)
    )
    checkpoint.save(str(tmp_path), Trainer._counters(trainer))  # type: ignore[arg-type]
    saved = checkpoint.load(str(tmp_path))
    assert saved["score"] == 0.5 and type(saved["score"]) is float and saved["evaluation"] == {"score": 0.5}
    assert checkpoint.saved_step(str(tmp_path)) == 3


async def test_a_synced_reference_reaches_the_reference_model_and_the_checkpoint(tmp_path, sockets_dir):
    """--sync-ref-model: every 3 steps the trainer mixes the policy into the reference and the RefModel installs it
    before it scores the next rollout (a rollout granted after a sync is scored with it); the checkpoint keeps it."""
    config = Config(
        steps=12,
        lr=1e-2,
        kl_coeff=0.05,
        sync_ref_model=True,
        ref_model_sync_steps=3,
        ref_model_mixup_alpha=0.5,
        run_dir=str(tmp_path),
    )
    initial = DigitsTask(resolve(config)).build_policy  # the seed's policy: the reference before any sync
    torch.manual_seed(config.seed)
    start = {name: value.clone() for name, value in initial().state_dict().items()}
    result = await run_pipeline(config, quiet=True, roles=Roles(ref=SyncRecordingRefModel))
    assert result.steps == 12
    records = [line.split() for line in (tmp_path / "ref_syncs.txt").read_text().splitlines()]
    # the reference's version: 1 as initialised, 1 + k after the k-th sync
    by_ticket = sorted((int(ticket), int(version), float(checksum)) for ticket, version, checksum in records)
    versions = [v for _, v, _ in by_ticket]
    assert versions == sorted(versions) and versions[0] == 1 and versions[-1] >= 3, by_ticket
    # training step s grants ticket s + 3 (2 generators x 2 in flight), after that step's sync
    assert all(v >= 2 for t, v, _ in by_ticket if t >= 6) and all(v >= 3 for t, v, _ in by_ticket if t >= 9)
    checksums = {v: c for _, v, c in by_ticket}
    assert len(set(checksums.values())) == len(checksums), "each sync installed other weights"
    saved = load_checkpoint(str(tmp_path))["ref"]
    assert not torch.equal(saved["embed.weight"], start["embed.weight"]), "the checkpoint keeps the mixed reference"
    # resumed, the RefModel starts from the checkpoint's reference (the sync at step 12), bit for bit
    (tmp_path / "ref_syncs.txt").unlink()
    config.steps = 13
    await run_pipeline(config, resume=True, quiet=True, roles=Roles(ref=SyncRecordingRefModel))
    model = initial()
    model.load_state_dict(saved)
    want = sum(float(p.detach().double().sum()) for p in model.parameters())
    (first,) = [line.split() for line in (tmp_path / "ref_syncs.txt").read_text().splitlines()]
    assert first[:2] == ["12", "1"] and float(first[2]) == want  # the resumed trainer publishes it as version 1


def test_roles_with_several_torch_threads_start_after_the_program_ran_its_own_pool(tmp_path):
    """A program that ran torch on 2 threads, then a run with --threads 2: no worker hangs on the inherited pool."""
    script = (
        "import torch, uvloop\n"
        "from pipeline import Config, run_pipeline\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(512, 512) @ torch.ones(512, 512)  # starts the OpenMP pool in this process\n"
        f"config = Config(task='bandit', steps=10, threads=2, run_dir={str(tmp_path)!r})\n"
        "print('steps', uvloop.run(run_pipeline(config, quiet=True)).steps)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT]))
    proc = run_python("-c", script, timeout=90, env=env)
    assert proc.returncode == 0 and "steps 10" in proc.stdout, proc.stdout + proc.stderr


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    """... and what a killed save left there (a staging file and folder under a pid now gone) is removed first; a
    live process's staging is left alone."""
    (tmp_path / "config.json").write_text(json.dumps({"steps": 10}))
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f"checkpoint.pt.tmp-{gone.pid}").write_bytes(b"half a checkpoint")
    (tmp_path / f"model.tmp-{gone.pid}").mkdir()
    (tmp_path / f"model.tmp-{gone.pid}" / "model.safetensors").write_bytes(b"half a model")
    live = tmp_path / f"checkpoint.pt.tmp-{os.getpid()}"
    live.write_bytes(b"being written")
    proc = cli("--resume", str(tmp_path))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "no checkpoint" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", live.name])


async def test_an_export_that_fails_leaves_the_checkpoint_of_its_step_written(tmp_path, sockets_dir):
    """The trainer exports the model, then writes ``checkpoint.pt``: an export that failed (a full disk) left no
    checkpoint of the step, and one failing at every save stopped every checkpoint. The checkpoint, which a resume
    needs, is written all the same; the export's failure still fails the run, naming it."""
    config = Config(steps=3, task="pipeline_support:FullDiskExportBandit", run_dir=str(tmp_path), stop_grace=0)
    with pytest.raises(PipelineError, match=r"the trainer failed: .*No space left on device \(the export\)"):
        await asyncio.wait_for(run_pipeline(config, quiet=True), 60)
    assert checkpoint_step(str(tmp_path)) == 3


@pytest.mark.parametrize("writer", ["gone", "pid_reused"])
@pytest.mark.parametrize("killed", ["between_the_renames", "removing_the_old_model"])
def test_an_export_killed_part_way_leaves_the_new_model_in_place(tmp_path, killed, writer):
    """The export writes ``model.tmp-<tag>``, renames ``model`` to ``model.old-<tag>``, the staging to ``model``,
    and removes the old one. Killed between the renames, the next start removed the complete new model as a
    half-written staging folder (no ``model`` at all); killed while it removed the old one, a whole model's copy
    stayed for good. Both are finished now: the complete staging goes into place, the old copy goes. Also when the
    writer's pid now names another process (a resume in a new container gets the killed run's pids): the tag's
    start time tells them apart (before, by pid alone, the leftovers counted as a live save's and stayed)."""
    from pipeline.learning.checkpoint import remove_stale_staging

    gone = subprocess.Popen(["true"])
    gone.wait()
    tag = str(gone.pid) if writer == "gone" else f"{os.getpid()}.1"  # (this process, started later than tick 1)
    new, old = tmp_path / f"model.tmp-{tag}", tmp_path / f"model.old-{tag}"
    (new if killed == "between_the_renames" else tmp_path / "model").mkdir()
    old.mkdir()
    for folder, weights in ((new, b"new"), (tmp_path / "model", b"new"), (old, b"old")):
        if folder.exists():
            (folder / "model.safetensors").write_bytes(weights)
    remove_stale_staging(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == b"new"


def test_a_folder_replaced_whole_is_synced_and_survives_what_an_earlier_swap_left(tmp_path, monkeypatch):
    """The model's export (and a LoRA adapter's save) swaps folders by renames: an earlier swap of this process
    whose removal of the old folder stopped part-way (a file still open on NFS) left ``model.old-<pid>``, and the
    next save's rename onto it failed (``ENOTEMPTY``). It is cleared first; the new files are synced before the
    swap, and the run folder after it."""
    from pipeline.models import process_tag, replace_folder, staging_folder

    target = tmp_path / "model"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    leftover = tmp_path / f"model.old-{process_tag()}"
    leftover.mkdir()
    (leftover / "model.safetensors").write_text("older")
    staging = staging_folder(str(target))
    os.mkdir(staging)
    with open(os.path.join(staging, "model.safetensors"), "w") as f:
        f.write("new")
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    replace_folder(staging, str(target))
    assert (target / "model.safetensors").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "model"
    ]
    assert synced == [os.path.join(staging, "model.safetensors"), staging, str(tmp_path)], synced


def test_a_checkpoint_reaches_the_disk_before_it_replaces_the_last_one(tmp_path, monkeypatch):
    """Renamed into place unsynced, a power loss or a node's crash (XFS, NFS) could leave ``checkpoint.pt`` empty
    with the shards of the one before already removed: nothing to resume from. It is synced, then renamed, then
    its folder synced, and only then are older shards removed."""
    from pipeline.learning import checkpoint
    from pipeline.models import process_tag

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd),
    )
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    monkeypatch.setattr(checkpoint, "remove_shards", lambda run_dir, keep=None: events.append("remove shards"))
    checkpoint.save(str(tmp_path), {"step": 3})
    tag = process_tag()
    assert events == [f"fsync checkpoint.pt.tmp-{tag}", "replace", f"fsync {tmp_path.name}", "remove shards"], events
    assert checkpoint.load(str(tmp_path)) == {"step": 3}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "juggle"], "unknown task 'juggle'"),
        (["--task", "pipeline.config:Config"], "must be a subclass of pipeline.Task"),
        (["--task", "no_such_module:Task"], "No module named 'no_such_module'"),
        (["--target-score", "high"], "'high' is not a number"),
        (["--model", "huge"], "--model huge: the built-in tasks train a preset (tiny, small, gpu-300m)"),
    ],
)
def test_a_bad_task_flag_is_one_clear_usage_error(tmp_path, flags, message):
    proc = cli(*flags, "--run-dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and message in err and "Traceback" not in err, err


def test_a_task_that_does_not_fit_the_model_fails_before_anything_starts(tmp_path):
    before = actor_pids()
    proc = cli("--digits", "12", "--task", "add", "--run-dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "does not fit model preset 'tiny'" in err and "Traceback" not in err, err
    assert actor_pids() == before


async def test_custom_task_by_subclassing(tmp_path, sockets_dir):
    config = Config(steps=30, task="pipeline_support:WideBandit", run_dir=str(tmp_path))
    result = await run_pipeline(config, quiet=True)
    assert result.steps == 30 and set(result.evaluation) == {"score"}
    state = load_checkpoint(str(tmp_path))
    assert state["policy"]["2.weight"].shape[0] == 6, "the policy was built by the custom task"
    rows = read_rows(str(tmp_path))
    assert rows[0]["accuracy/train"] is None, "a task without exact answers reports no accuracy"


async def test_a_failing_role_stops_the_run_with_its_name(tmp_path, sockets_dir):
    started = time.monotonic()
    config = Config(steps=500, task=BANDIT, run_dir=str(tmp_path))
    with pytest.raises(PipelineError, match="scorer exploded on purpose"):
        await run_pipeline(config, quiet=True, roles=Roles(scorer=FailingScorer))
    assert time.monotonic() - started < 30


async def test_a_generator_that_ignores_its_tickets_version_fails_the_run_saying_so(tmp_path, sockets_dir):
    """A (custom) generator that draws a ticket with a policy older than the ticket allows: the run fails at once
    naming the generator, the ticket and both versions. Before, the trainer granted the ticket again behind the
    generator's later ones, which it could not draw before that one was trained: it waited out
    ``--weights-timeout`` and the run failed with a message about waiting for weights."""
    from pipeline_support import VersionIgnoringGenerator

    config = Config(steps=50, task=BANDIT, max_staleness=0, run_dir=str(tmp_path))
    with pytest.raises(PipelineError, match=r"generator \d drew ticket \d+ with policy version -?\d+.* at least \d+"):
        await asyncio.wait_for(run_pipeline(config, quiet=True, roles=Roles(generator=VersionIgnoringGenerator)), 120)


@pytest.mark.parametrize("exits", [False, True], ids=["raises", "dies"])
async def test_a_generator_failing_after_training_ended_leaves_the_result_standing(tmp_path, sockets_dir, capfd, exits):
    """Training is over: a generator whose drain raises, or whose process dies there (and is restarted), is said on
    stderr and the run returns its result (it raised PipelineError; a restarted generator was rejoined, waited for
    grants that never came, and the run hung)."""
    config = Config(steps=6, task=BANDIT, generators=2, run_dir=str(tmp_path), extra={"drain_exit": exits})
    run = run_pipeline(config, quiet=True, roles=Roles(generator=DrainFailingGenerator))
    result = await asyncio.wait_for(run, 90)
    assert result.steps == 6 and load_checkpoint(str(tmp_path))["step"] == 6
    err = capfd.readouterr().err
    assert result.rollouts["generator 1"] > 0
    if exits:
        assert "generator 0" not in result.rollouts, "its count died with it"
        assert "generator 0 failed after training ended (the run's result stands)" in err, err[-2000:]
    else:
        assert result.rollouts["generator 0"] > 0
        assert "draining the generators failed after training ended" in err and "on purpose" in err, err[-2000:]


async def test_the_drain_once_training_ended_skips_a_generator_whose_run_ended(capfd):
    """A generator that died as training ended is restarted, and its new process may take a while to load its
    model: the drain asked every rank, so it waited for that process (up to ``DRAIN_GUARD``, 120 s) though the
    rank's run had ended and there was nothing to drain. Only the ranks still running are drained."""
    from types import SimpleNamespace

    from actors import ActorDied
    from pipeline.run import _launcher

    loop = asyncio.get_running_loop()
    dead: asyncio.Future[int] = loop.create_future()
    dead.set_exception(ActorDied("generator 0's process died"))
    running: asyncio.Future[int] = loop.create_future()
    drained: list[int] = []

    async def drain(rank: int) -> None:
        if rank == 0:
            await asyncio.Event().wait()  # the restarted process, still loading its model
        drained.append(rank)
        running.set_result(7)  # (its run returns its rollout count once drained)

    gens = SimpleNamespace(
        slice=lambda procs: SimpleNamespace(drain=SimpleNamespace(call_one=lambda: drain(procs))),
        drain=SimpleNamespace(call=lambda: drain(0)),  # the whole mesh's drain waits for every rank
    )
    tasks = {"generator 0": dead, "generator 1": running}
    names = ["generator 0", "generator 1"]
    ends: list[object] = []
    scorer_inlet = SimpleNamespace(send=ends.append)
    leftovers = _launcher._leftovers(gens, tasks, names, {0, 1}, scorer_inlet)  # type: ignore[arg-type]
    assert await asyncio.wait_for(leftovers, 10) == [None, 7]
    assert drained == [1] and ends == [], "each generator's own run sends its end of stream"
    assert "generator 0 failed after training ended (the run's result stands)" in capfd.readouterr().err


async def test_the_drain_once_training_ended_neither_drains_nor_waits_for_a_generator_still_rejoining():
    """A generator that died during training (the trainer's final save, minutes for a large model) was restarted
    and its rejoin was still waiting for the new process's model load: its task was not done, so the drain asked
    it and waited behind that constructor, up to ``DRAIN_GUARD`` (120 s). It owes nothing: its rejoin is cancelled,
    and its end of stream is sent to the scorer for it (which ends once every generator's stream has ended)."""
    from types import SimpleNamespace

    from pipeline.run import _launcher

    loop = asyncio.get_running_loop()
    rejoining: asyncio.Future[int] = asyncio.ensure_future(asyncio.Event().wait())  # (the model load never ends)
    running: asyncio.Future[int] = loop.create_future()
    drained: list[int] = []

    async def drain(rank: int) -> None:
        if rank == 0:
            await asyncio.Event().wait()  # behind the restarted process's constructor
        drained.append(rank)
        running.set_result(7)

    gens = SimpleNamespace(slice=lambda procs: SimpleNamespace(drain=SimpleNamespace(call_one=lambda: drain(procs))))
    ends: list[object] = []
    scorer_inlet = SimpleNamespace(send=ends.append)

    async def scoring() -> int:  # the scorer: it ends once both streams have (generator 1's own, 0's sent for it)
        await running
        await asyncio.sleep(0.05)  # (its last rollouts take a moment: the launcher must wait for them)
        return 3 if ends == [None] else -1

    scorer = asyncio.ensure_future(scoring())
    tasks = {"generator 0": rejoining, "generator 1": running, "scorer": scorer}
    names = ["generator 0", "generator 1"]
    leftovers = _launcher._leftovers(gens, tasks, names, {1}, scorer_inlet)  # type: ignore[arg-type]
    assert await asyncio.wait_for(leftovers, 10) == [None, 7]
    assert drained == [1] and rejoining.cancelled() and ends == [None]
    assert scorer.done() and not scorer.cancelled() and scorer.result() == 3, "the scorer's leftovers were waited for"


async def test_generator_hooks_run_in_the_worker_and_their_errors_propagate(tmp_path, sockets_dir):
    config = Config(steps=500, task=BANDIT, run_dir=str(tmp_path), extra={"hook_limit": 15})
    with pytest.raises(PipelineError, match=r"generator \d failed.*hook stopped generator"):
        await run_pipeline(config, quiet=True, roles=Roles(generator=HookedGenerator))


@pytest.mark.parametrize(
    "sig, code, word",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_ctrl_c_or_sigterm_stops_within_2s_and_leaves_a_checkpoint(tmp_path, sig, code, word):
    run_dir = tmp_path / "run"
    proc = cli("--task", "bandit", "--steps", "200000", "--run-dir", str(run_dir), "--quiet")
    try:
        metrics = run_dir / "metrics.jsonl"
        assert wait_for(lambda: metrics.exists() and metrics.stat().st_size > 5000, timeout=60)
        workers = actor_pids()
        start = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - start
        assert proc.returncode == code, out + err
        assert elapsed < 2.0, f"stopping took {elapsed:.2f}s"
        assert word in out and "--resume" in out
        assert wait_for(lambda: not (workers & actor_pids()), timeout=3)
        state = load_checkpoint(str(run_dir))
        assert state["step"] > 0 and state["version"] == state["step"]
    finally:
        proc.kill()
        proc.wait()


def test_no_step_is_trained_after_the_final_checkpoint_of_an_interrupted_run(tmp_path):
    """The final checkpoint told the trainer nothing: it trained on the rollouts queued while the run wrote its
    rows and stopped, and a periodic save then left a later checkpoint than the one the stop reported, with steps
    no row was written for (a resumed run's curve had a gap). The final checkpoint is the trainer's last step."""
    _, err, _ = _interrupt_and_check_every_row_is_kept(tmp_path / "run", ["--save-every", "1"], started=60)
    assert "final checkpoint written" in err, err


def test_ctrl_c_with_trainer_ranks_saves_the_shards_after_the_step_and_keeps_every_row(tmp_path):
    """The final checkpoint's save runs on every rank after the step in flight, never beside it (the other
    ranks were asked to save at once, and ran the save's collectives beside the step's); the metrics hold every
    step up to the checkpoint's, so a resumed run draws the whole curve."""
    out, err, state = _interrupt_and_check_every_row_is_kept(tmp_path / "run", ["--trainer-ranks", "2"], started=90)
    assert "interrupted" in out and "--resume" in out, out + err
    assert "shards" in state and state["step"] > 0


def _interrupt_and_check_every_row_is_kept(run_dir: Any, flags: list[str], started: float) -> tuple[str, str, Any]:
    """Ctrl-C a bandit run (with ``flags``) once it has trained a while (``started``: its guard, s); it exits 130 and
    its metrics hold every step up to its checkpoint's. Its stdout, stderr and checkpoint."""
    proc = cli("--task", "bandit", "--steps", "200000", *flags, "--run-dir", str(run_dir), "--quiet")
    try:
        metrics = run_dir / "metrics.jsonl"
        assert wait_for(lambda: metrics.exists() and metrics.stat().st_size > 5000, timeout=started)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out + err
        state = load_checkpoint(str(run_dir))
        steps = [row["step"] for row in read_rows(str(run_dir))]
        assert steps == list(range(1, state["step"] + 1)), (steps[-12:], state["step"])
        return out, err, state
    finally:
        proc.kill()
        proc.wait()


def _slow_export_run(run_dir, export_s: float, *flags: str) -> subprocess.Popen[str]:
    """The bandit with its final checkpoint's export taking ``export_s`` s, once it has trained a while."""
    task = ["--task", "pipeline_support:SlowExportBandit", "--steps", "200000", "--save-every", "0"]
    proc = cli(*task, "--run-dir", str(run_dir), "--quiet", *flags, slow_export_s=export_s)
    metrics = run_dir / "metrics.jsonl"
    if not wait_for(lambda: metrics.exists() and metrics.stat().st_size > 5000, timeout=60):
        proc.kill()
        raise AssertionError(f"the run never got going: {proc.communicate()}")
    return proc


def test_an_interrupted_run_waits_for_its_final_checkpoint_however_slow_the_disk(tmp_path):
    """Ctrl-C mid-run: the trainer's checkpoint of where it is gets its time (here 1.5 s), not half a second."""
    run_dir = tmp_path / "run"
    proc = _slow_export_run(run_dir, 1.5)
    try:
        workers = actor_pids()
        trained = len(read_rows(str(run_dir)))
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out + err
        assert "writing a final checkpoint" in err and "final checkpoint written" in err, err
        state = load_checkpoint(str(run_dir))  # --save-every 0: the interrupt's is the only one
        assert state["step"] >= trained > 0 and state["version"] == state["step"]
        assert wait_for(lambda: not (workers & actor_pids()), timeout=3)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("skip", ["second Ctrl-C", "grace over"])
def test_a_second_interrupt_or_the_grace_running_out_stops_without_the_final_checkpoint(tmp_path, skip):
    """A final checkpoint that would take a minute: a second Ctrl-C, or ``--stop-grace 1`` running out, stops the
    run at once, saying the checkpoint was not written (the run folder keeps the last one)."""
    run_dir = tmp_path / "run"
    proc = _slow_export_run(run_dir, 60, *(["--stop-grace", "1"] if skip == "grace over" else []))
    try:
        workers = actor_pids()
        proc.send_signal(signal.SIGINT)
        assert wait_for((run_dir / "export-started").exists, timeout=30), "the trainer never began its checkpoint"
        start = time.monotonic()
        if skip == "second Ctrl-C":
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
        assert proc.returncode == 130, out + err
        # measured 2.6 s after a second Ctrl-C and 3.6 s from the checkpoint's start with a 1 s grace (a process in
        # its export never answers the stop: it is killed 2.5 s in); the export itself would take 60 s
        assert elapsed < 8.0, f"stopping took {elapsed:.2f}s after the {skip}"
        said = "skipped" if skip == "second Ctrl-C" else "not written within 1 s"
        assert f"final checkpoint {said}" in err, err
        assert not (run_dir / "checkpoint.pt").exists()
        assert wait_for(lambda: not (workers & actor_pids()), timeout=3)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "victim, flags, named",
    [
        ("trainer.", [], "the trainer failed"),
        ("scorer.", [], "the scorer failed"),
        ("ref.", [], "the reference model failed"),
        # a rank blocked in a collective with the dead one must not hold the run up: it is named, not waited for
        ("trainer-ranks.1", ["--trainer-ranks", "3"], "the trainer failed: Actor call trainer.run failed: "),
    ],
    ids=["trainer", "scorer", "ref", "trainer-rank"],
)
def test_kill_9_of_a_role_stops_the_run_naming_it(tmp_path, victim, flags, named):
    run_dir = tmp_path / "run"
    proc = cli("--task", "bandit", "--steps", "200000", *flags, "--run-dir", str(run_dir), "--quiet")
    try:
        assert wait_for(lambda: (run_dir / "checkpoint.pt").exists(), timeout=60)
        pid = next(pid for pid in actor_pids() if _title(pid).startswith(f"actors[{victim}"))
        before = actor_pids()
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=15)
        elapsed = time.monotonic() - start
        assert proc.returncode == 1, out + err
        assert named in err and "died" in err, err
        if flags:
            assert "trainer rank 2 died during step" in err, err
        # the trainer may wait a moment for the dead rank's own failure, to name it, and the sharded ranks still
        # blocked in a collective with it take their stop's grace (3.17 s seen once under a full suite)
        limit = 4.0 if flags else 2.0
        assert elapsed < limit, f"the run took {elapsed:.2f}s to stop after {victim} died"
        assert wait_for(lambda: not (before & actor_pids()), timeout=3)
        assert load_checkpoint(str(run_dir))["step"] > 0, "the last checkpoint stays usable"
    finally:
        proc.kill()
        proc.wait()


async def test_a_role_failing_because_a_peer_died_is_not_named_for_it():
    """The scorer dies; a generator's send to it fails first (PortClosed): the scorer is the one named."""
    from actors import ActorDied, ActorError
    from pipeline.run import first_failure as _first_failure

    async def generator() -> None:
        raise ActorError(
            "actors._shared._errors.PortClosed", "the receiver of port 1 (pid 7) has exited", actor="generator"
        )

    async def scorer(peer: asyncio.Task[None]) -> None:
        await asyncio.wait([peer])  # its death is seen just after the generator's knock-on failure
        raise ActorDied("process 7 died: killed by SIGKILL", pid=7)

    gen = asyncio.ensure_future(generator())
    tasks = {"generator 0": gen, "scorer": asyncio.ensure_future(scorer(gen))}
    until = asyncio.ensure_future(asyncio.Event().wait())
    with pytest.raises(PipelineError, match="the scorer failed: process 7 died"):
        await asyncio.wait_for(_first_failure(tasks, until), 10)
    lonely = {"generator 0": asyncio.ensure_future(generator())}  # no dead peer to blame: named itself
    with pytest.raises(PipelineError, match="the generator 0 failed"):
        await asyncio.wait_for(_first_failure(lonely, until), 10)
    until.cancel()


async def test_a_rejoin_that_failed_because_the_trainer_died_names_the_trainer_whichever_ends_first():
    """A rejoin's call to the trainer fails as the trainer dies (``PeerDied``, a knock-on): the trainer is named,
    whether the rejoin's failure is seen first, in the same pass as the trainer's, or after the report stream ended
    (before, the pass went by the tasks' order: "the generator 0 failed")."""
    from actors import ActorDied
    from pipeline.run import first_failure as _first_failure
    from pipeline.run._failures import PeerDied

    async def rejoin() -> None:
        raise PeerDied("the trainer died as generator 0 rejoined")

    async def trainer(after: asyncio.Future[Any] | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        raise ActorDied("process 9 died: killed by SIGKILL", pid=9)

    first = asyncio.ensure_future(rejoin())
    orders = [
        {"generator 0": first, "trainer": asyncio.ensure_future(trainer(first))},  # the rejoin's failure first
        {"generator 0": asyncio.ensure_future(rejoin()), "trainer": asyncio.ensure_future(trainer(None))},  # together
    ]
    for tasks in orders:
        until = asyncio.ensure_future(asyncio.Event().wait())
        with pytest.raises(PipelineError, match="the trainer failed: process 9 died"):
            await asyncio.wait_for(_first_failure(tasks, until), 10)
        until.cancel()
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ended.set_exception(ConnectionError("the report stream ended"))  # (the run's watch ends before either is seen)
    tasks = {"generator 0": asyncio.ensure_future(rejoin()), "trainer": asyncio.ensure_future(trainer(None))}
    await asyncio.wait(list(tasks.values()))
    with pytest.raises(PipelineError, match="the trainer failed: process 9 died"):
        await asyncio.wait_for(_first_failure(tasks, ended), 10)  # type: ignore[arg-type]


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _first_rollouts(run_dir: str) -> list[tuple[int, int, int]]:
    """``(rank, pid, policy version)`` of each generator incarnation's first rollout."""
    try:
        with open(os.path.join(run_dir, "first_rollouts")) as f:
            return [tuple(map(int, line.split())) for line in f if line.strip()]  # type: ignore[misc]
    except FileNotFoundError:
        return []


async def _until(condition, timeout: float) -> None:  # type: ignore[no-untyped-def]
    """Re-check ``condition`` every 20 ms for at most ``timeout`` s (a guard, not a synchronisation)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_killed_generator_is_restarted_with_the_newest_weights(tmp_path, sockets_dir, capfd):
    run_dir = str(tmp_path)
    config = Config(steps=1200, task=BANDIT, generators=2, run_dir=run_dir)
    run = asyncio.ensure_future(run_pipeline(config, quiet=True, roles=Roles(generator=ProbeGenerator)))
    await _until(lambda: (len(_first_rollouts(run_dir)) == 2 and checkpoint_step(run_dir) > 0) or run.done(), 60)
    assert not run.done(), run.exception()
    _, victim, _ = next(entry for entry in _first_rollouts(run_dir) if entry[0] == 1)
    step_at_kill = checkpoint_step(run_dir)
    os.kill(victim, signal.SIGKILL)
    result = await asyncio.wait_for(run, 120)
    assert result.steps == 1200 and result.restarts == {"generator 1": 1}
    restarted = [entry for entry in _first_rollouts(run_dir) if entry[0] == 1 and entry[1] != victim]
    assert len(restarted) == 1, _first_rollouts(run_dir)
    _, new_pid, first_version = restarted[0]
    assert first_version >= step_at_kill, "the new generator's first rollout used the newest weights"
    assert result.rollouts["generator 1"] > 0, "the restarted generator produced until the end"
    err = capfd.readouterr().err
    assert f"generator 1 died (pid {victim})" in err and f"generator 1 restarted (pid {new_pid})" in err


async def test_a_trainer_that_dies_while_a_restarted_generator_rejoins_is_the_one_named(tmp_path, sockets_dir):
    """The launcher's rejoin of a restarted generator calls the trainer; the trainer dies in that call. The run
    names the trainer (before, the rejoin's failure, the trainer's death seen by that call, could be named first:
    "the generator 1 failed")."""
    run_dir = str(tmp_path)
    config = Config(steps=100000, task=BANDIT, generators=2, run_dir=run_dir, stop_grace=0)
    roles = Roles(generator=ProbeGenerator, trainer=DyingOnRejoinTrainer)
    run = asyncio.ensure_future(run_pipeline(config, quiet=True, roles=roles))
    await _until(lambda: len(_first_rollouts(run_dir)) == 2 or run.done(), 60)
    assert not run.done(), run.exception()
    os.kill(next(entry[1] for entry in _first_rollouts(run_dir) if entry[0] == 1), signal.SIGKILL)
    with pytest.raises(PipelineError, match=r"^the trainer failed: .*"):
        await asyncio.wait_for(run, 60)


async def test_a_generator_out_of_restarts_stops_the_run_naming_it(tmp_path, sockets_dir):
    run_dir = str(tmp_path)
    config = Config(steps=100000, task=BANDIT, generators=2, run_dir=run_dir, generator_restarts=0)
    run = asyncio.ensure_future(run_pipeline(config, quiet=True, roles=Roles(generator=ProbeGenerator)))
    await _until(lambda: len(_first_rollouts(run_dir)) == 2 or run.done(), 60)
    victim = next(entry[1] for entry in _first_rollouts(run_dir) if entry[0] == 0)
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(PipelineError, match=r"the generator 0 failed: .*died"):
        await asyncio.wait_for(run, 30)
    assert time.monotonic() - started < 2.0
    # The trainer lived on: the run left a checkpoint of where it stopped, and the rows of every step up to it
    # (before, a role's failure left only the last periodic checkpoint, here none, and dropped queued rows).
    # (the kill may come before the trainer's first step, under load: a checkpoint of step 0 is still its step)
    assert os.path.exists(os.path.join(run_dir, "checkpoint.pt")), "a final checkpoint of the trainer's step"
    saved = int(load_checkpoint(run_dir)["step"])
    assert set(range(1, saved + 1)) <= {row["step"] for row in read_rows(run_dir)}


def checkpoint_step(run_dir: str) -> int:
    try:
        return int(load_checkpoint(run_dir)["step"])
    except (FileNotFoundError, OSError, EOFError, RuntimeError):
        return 0


async def _until_file(path: str, run: asyncio.Future[Any]) -> None:
    deadline = time.monotonic() + 120  # a guard against a hang only
    while not os.path.exists(path) and not run.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert os.path.exists(path), "the role never got there"


async def test_an_interrupt_while_the_trainer_starts_writes_no_final_checkpoint(tmp_path, sockets_dir, capfd):
    """A trainer still starting has nothing new to save (a resumed sharded one would save its untrained policy over
    the checkpoint it resumes from, and remove the shards): interrupted then, the run writes no checkpoint."""
    config = Config(steps=100, task=BANDIT, run_dir=str(tmp_path))
    run = asyncio.ensure_future(run_pipeline(config, quiet=True, roles=Roles(trainer=StuckStartTrainer)))
    await _until_file(str(tmp_path / "starting"), run)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 30)
    assert not (tmp_path / "checkpoint.pt").exists()
    assert "final checkpoint" not in capfd.readouterr().err


async def test_a_role_failure_is_what_the_run_ends_with_even_if_its_final_checkpoint_is_interrupted(
    tmp_path, sockets_dir
):
    """A role fails, the trainer is asked for a final checkpoint, and the user interrupts the wait (as its message
    invites): the checkpoint is skipped, and the run still ends with the role's failure (before, the interrupt
    replaced it: exit 130 and no word of what failed)."""
    config = Config(steps=500, task=BANDIT, run_dir=str(tmp_path))
    run = asyncio.ensure_future(
        run_pipeline(config, quiet=True, roles=Roles(scorer=FailingScorer, trainer=SlowCheckpointTrainer))
    )
    await _until_file(str(tmp_path / "saving"), run)
    run.cancel()
    with pytest.raises(PipelineError, match="scorer exploded on purpose"):
        await asyncio.wait_for(run, 30)


async def test_a_role_whose_processes_cannot_start_stops_those_started_before_it(tmp_path, sockets_dir, monkeypatch):
    """The generators' processes cannot start (a Ray host lost, a spawn hand-over timed out): the trainer's, the
    scorer's and the reference model's processes, started before, lived on until the program exited (the meshes
    to stop were listed only once every start had returned), and the error was a traceback, not one line."""
    from actors import HostMesh

    spawn_procs = HostMesh.spawn_procs

    def refuse_generators(self: HostMesh, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("name") == "generators":
            raise RuntimeError("cannot spawn on a host mesh that lost a host")
        return spawn_procs(self, *args, **kwargs)

    monkeypatch.setattr(HostMesh, "spawn_procs", refuse_generators)
    before = actor_pids()
    config = Config(steps=5, task=BANDIT, run_dir=str(tmp_path))
    with pytest.raises(PipelineError, match="starting the roles' processes failed: cannot spawn on a host mesh"):
        await asyncio.wait_for(run_pipeline(config, quiet=True), 60)
    assert wait_for(lambda: not (actor_pids() - before), timeout=10), "every process started is stopped"


async def test_a_metrics_write_that_fails_is_named_not_blamed_on_the_trainer(tmp_path, sockets_dir, monkeypatch, capfd):
    """The launcher writes each step's row (a full disk): its failure ended the report stream, which was read as the
    trainer's failure: ``the trainer stopped reporting``, 2 s later. And no final checkpoint is written past the
    last row (before, it saved the trainer's step, and the steps between had no row, for good: a resume starts
    after the checkpoint)."""
    from pipeline.run import MetricsLog

    write = MetricsLog.write

    def full_disk(self: MetricsLog, report: Any) -> Any:
        if report.step > 2:
            raise OSError(28, "No space left on device")
        return write(self, report)

    monkeypatch.setattr(MetricsLog, "write", full_disk)
    config = Config(steps=100000, task=BANDIT, run_dir=str(tmp_path))
    with pytest.raises(PipelineError) as failed:
        await asyncio.wait_for(run_pipeline(config, quiet=True), 60)
    assert "writing the run's metrics failed: [Errno 28] No space left on device" in str(failed.value)
    assert "trainer" not in str(failed.value)
    assert "stopping: no final checkpoint (the run's rows could not be written)" in capfd.readouterr().err
    assert checkpoint_step(str(tmp_path)) <= 2 and [row["step"] for row in read_rows(str(tmp_path))] == [1, 2]


async def test_a_second_interrupt_while_the_roles_stop_still_ends_with_the_failure_and_closes_the_log(
    tmp_path, sockets_dir, monkeypatch
):
    """A role fails and, while the roles' processes stop, the user interrupts (a second Ctrl-C, SIGTERM): the
    interrupt cut the clean-up short (the metrics log never closed, its tracker's last events lost, a Ray cluster
    not released) and replaced the role's failure (exit 143, no word of what failed)."""
    from pipeline.run import MetricsLog, _launcher

    closed: list[str] = []
    close = MetricsLog.close

    def noted_close(self: MetricsLog) -> None:
        closed.append("closed")
        close(self)

    stop_quickly = _launcher._stop_quickly

    async def interrupted_stop(mesh: Any) -> None:
        run.cancel()  # (the second interrupt, as the processes stop)
        await stop_quickly(mesh)

    monkeypatch.setattr(MetricsLog, "close", noted_close)
    monkeypatch.setattr(_launcher, "_stop_quickly", interrupted_stop)
    config = Config(steps=500, task=BANDIT, run_dir=str(tmp_path), stop_grace=0.0)
    run = asyncio.ensure_future(run_pipeline(config, quiet=True, roles=Roles(scorer=FailingScorer)))
    with pytest.raises(PipelineError, match="scorer exploded on purpose"):
        await asyncio.wait_for(run, 60)
    assert closed == ["closed"]


async def test_an_interrupt_once_training_ended_keeps_the_result(tmp_path, sockets_dir, monkeypatch):
    """Ctrl-C while the generators drain their last rollouts (a large model's take a while): training was over and
    its last checkpoint written, but the interrupt threw the result away (exit 130, no ``done:``, no plot)."""
    from pipeline.run import _launcher

    async def slow_drain(*leftovers: Any) -> list[int | None]:  # (stands in for _leftovers, whatever it takes)
        run.cancel()  # (the user's Ctrl-C)
        await asyncio.Event().wait()  # a drain that would take its full guard
        raise AssertionError("not reached")

    monkeypatch.setattr(_launcher, "_leftovers", slow_drain)
    config = Config(steps=3, task=BANDIT, target_score=None, run_dir=str(tmp_path))
    run = asyncio.ensure_future(run_pipeline(config, quiet=True))
    result = await asyncio.wait_for(run, 60)
    assert result.steps == 3 and result.rollouts == {}
    assert (tmp_path / "learning_curve.png").exists(), "a finished run draws its curve"


async def test_the_trainer_writes_its_checkpoints_off_its_event_loop_and_once_a_step(tmp_path, sockets_dir):
    """``save`` (a whole model's ``save_pretrained`` for an hf task) ran on the trainer's loop: no endpoint was
    served meanwhile (a restarted generator's rejoin, a stop's final checkpoint). Its last step falls on a periodic
    checkpoint: written once."""
    from pipeline_support import OffTheLoopSaveTrainer

    config = Config(steps=4, task=BANDIT, checkpoint_every=2, target_score=None, run_dir=str(tmp_path))
    await asyncio.wait_for(run_pipeline(config, quiet=True, roles=Roles(trainer=OffTheLoopSaveTrainer)), 120)
    assert (tmp_path / "saves.txt").read_text().split() == ["2", "4"]


async def test_the_steps_trained_before_the_trainer_fails_reach_the_metrics(tmp_path, sockets_dir):
    """Reports go out in batches of 10: the trainer failing at step 13, with no final checkpoint (which sends
    them), lost steps 11 and 12 from the run's metrics, the very steps before the failure."""
    from pipeline_support import FailsAtStepTrainer

    config = Config(steps=50, task=BANDIT, stop_grace=0.0, run_dir=str(tmp_path))
    with pytest.raises(PipelineError, match="the trainer failed at step 13 on purpose"):
        await asyncio.wait_for(run_pipeline(config, quiet=True, roles=Roles(trainer=FailsAtStepTrainer)), 120)
    assert [row["step"] for row in read_rows(str(tmp_path))] == list(range(1, 13))


async def test_the_publish_time_is_the_policys_not_the_reference_syncs(tmp_path, sockets_dir):
    from pipeline_support import SlowReferenceSyncTrainer

    config = Config(
        steps=4, task=BANDIT, sync_ref_model=True, ref_model_sync_steps=2, target_score=None, run_dir=str(tmp_path)
    )
    await asyncio.wait_for(run_pipeline(config, quiet=True, roles=Roles(trainer=SlowReferenceSyncTrainer)), 120)
    publish = {row["step"]: row["timing/publish_ms"] for row in read_rows(str(tmp_path))}
    assert publish[2] < 500 and publish[4] < 500, publish


async def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_start(tmp_path, sockets_dir):
    """--overwrite removes the earlier run's outputs only once the new run's task loads: a run refused before
    that leaves them as they were."""
    (tmp_path / "checkpoint.pt").write_text("the earlier run's")
    config = Config(steps=5, task="pipeline_support:NoSuchTask", run_dir=str(tmp_path))
    with pytest.raises(Exception, match="NoSuchTask"):
        await run_pipeline(config, quiet=True, overwrite=True)
    assert (tmp_path / "checkpoint.pt").read_text() == "the earlier run's"


def test_a_run_folder_that_is_a_file_is_one_error_line(tmp_path, capsys):
    from pipeline.grpo import main

    (tmp_path / "run").write_text("not a folder")
    assert main(["--run-dir", str(tmp_path / "run"), "--steps", "2", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
