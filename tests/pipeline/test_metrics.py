"""What metrics.jsonl, the progress line, TensorBoard and the plot make of the trainer's step reports."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from pipeline import GeneratorTimes, StepReport
from pipeline.run import WINDOW, MetricsLog, Progress, RateWindow, metric_row, plot, read_rows


def report(step: int, **changes: object) -> StepReport:
    values: dict[str, object] = {
        "step": step,
        "time": 0.5 * step,
        "version": step,
        "generator": step % 2,
        "staleness": step % 3,
        "dropped_stale": 0,
        "reward_mean": 0.1 * step,
        "reward_std": 0.2,
        "accuracy": 0.05 * step,
        "evaluation": {"accuracy": 0.5, "reward": 0.7} if step % 2 == 0 else None,
        "score": 0.5,
        "loss": 0.3,
        "policy_loss": 0.25,
        "kl": 0.01,
        "clip_fraction": 0.1,
        "entropy": 2.0,
        "grad_norm": 1.5,
        "response_length": 7.0,
        "tokens": 100,
        "tokens_received": 150 * step,
        "wait_batch": 0.1,
        "train": 0.3,
        "publish": 0.002,
        "generator_times": GeneratorTimes(cycle=1.0, wait=0.25, generate=0.7, install=0.001, delivery=0.004),
        "trainer_queue": 1,
        "scorer_queue": 0,
        "ref_queue": 0,
    }
    values.update(changes)
    return StepReport(**values)  # type: ignore[arg-type]


def test_what_reward_functions_log_joins_the_row_under_its_name_unless_the_pipeline_logs_that_name():
    """TRL logs a reward function's ``log_metric`` under its own name, beside the built-in metrics."""
    row = metric_row(report(2, reward_metrics={"judge/len": 2.0}), RateWindow().add(report(2)))
    assert row["judge/len"] == 2.0
    for taken in ("actor/kl", "eval/reward", "perf/steps_per_s"):
        with pytest.raises(ValueError, match=f"logged the metric '{taken}' .*a name the pipeline logs itself"):
            metric_row(report(2, reward_metrics={taken: 1.0}), RateWindow().add(report(2)))


def test_rates_and_ratios_cover_the_last_window_of_steps():
    window = RateWindow()
    first = window.add(report(1))
    assert first["perf/steps_per_s"] == pytest.approx(2.0)  # one step in the 0.5 s since training started
    assert first["perf/tokens_trained_per_s"] == pytest.approx(200.0)
    assert first["perf/tokens_generated_per_s"] == pytest.approx(300.0)
    assert first["perf/trainer_idle_ratio"] == pytest.approx(0.2)
    assert first["perf/generator_idle_ratio"] == pytest.approx(0.25)
    for step in range(2, WINDOW + 6):
        latest = window.add(report(step))
    # the window holds steps 6..25; the span runs from step 5's time (2.5 s) to step 25's (12.5 s)
    assert latest["perf/steps_per_s"] == pytest.approx(WINDOW / 10.0)
    assert latest["perf/tokens_generated_per_s"] == pytest.approx(150 * WINDOW / 10.0)
    assert latest["staleness/max"] == 2.0
    assert latest["staleness/mean"] == pytest.approx(sum(s % 3 for s in range(6, 26)) / WINDOW)


def test_a_resumed_run_starts_its_window_again():
    window = RateWindow()
    for step in range(1, 30):
        window.add(report(step))
    resumed = window.add(report(30, time=0.5, tokens_received=150))
    assert resumed["perf/steps_per_s"] == pytest.approx(2.0)


def test_a_row_names_every_metric_the_way_rl_users_read_them():
    row = metric_row(report(2), RateWindow().add(report(2)))
    assert row["reward/mean"] == pytest.approx(0.2) and row["accuracy/train"] == pytest.approx(0.1)
    assert row["eval/accuracy"] == 0.5 and row["eval/reward"] == 0.7
    assert row["timing/weight_sync_ms"] == pytest.approx(3.0) and row["timing/delivery_ms"] == pytest.approx(4.0)
    assert row["timing/wait_policy_ms"] == pytest.approx(250.0) and row["timing/generate_ms"] == pytest.approx(700.0)
    assert "eval/accuracy" not in metric_row(report(3), {}), "held-out metrics only on evaluation steps"
    assert json.loads(json.dumps(row)) == row


def test_the_progress_line_shows_reward_accuracy_and_pace():
    stream = io.StringIO()
    progress = Progress(100, quiet=False, stream=stream)
    progress.update(metric_row(report(4), RateWindow().add(report(4))), force=True)
    line = stream.getvalue()
    assert line.startswith("step     4/100  reward 0.400  acc 0.20  eval 0.500") and line.endswith("\n")
    assert "steps/s" in line and "tok/s" in line and "idle trainer" in line
    quiet = io.StringIO()
    Progress(100, quiet=True, stream=quiet).update(metric_row(report(4), {}), force=True)
    assert quiet.getvalue() == ""


def test_a_shorter_progress_line_on_a_terminal_leaves_nothing_of_the_longer_one():
    """On a terminal each line overwrites the last in place: a shorter one (a reward losing its minus sign, a
    pace dropping below 10) left the old line's last characters on screen, misread as part of the new figures."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(100, quiet=False, stream=stream)
    longer, shorter = report(4, reward_mean=-0.4), report(5)
    progress.update(metric_row(longer, RateWindow().add(longer)), force=True)
    progress.update(metric_row(shorter, RateWindow().add(shorter)), force=True)
    second = stream.getvalue().split("\r")[-1]
    assert second.endswith("\x1b[K"), repr(second)


def test_the_log_writes_rows_and_the_plot(tmp_path):
    log = MetricsLog(str(tmp_path), report_to="none")
    for step in range(1, 41):
        log.write(report(step))
    log.close()
    rows = read_rows(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(1, 41))
    path = plot(str(tmp_path))
    assert path is not None and (tmp_path / "learning_curve.png").stat().st_size > 10_000
    assert plot(str(tmp_path / "empty")) is None


def test_a_tracker_that_fails_mid_run_is_said_once_and_left_out_while_every_row_is_kept(tmp_path, monkeypatch):
    """A tracker's write that raises (a W&B upload error) ended the run with "writing the run's metrics failed", and
    the rows of the steps trained after it were lost. It is said once and left out; ``metrics.jsonl`` goes on."""
    from pipeline.run import _metrics

    class Flaky:
        def __init__(self) -> None:
            self.rows: list[int] = []
            self.closed = 0

        def write(self, row: dict[str, object]) -> None:
            if row["step"] == 3:
                raise ConnectionError("upload refused\nmore detail")
            self.rows.append(row["step"])  # type: ignore[arg-type]

        def close(self) -> None:
            self.closed += 1
            raise ConnectionError("still refused")  # (its close raising too loses nothing)

    flaky = Flaky()
    monkeypatch.setattr(_metrics, "open_sink", lambda *args: flaky)
    said = io.StringIO()
    log = MetricsLog(str(tmp_path), report_to="wandb", stream=said)
    for step in range(1, 6):
        log.write(report(step))
    log.close()
    assert [row["step"] for row in read_rows(str(tmp_path))] == [1, 2, 3, 4, 5]
    assert flaky.rows == [1, 2] and flaky.closed == 1
    assert said.getvalue() == (
        "warning: --report-to wandb failed at step 3 (ConnectionError: upload refused); it gets no more rows, "
        "metrics.jsonl keeps every one\n"
    )


def test_the_curve_s_smoothing_skips_a_null_instead_of_blanking_the_window_after_it():
    from pipeline.run._metrics import _smooth

    smoothed = _smooth([1.0, math.nan, 3.0, 5.0, math.nan, math.nan], 2)
    assert smoothed[:5] == [1.0, 1.0, 3.0, 4.0, 5.0] and math.isnan(smoothed[5])


def test_a_step_whose_figures_are_not_finite_writes_standard_json_and_still_plots(tmp_path):
    """A diverged step (a NaN loss, an infinite KL) is a row any JSON reader takes (null), not Python's NaN token
    that ``jq``, JavaScript and strict parsers refuse; the live line and the plot still show it."""
    log = MetricsLog(str(tmp_path), report_to="none")
    rows = [log.write(report(step, **({"kl": math.nan, "loss": math.inf} if step == 2 else {}))) for step in (1, 2, 3)]
    log.close()
    assert math.isnan(rows[1]["actor/kl"]), "the row handed back (the live line's) keeps the figure"
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    written = read_rows(str(tmp_path))
    assert written[1]["actor/kl"] is None and written[1]["actor/loss"] is None and written[2]["actor/kl"] == 0.01
    assert plot(str(tmp_path)) is not None


def test_a_resumed_run_replaces_the_rows_of_the_steps_it_repeats(tmp_path):
    """Interrupted at step 35 with its checkpoint at 20: the resumed run trains 21.. again, and its rows replace the
    interrupted run's for those steps (kept: 1-20), instead of following them."""
    first = MetricsLog(str(tmp_path), report_to="none")
    for step in range(1, 36):
        first.write(report(step))
    first.close()
    resumed = MetricsLog(str(tmp_path), report_to="none")
    for step in range(21, 41):
        resumed.write(report(step))
    resumed.close()
    assert [r["step"] for r in read_rows(str(tmp_path))] == list(range(1, 41))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"], "no staging file left"


def test_a_torn_last_row_is_dropped_when_a_run_resumes_and_never_read(tmp_path):
    """A write cut short (a full disk) left a last line with no newline: the resumed run's first row was appended
    to it (lost), and from then on reading the rows raised, so the learning curve was never drawn again."""
    first = MetricsLog(str(tmp_path), report_to="none")
    for step in range(1, 36):
        first.write(report(step))
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 36, "rew')
    assert [r["step"] for r in read_rows(str(tmp_path))] == list(range(1, 36)), "a torn last line is not a row"
    resumed = MetricsLog(str(tmp_path), report_to="none")
    for step in range(21, 41):
        resumed.write(report(step))
    resumed.close()
    assert [r["step"] for r in read_rows(str(tmp_path))] == list(range(1, 41))
    assert plot(str(tmp_path)) is not None


def test_tensorboard_gets_every_scalar_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(str(tmp_path))
    for step in range(1, 6):
        log.write(report(step, reward_metrics={"judge_len": 2.0}))  # (a reward's log_metric, TRL's plain name)
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "judge_len" in tags, "a metric named without a slash reaches the tracker too"
    assert not tags & {"step", "time", "version", "generator"}, "the row's bookkeeping is no scalar"
    assert {"reward/mean", "actor/kl", "perf/tokens_trained_per_s", "eval/accuracy"} <= tags
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4, 5]


def test_a_resumed_run_replaces_tensorboards_events_for_the_steps_it_repeats(tmp_path):
    """As with metrics.jsonl: interrupted at step 35 with its checkpoint at 20, the resumed run's events for 21..
    replace the interrupted run's (before, TensorBoard showed both, two values at each repeated step)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLog(str(tmp_path))
    for step in range(1, 36):
        first.write(report(step, time=float(step)))
    first.close()
    resumed = MetricsLog(str(tmp_path))
    for step in range(21, 41):
        resumed.write(report(step, time=float(step), reward_mean=-1.0))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert [step for step, _ in scalars] == list(range(1, 41))
    assert all(value == -1.0 for step, value in scalars if step > 20)


def test_a_resumed_run_continues_its_wandb_run_and_a_tracker_that_cannot_start_says_so(tmp_path, monkeypatch):
    """The W&B run's id is kept in the run folder: ``--resume`` continues that run (before, each resume started a
    new W&B run). A run W&B cannot start (no login, no network) is one line naming the flag, not a traceback."""
    wandb = pytest.importorskip("wandb", reason="needs the wandb extra: pip install -e '.[wandb]'")
    from pipeline.run import TrackerError, WandbSink

    started: list[dict[str, object]] = []

    class Run:
        def finish(self) -> None:
            pass

    def init(**settings: object) -> Run:
        started.append(settings)
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    for folder in ("a", "a", "b"):
        WandbSink(str(tmp_path / folder), {}).close()
    ids = [settings["id"] for settings in started]
    assert ids[0] == ids[1] != ids[2] and all(settings["resume"] == "allow" for settings in started)

    def refuse(**settings: object) -> Run:
        raise wandb.errors.UsageError("api_key not configured (no-tty)\nmore detail")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(TrackerError, match=r"^--report-to wandb: its run could not start \(UsageError: api_key"):
        WandbSink(str(tmp_path / "c"), {})


def test_tensorboard_takes_at_most_ten_rows_a_second_but_every_evaluation(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(str(tmp_path))
    for step in range(1, 101):  # 100 steps in 1 s of run time, evaluated every 25th
        log.write(report(step, time=0.01 * step, evaluation={"accuracy": 0.5} if step % 25 == 0 else None))
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("reward/mean")]
    assert {25, 50, 75, 100} <= set(steps) and len(steps) <= 15, steps


def test_a_metrics_log_whose_tracker_cannot_start_leaves_no_file_open(tmp_path, monkeypatch):
    import pipeline.run._metrics as metrics
    from pipeline.run import TrackerError

    def refuse(*args: object) -> None:
        raise TrackerError("--report-to wandb: its run could not start (UsageError: no login)")

    monkeypatch.setattr(metrics, "open_sink", refuse)
    with pytest.raises(TrackerError) as caught:
        MetricsLog(str(tmp_path), "wandb")
    fds = os.listdir("/proc/self/fd")
    held = [fd for fd in fds if os.path.realpath(f"/proc/self/fd/{fd}") == str(tmp_path / "metrics.jsonl")]
    assert not held, f"metrics.jsonl still open, while {caught.value!r} is held"


def test_the_last_row_a_tracker_held_back_goes_out_when_the_run_stops(tmp_path, monkeypatch):
    """A run stopped (Ctrl-C, a failure) between evaluations: the newest row, held back by the tracker's pace, is
    sent at the close (before, the tracker's last point was up to 0.1 s of steps older than ``metrics.jsonl``'s,
    and a resume purged from the step after the checkpoint, so those steps never reached it)."""
    wandb = pytest.importorskip("wandb", reason="needs the wandb extra: pip install -e '.[wandb]'")
    from pipeline.run import WandbSink

    logged: list[int] = []

    class Run:
        def log(self, scalars: dict[str, float], step: int) -> None:
            logged.append(step)

        def finish(self) -> None:
            pass

    monkeypatch.setattr(wandb, "init", lambda **settings: Run())
    sink = WandbSink(str(tmp_path), {})
    for step in range(1, 38):  # 37 steps at 100 a second: stopped at 0.37 s
        sink.write(dict(metric_row(report(step, evaluation=None), {}), time=0.01 * step))
    sink.close()
    assert logged[-1] == 37 and len(logged) <= 6, logged
    sink.close()  # (a second close sends nothing again)
    assert logged.count(37) == 1


async def test_report_to_wandb_writes_an_offline_run(tmp_path, sockets_dir, monkeypatch):
    pytest.importorskip("wandb", reason="needs the wandb extra: pip install -e '.[wandb]'")
    import glob

    from pipeline import Config, run_pipeline

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = Config(task="bandit", steps=20, eval_every=10, report_to="wandb", run_dir=str(tmp_path))
    await run_pipeline(config, quiet=True)
    [run] = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    [history] = glob.glob(os.path.join(run, "run-*.wandb"))
    with open(history, "rb") as f:  # wandb's own record log; its keys are stored as text
        records = f.read()
    for key in (b"reward/mean", b"actor/kl", b"eval/score", b"max_staleness"):  # rows, evaluations, the config
        assert key in records, key


def test_report_to_wandb_without_the_package_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    from pipeline.grpo import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["--report-to", "wandb", "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "error: --report-to wandb needs the wandb package: pip install -e '.[wandb]'\n"


def test_logged_completions_reach_tensorboard_as_text_once_each(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.run import CompletionsFeed, TensorBoardSink

    path = tmp_path / "completions.jsonl"
    path.write_text(json.dumps({"prompt": "old", "completion": "x", "rewards": {"r": 1.0}}) + "\n")
    sink = TensorBoardSink(str(tmp_path))  # a resumed run: rows already there are not sent again
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "a|b", "completion": "c\nd", "rewards": {"r": 0.5, "s": None}}) + "\n")
        f.write('{"prompt": "half a ro')  # still being written
    sink.write({"step": 10, "time": 1.0, "eval/reward": 0.5})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("completions/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "a\\|b" in table and "c<br>d" in table and "old" not in table and "half" not in table
    feed = CompletionsFeed(str(tmp_path))
    assert feed.new_rows() == []  # a new feed starts at the end
    with open(path, "a") as f:  # the columns reward functions logged (log_extra) follow the rewards
        f.write(json.dumps({"prompt": "p", "completion": "c", "rewards": {"r": 1.0}, "extra": {"why": "w"}}) + "\n")
    assert feed.new_as_markdown().splitlines()[::2] == ["| prompt | completion | r | why |", "| p | c | 1.0 | w |"]


def test_the_progress_line_shows_each_reward_function_when_there_are_several():
    import dataclasses

    def line(components: dict[str, float]) -> str:
        step = dataclasses.replace(report(3), reward_components=components)
        return Progress(100, quiet=True).line(metric_row(step, RateWindow().add(step)))

    assert "reward 0.300 (exact 0.25, format 1.00)  acc" in line({"exact": 0.25, "format": 1.0})
    assert "reward 0.300  acc" in line({"exact": 0.25})  # one function: the reward itself


async def test_a_generators_install_time_is_not_counted_as_waiting_nor_as_delivery():
    """An install its ticket needs happens while the generator waits for that version: it is ``install_ms``, not
    also ``wait_policy_ms``; ``delivery_ms`` ends where the install starts."""
    import asyncio
    import time
    import types

    from pipeline.roles import Generator
    from pipeline.roles._messages import GeneratorTimes, Grant

    INSTALL_S = 0.3
    manifest = types.SimpleNamespace(version=1, metadata={})
    generator = Generator.__new__(Generator)

    class Inbox:
        queued: list[object] = []

        def put(self, update: object) -> None:
            self.queued.append(update)

        async def install_newest_async(self, model: object, *, alias: bool) -> object:
            if not self.queued:
                return None
            self.queued.clear()
            manifest.metadata["published_at"] = time.time()  # published just now
            await asyncio.sleep(INSTALL_S)  # (the install itself: a copy that takes its time)
            return manifest

    class Grants:
        def __init__(self) -> None:
            self.left = [Grant(0, 1, manifest)]  # type: ignore[arg-type]

        async def recv(self) -> Grant | None:
            if self.left:
                return self.left.pop()
            generator.stopping = True
            return None

    sent: list[object] = []
    generator.__dict__.update(
        config=types.SimpleNamespace(install="copy"),
        _weight_inbox=Inbox(),
        engine=None,
        policy=None,
        grants=Grants(),
        rollouts=types.SimpleNamespace(send=sent.append),
        version=-1,
        produced=0,
        stopping=False,
        _stopped=asyncio.Event(),
        times=GeneratorTimes(),
        _cycle_started=time.perf_counter(),
        pre_collect_hooks=[],
        post_collect_hooks=[],
    )
    generator.collect = lambda ticket: types.SimpleNamespace(times=generator.times)  # type: ignore[method-assign]
    assert await asyncio.wait_for(Generator.run.fn(generator), 10) == 1  # type: ignore[attr-defined]
    times = sent[0].times  # type: ignore[attr-defined]
    assert times.install >= INSTALL_S
    assert times.wait < INSTALL_S / 2, times
    assert times.delivery is not None and times.delivery < INSTALL_S / 2, times


def test_a_metrics_file_that_fails_at_its_close_still_closes_the_tracker(tmp_path):
    """A full disk: the row a failed write left in the file's buffer is written again at the close, which raises
    again; the tracker (TensorBoard, W&B) was then never closed."""
    log = MetricsLog(str(tmp_path), report_to="none")
    closed: list[str] = []

    class Full(io.StringIO):
        def close(self) -> None:
            raise OSError(28, "No space left on device")

    log._file.close()
    log._file = Full()  # type: ignore[assignment]
    log._sink = type("Sink", (), {"close": lambda self: closed.append("tracker"), "write": lambda self, row: None})()
    with pytest.raises(OSError, match="No space"):
        log.close()
    assert closed == ["tracker"]
