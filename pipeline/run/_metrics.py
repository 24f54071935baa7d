"""Run outputs: metrics.jsonl rows, the live progress line, and the learning-curve plot (trackers: :mod:`.sinks`).

The trainer sends one :class:`~pipeline.roles.StepReport` per step;
:func:`metric_row` turns it into the row written to ``metrics.jsonl``, with
names that verl / prime-rl / NeMo-RL users know (each is defined in
``docs/pipeline.md``). Rates and ratios are taken over the last
:data:`WINDOW` steps, so the row shows the pipeline's current pace rather
than its average since start-up.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections import deque
from typing import Any, TextIO

from ..models import first_line, process_tag
from ..roles import StepReport
from ..tasks import REWARD_STATISTICS
from ._sinks import NoTracker, Sink, open_sink

__all__ = ["METRICS", "PLOT", "WINDOW", "MetricsLog", "Progress", "RateWindow", "metric_row", "plot", "read_rows"]

METRICS = "metrics.jsonl"
PLOT = "learning_curve.png"
#: Steps that windowed metrics (rates, idle ratios, staleness mean/max) cover.
WINDOW = 20


class RateWindow:
    """The last :data:`WINDOW` reports, and what per-second and per-cycle figures they give."""

    def __init__(self, size: int = WINDOW) -> None:
        self._reports: deque[StepReport] = deque(maxlen=size)
        self._before: tuple[float, int] = (0.0, 0)  # (time, tokens received) just before the window

    def add(self, report: StepReport) -> dict[str, float]:
        if len(self._reports) == self._reports.maxlen:
            oldest = self._reports[0]
            self._before = (oldest.time, oldest.tokens_received)
        if report.time < self._before[0]:  # a resumed run counts from its own start again
            self._reports.clear()
            self._before = (0.0, 0)
        self._reports.append(report)
        reports = self._reports
        span = max(report.time - self._before[0], 1e-9)
        lags = [r.staleness for r in reports]
        cycle = sum(r.generator_times.cycle for r in reports)
        return {
            "staleness/mean": sum(lags) / len(lags),
            "staleness/max": float(max(lags)),
            "perf/steps_per_s": len(reports) / span,
            "perf/tokens_generated_per_s": (report.tokens_received - self._before[1]) / span,
            "perf/tokens_trained_per_s": sum(r.tokens for r in reports) / span,
            "perf/trainer_idle_ratio": min(1.0, sum(r.wait_batch for r in reports) / span),
            "perf/generator_idle_ratio": sum(r.generator_times.wait for r in reports) / cycle if cycle else 0.0,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def metric_row(report: StepReport, windowed: dict[str, float]) -> dict[str, Any]:
    """The metrics.jsonl row of one step."""
    gen = report.generator_times
    row: dict[str, Any] = {
        "step": report.step,
        "time": round(report.time, 4),
        "version": report.version,
        "generator": report.generator,
        "reward/mean": report.reward_mean,
        "reward/std": report.reward_std,
        "reward/group_std": report.reward_group_std,
        "reward/frac_zero_std": report.reward_zero_std,
        "accuracy/train": report.accuracy,
        "score": report.score,
        "actor/loss": report.loss,
        "actor/pg_loss": report.policy_loss,
        "actor/kl": report.kl,
        "actor/clip_fraction": report.clip_fraction,
        "actor/dual_clip_fraction": report.dual_clip_fraction,
        "actor/off_policy_masked_fraction": report.off_policy_masked,
        "actor/vespo_weight": report.vespo_weight,
        "actor/entropy": report.entropy,
        "actor/entropy_coef": report.entropy_coef,
        "actor/entropy_trained": report.trained_entropy,
        "mismatch/logp_abs": report.logp_diff,
        "mismatch/is_weight": report.is_weight,
        "mismatch/is_truncated": report.is_truncated,
        "actor/grad_norm": report.grad_norm,
        "actor/lr": report.lr,
        "response_length/mean": report.response_length,
        "tokens/step": report.tokens,
        "staleness/lag": report.staleness,
        "staleness/dropped": report.dropped_stale,
        "timing/wait_batch_ms": _ms(report.wait_batch),
        "timing/train_ms": _ms(report.train),
        "timing/publish_ms": _ms(report.publish),
        "weights/update_mb": report.update_bytes / 2**20,
        "memory/trainer_peak_gpu_gb": report.trainer_peak_gpu_gb,
        "memory/generator_peak_gpu_gb": report.generator_peak_gpu_gb,
        "memory/trainer_reserved_gpu_gb": report.trainer_reserved_gpu_gb,
        "memory/generator_reserved_gpu_gb": report.generator_reserved_gpu_gb,
        "timing/delivery_ms": _ms(gen.delivery),
        "timing/install_ms": _ms(gen.install),
        "timing/weight_sync_ms": _ms(report.publish + gen.install),
        "timing/wait_policy_ms": _ms(gen.wait),
        "timing/generate_ms": _ms(gen.generate),
        "queue/trainer": report.trainer_queue,
        "queue/scorer": report.scorer_queue,
        "queue/ref": report.ref_queue,
    }
    for name, value in report.reward_components.items():  # one per reward function, as TRL logs them
        row[f"reward/{name}"] = value
    row.update({name: round(value, 6) for name, value in windowed.items()})
    for name, value in (report.evaluation or {}).items():
        row[f"eval/{name}"] = value
    clash = sorted(set(report.reward_metrics) & set(row))
    if clash:
        raise ValueError(
            f"a reward function logged the metric {clash[0]!r} (log_metric), a name the pipeline logs itself: "
            "name it otherwise"
        )
    row.update(report.reward_metrics)  # under their own names, as TRL logs them
    return row


class MetricsLog:
    """Appends one JSON row per trainer step to ``<run_dir>/metrics.jsonl``, and sends it to ``--report-to``'s sink.

    The tracker is a copy: one that fails mid-run (a W&B upload error, a TensorBoard writer's) is said once on
    ``stream`` and left out from then on, and the run and its ``metrics.jsonl`` go on (a tracker's hiccup cost the
    whole run, and the rows of the steps trained after it).
    """

    def __init__(
        self,
        run_dir: str,
        report_to: str = "tensorboard",
        config: dict[str, Any] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.path = os.path.join(run_dir, METRICS)
        self._file = open(self.path, "a", buffering=1)
        self._window = RateWindow()
        self._report_to = report_to
        self._stream = stream  # (None: sys.stderr when it is said, whatever it is then)
        #: The tracker that failed, closed (whatever it raises) with the log.
        self._failed: Sink | None = None
        try:
            self._sink: Sink = open_sink(report_to, run_dir, config)
        except BaseException:  # (a tracker that cannot start: the launcher has no log to close)
            self._file.close()
            raise
        self.rows = 0

    def write(self, report: StepReport) -> dict[str, Any]:
        row = metric_row(report, self._window.add(report))
        if self.rows == 0:
            self._drop_rows_from(report.step)
        self._file.write(json.dumps(_standard_json(row), allow_nan=False) + "\n")
        try:
            self._sink.write(row)
        except Exception as exc:
            self._failed, self._sink = self._sink, NoTracker()
            print(
                f"warning: --report-to {self._report_to} failed at step {report.step} "
                f"({type(exc).__name__}: {first_line(exc)});"
                f" it gets no more rows, {METRICS} keeps every one",
                file=self._stream or sys.stderr,
                flush=True,
            )
        self.rows += 1
        return row

    def _drop_rows_from(self, step: int) -> None:
        """A resumed run repeats the steps after its checkpoint: the rows an interrupted run wrote for them go,
        and so does a last line a write cut short (no newline: the next row would be appended to it)."""
        self._file.flush()
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        kept = [line for line in lines if _step_of(line) < step and line.endswith("\n")]
        if len(kept) == len(lines):
            return
        staging = f"{self.path}.tmp-{process_tag()}"
        with open(staging, "w") as f:
            f.writelines(kept)
        self._file.close()
        os.replace(staging, self.path)
        self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        """Close the rows' file, then the tracker, whatever the first raised (a full disk: the row the failed
        write left buffered is written again at the close, and raised again)."""
        try:
            self._file.close()
        finally:
            try:
                self._sink.close()
            finally:
                if self._failed is not None:
                    with contextlib.suppress(Exception):  # (said when it failed)
                        self._failed.close()


def _standard_json(value: Any) -> Any:
    """``value`` with every non-finite float as None: JSON has no NaN or Infinity (Python writes tokens that
    ``jq``, JavaScript and strict parsers refuse)."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _standard_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_standard_json(item) for item in value]
    return value


def _step_of(line: str) -> int:
    """A row's step (a line that is not a row counts as before every step: it is kept)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return -1
    return step if type(step) is int else -1


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """The rows of ``<run_dir>/metrics.jsonl``; a last line without its newline (being written, or a write cut
    short) is not one yet."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]


class Progress:
    """A one-line live view of the newest row: reward, accuracy, held-out score, KL, pace, staleness."""

    def __init__(self, total: int, quiet: bool, stream: TextIO = sys.stdout, every: float = 0.5) -> None:
        self.total = total
        self.quiet = quiet
        self.stream = stream
        self.every = every
        self.tty = stream.isatty()
        self._last = 0.0

    def update(self, row: dict[str, Any], force: bool = False) -> None:
        now = time.perf_counter()
        if self.quiet or (not force and now - self._last < self.every):
            return
        self._last = now
        # (on a terminal, in place: the rest of a longer line before is cleared)
        self.stream.write(("\r" + self.line(row) + "\x1b[K") if self.tty else self.line(row) + "\n")
        self.stream.flush()

    def line(self, row: dict[str, Any]) -> str:
        score = "  -  " if row["score"] is None else f"{row['score']:5.3f}"
        accuracy = "" if row["accuracy/train"] is None else f"  acc {row['accuracy/train']:.2f}"
        parts = [f"{name[7:]} {value:.2f}" for name, value in row.items() if _reward_component(name, value)]
        components = f" ({', '.join(parts)})" if len(parts) > 1 else ""  # one function: the reward itself
        return (
            f"step {row['step']:>5}/{self.total}  reward {row['reward/mean']:.3f}{components}{accuracy}  eval {score}  "
            f"kl {row['actor/kl']:.4f}  lag {row['staleness/mean']:.1f}  "
            f"{row['perf/steps_per_s']:.1f} steps/s  {row['perf/tokens_trained_per_s'] / 1000:.1f}k tok/s  "
            f"idle trainer {row['perf/trainer_idle_ratio']:.2f}"
        )

    def note(self, text: str) -> None:
        """An event worth a line of its own (a generator restart), on stderr even when quiet."""
        if self.tty and not self.quiet:
            self.stream.write("\n")
        print(text, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()


#: The rollout's reward summaries: every other ``reward/<name>`` is one reward function's mean.
_REWARD_SUMMARIES = frozenset(f"reward/{name}" for name in REWARD_STATISTICS)


def _reward_component(name: str, value: Any) -> bool:
    """Whether a row's ``name`` is one reward function's mean (``reward/<name>``, not the mean or std)."""
    return name.startswith("reward/") and name not in _REWARD_SUMMARIES and isinstance(value, float)


def _column(rows: list[dict[str, Any]], name: str) -> list[float]:
    """One metric over the rows, a figure written as null (not finite) as NaN: a gap in the plot."""
    return [math.nan if row.get(name) is None else row[name] for row in rows]


def _smooth(values: list[float], window: int) -> list[float]:
    """The trailing mean of each point's last ``window`` values, a gap (NaN) only where none of them is finite
    (one step's null blanked the ``window`` points after it)."""
    out = []
    for i in range(len(values)):
        chunk = [value for value in values[max(0, i - window + 1) : i + 1] if math.isfinite(value)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def plot(run_dir: str) -> str | None:
    """Draw reward and accuracy, KL and entropy, and staleness to ``<run_dir>/learning_curve.png``."""
    rows = read_rows(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 50)
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    top.plot(steps, _smooth(_column(rows, "reward/mean"), window), label=f"reward (mean of {window} steps)")
    components = sorted({k for r in rows for k, v in r.items() if _reward_component(k, v)})
    for name in components:  # each reward function's mean
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        top.plot(*zip(*points, strict=True), linewidth=0.7, label=name)
    if rows[0].get("accuracy/train") is not None:
        train_acc = _column(rows, "accuracy/train")
        top.plot(steps, _smooth(train_acc, window), label="exact match, samples")
    evaluated = sorted({k for r in rows for k in r if k.startswith("eval/")})
    for name in evaluated:
        points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        top.plot(*zip(*points, strict=True), marker=".", label=f"held-out {name.removeprefix('eval/')}")
    top.set_ylabel("reward / accuracy")
    top.legend(loc="lower right", fontsize="small")
    top.set_title("GRPO learning curve")
    middle.plot(steps, _smooth(_column(rows, "actor/kl"), window), color="tab:purple", label="KL to reference")
    middle.set_ylabel("KL")
    right = middle.twinx()
    right.plot(steps, _smooth(_column(rows, "actor/entropy"), window), color="tab:gray", label="entropy")
    right.set_ylabel("entropy")
    middle.legend(loc="upper left", fontsize="small")
    right.legend(loc="upper right", fontsize="small")
    bottom.plot(steps, _column(rows, "staleness/lag"), color="tab:orange", linewidth=0.7, label="staleness")
    bottom.plot(steps, _column(rows, "staleness/dropped"), color="tab:red", label="dropped (duplicates, cumulative)")
    bottom.set_xlabel("trainer step")
    bottom.set_ylabel("versions / rollouts")
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path = os.path.join(run_dir, PLOT)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
