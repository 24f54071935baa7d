"""Run outputs: metrics.jsonl rows, the live progress line, and the learning-curve plot."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from .messages import StepReport

METRICS = "metrics.jsonl"
PLOT = "learning_curve.png"


class MetricsLog:
    """Appends one JSON row per trainer step to ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, METRICS)
        self._file = open(self.path, "a", buffering=1)
        self.rows = 0

    def write(self, report: StepReport) -> None:
        row = asdict(report)
        row["time"] = round(row["time"], 4)
        row["weight_sync_ms"] = round(row["weight_sync_ms"], 3)
        self._file.write(json.dumps(row) + "\n")
        self.rows += 1

    def close(self) -> None:
        self._file.close()


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A one-line live view: step, reward, score, KL, steps/s, version lag."""

    def __init__(self, total: int, quiet: bool, stream: TextIO = sys.stdout, every: float = 0.5) -> None:
        self.total = total
        self.quiet = quiet
        self.stream = stream
        self.every = every
        self.tty = stream.isatty()
        self._last = 0.0
        self._start = time.perf_counter()
        self._first_step: int | None = None
        self._lags: list[int] = []

    def update(self, report: StepReport, force: bool = False) -> None:
        if self._first_step is None:  # rate counts from the first step, not from startup
            self._first_step = report.step
            self._start = time.perf_counter()
        self._lags.append(report.version_lag)
        now = time.perf_counter()
        if self.quiet or (not force and now - self._last < self.every):
            return
        self._last = now
        rate = (report.step - self._first_step) / max(now - self._start, 1e-9)
        lag = sum(self._lags) / len(self._lags)
        self._lags.clear()
        score = "  -  " if report.score is None else f"{report.score:5.3f}"
        line = (
            f"step {report.step:>6}/{self.total}  reward {report.reward_mean:+.3f}  score {score}  "
            f"kl {report.kl:.4f}  {rate:6.0f} steps/s  lag {lag:4.1f}  dropped {report.dropped_stale}"
        )
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """An event worth a line of its own (a generator restart), on stderr even when quiet."""
        if self.tty and not self.quiet:
            self.stream.write("\n")
        print(text, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()


def plot(run_dir: str) -> str | None:
    """Draw the learning curve and staleness to ``<run_dir>/learning_curve.png``."""
    rows = read_rows(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    scored = [(r["step"], r["score"]) for r in rows if r["score"] is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    window = max(1, len(rows) // 50)
    rewards = [r["reward_mean"] for r in rows]
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    top.plot(steps, smooth, color="tab:blue", label=f"reward (mean of {window})")
    top.set_ylabel("reward")
    if scored:
        right = top.twinx()
        right.plot(*zip(*scored, strict=True), color="tab:green", label="normalized score")
        right.set_ylabel("normalized score")
        right.set_ylim(-0.1, 1.05)
        right.legend(loc="lower right")
    top.legend(loc="upper left")
    top.set_title("GRPO learning curve")
    bottom.plot(steps, [r["version_lag"] for r in rows], color="tab:orange", linewidth=0.7, label="version lag")
    bottom.plot(steps, [r["dropped_stale"] for r in rows], color="tab:red", label="dropped (stale, cumulative)")
    bottom.set_xlabel("trainer step")
    bottom.set_ylabel("versions / rollouts")
    bottom.legend(loc="upper left")
    fig.tight_layout()
    path = os.path.join(run_dir, PLOT)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
