"""Where metric rows go besides ``metrics.jsonl``: TensorBoard, Weights & Biases, or nowhere (``--report-to``).

Both trackers are optional packages, imported only when a run asks for
them, and started by the launcher only after the roles' processes exist
(their threads must not be inherited by a fork). A sink takes each row
:func:`pipeline.run.metric_row` builds and is closed with the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
from typing import Any, Protocol

from ..config import REPORT_TO
from ..models import first_line

__all__ = [
    "CompletionsFeed",
    "NoTracker",
    "Sink",
    "TensorBoardSink",
    "TrackerError",
    "WandbSink",
    "missing_tracker",
    "open_sink",
]

#: Shortest run time (s) between two rows sent to a tracker, evaluation rows excepted.
TRACKER_PERIOD = 0.1


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _Pace:
    """Which rows a tracker takes: every evaluation row, others at most every :data:`TRACKER_PERIOD` s of run time.

    The newest row held back is kept, and sent at the close: a run stopped
    between evaluations (Ctrl-C, a failure) still shows its last step.
    """

    def __init__(self) -> None:
        self._last = -float("inf")
        self._held: dict[str, Any] | None = None

    def due(self, row: dict[str, Any]) -> bool:
        if any(name.startswith("eval/") for name in row) or row["time"] - self._last >= TRACKER_PERIOD:
            self._last, self._held = row["time"], None
            return True
        self._held = row
        return False

    def held_back(self) -> dict[str, Any] | None:
        """The newest row not sent (once), if one came after the last sent."""
        row, self._held = self._held, None
        return row


#: A row's fields that are its bookkeeping, not figures to plot.
_NOT_SCALARS = frozenset({"step", "time", "version", "generator", "score"})


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's figures: every number but its bookkeeping (a reward's ``log_metric`` name needs no slash)."""
    return {
        name: value
        for name, value in row.items()
        if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardSink:
    """Scalars to ``<run_dir>/tensorboard`` (a no-op when the ``tensorboard`` package is missing).

    Each scalar costs ~60 us to encode, so rows go at most every
    :data:`TRACKER_PERIOD` s of run time: a fast task's hundreds of steps
    per second would otherwise slow the controller.
    """

    def __init__(self, run_dir: str) -> None:
        self._folder = os.path.join(run_dir, "tensorboard")
        self._writer: Any = None
        self._pace = _Pace()
        self._completions = CompletionsFeed(run_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # optional: pip install tensorboard
            self._open: Any = None
            return
        self._open = SummaryWriter

    def write(self, row: dict[str, Any]) -> None:
        if self._writer is None and self._open is not None:
            # Opened at the run's first row: a resumed run repeats the steps after its checkpoint, and the events
            # an interrupted run wrote for them (at this step or later) are purged, not shown twice.
            self._writer = self._open(self._folder, purge_step=row["step"])
        if self._writer is not None and self._pace.due(row):
            self._send(row)

    def _send(self, row: dict[str, Any]) -> None:
        for name, value in _scalars(row).items():
            self._writer.add_scalar(name, value, row["step"])
        if any(name.startswith("eval/") for name in row):
            text = self._completions.new_as_markdown()
            if text:
                self._writer.add_text("completions", text, row["step"])

    def close(self) -> None:
        if self._writer is not None:
            held = self._pace.held_back()
            if held is not None:
                self._send(held)
            self._writer.close()


class CompletionsFeed:
    """The rows the trainer appended to ``<run_dir>/completions.jsonl`` (``--log-completions``) since last asked.

    The trainer writes the file where it runs; a trainer on another host
    (Ray) leaves none here, and the feed stays empty.
    """

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, "completions.jsonl")
        self._offset = os.path.getsize(self.path) if os.path.exists(self.path) else 0  # a resumed run's old rows

    def new_rows(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self._offset)
            lines = f.read()
        complete = lines[: lines.rfind("\n") + 1]  # a row still being written waits for the next call
        self._offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def new_as_markdown(self) -> str:
        """The new rows as a Markdown table (TensorBoard's text plugin renders it)."""
        rows = self.new_rows()
        if not rows:
            return ""
        names = sorted({name for row in rows for name in row.get("rewards", {})})
        extra = sorted({column for row in rows for column in row.get("extra", {})})  # the rewards' log_extra
        header = ["prompt", "completion", *names, *extra]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [_cell(row.get("prompt")), _cell(row.get("completion"))]
            cells += [_cell(row.get("rewards", {}).get(name)) for name in names]
            cells += [_cell(row.get("extra", {}).get(column)) for column in extra]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


class TrackerError(RuntimeError):
    """The tracker ``--report-to`` names could not start its run (no login, no network, a refused project)."""


#: The file under ``<run_dir>/wandb`` that keeps the W&B run's id, so that ``--resume`` continues that run.
WANDB_ID = "run-id"


class WandbSink:
    """Rows to a Weights & Biases run named after the run folder (``WANDB_MODE=offline`` keeps it local).

    The run's files go under ``<run_dir>/wandb``; ``WANDB_PROJECT`` names
    the project (default ``pipeline-grpo``). The run's id is kept there too:
    a resumed run continues the same W&B run (W&B keeps the rows it has for
    the steps the resumed run repeats).
    """

    def __init__(self, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        self._pace = _Pace()
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "pipeline-grpo"),
                name=os.path.basename(os.path.abspath(run_dir)),
                dir=run_dir,
                config=config,
                id=_wandb_id(run_dir),
                resume="allow",
            )
        except Exception as exc:  # the library's own errors (login, network, settings): one line, naming the flag
            raise TrackerError(
                f"--report-to wandb: its run could not start ({type(exc).__name__}: {first_line(exc)})"
            ) from None

    def write(self, row: dict[str, Any]) -> None:
        if self._pace.due(row):
            self._run.log(_scalars(row), step=row["step"])

    def close(self) -> None:
        held = self._pace.held_back()
        if held is not None:
            self._run.log(_scalars(held), step=held["step"])
        self._run.finish()


def _wandb_id(run_dir: str) -> str:
    """The W&B run id kept in ``run_dir``, made (12 random hex digits, as W&B's own ids go) the first time."""
    path = os.path.join(run_dir, "wandb", WANDB_ID)
    try:
        with open(path) as f:
            kept = f.read().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept
    made = secrets.token_hex(6)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(made + "\n")
    return made


class NoTracker:
    """``--report-to none``: rows go to ``metrics.jsonl`` only."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def missing_tracker(report_to: str) -> str | None:
    """Why ``report_to`` cannot be used here (its package is not installed), or None."""
    if report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        return "--report-to wandb needs the wandb package: pip install -e '.[wandb]'"
    return None


def open_sink(report_to: str, run_dir: str, config: dict[str, Any] | None = None) -> Sink:
    """The sink ``--report-to`` names, started."""
    if report_to == "tensorboard":
        return TensorBoardSink(run_dir)
    if report_to == "wandb":
        return WandbSink(run_dir, config or {})
    if report_to == "none":
        return NoTracker()
    raise ValueError(f"--report-to {report_to}: choose one of {', '.join(REPORT_TO)}")
