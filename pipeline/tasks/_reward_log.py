"""What reward functions log as they score (TRL's ``log_metric`` and ``log_extra`` arguments).

TRL passes every reward function two callables: ``log_metric(name, value)``
adds a scalar, averaged over the batch's calls and logged under ``name``
beside the built-in metrics, and ``log_extra(column, values)`` adds a column
to the completions table, one value per completion. A reward log collects
both for one batch; reward functions may call them from worker threads. A
malformed entry (a metric that is no number, a column of the wrong length)
is a ``ValueError``, which the scoring reports as the reward's failure.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Any

__all__ = ["RewardLog", "is_scalar"]


class RewardLog:
    """The metrics and completion columns reward functions logged while scoring one batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # (synchronous reward functions run in worker threads, side by side)
        self._metrics: dict[str, list[float]] = {}
        self._extra: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """Add ``value`` to the metric ``name`` (its batch's mean is logged)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric: a metric's name is a non-empty str, not {name!r}")
        if not (isinstance(value, numbers.Real) or is_scalar(value)):
            raise ValueError(f"log_metric({name!r}, ...): the value is a number, not a {type(value).__name__}")
        with self._lock:
            self._metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """Add ``values``, one per completion, to the completions table's ``column``."""
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra: a column's name is a non-empty str, not {column!r}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise ValueError(f"log_extra({column!r}, ...): the values are a list, not a {type(values).__name__}")
        with self._lock:
            self._extra.setdefault(column, []).extend(list(values))

    def metrics(self) -> dict[str, float]:
        """Each logged metric's mean over the batch (NaN values left out; NaN if all were)."""
        with self._lock:
            return {name: _mean(values) for name, values in self._metrics.items()}

    def columns(self, count: int) -> dict[str, list[Any]]:
        """Each logged column, checked to hold one value per completion of the ``count`` scored."""
        with self._lock:
            columns = {column: list(values) for column, values in self._extra.items()}
        for column, values in columns.items():
            if len(values) != count:
                raise ValueError(
                    f"log_extra({column!r}, ...) was given {len(values)} values for {count} completions: "
                    "one per completion"
                )
        return columns


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def is_scalar(value: Any) -> bool:
    """A one-number tensor or numpy value (a 0-d tensor, ``np.bool_``), which ``float()`` takes."""
    return getattr(value, "ndim", None) == 0 and not isinstance(value, (str, bytes))
