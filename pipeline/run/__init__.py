"""The run, on top: flags, placement, the launcher, the watch over the roles, metrics, trackers and plots.

``python -m pipeline.grpo`` is :func:`main`; :func:`run_pipeline` starts
the roles of a :class:`~pipeline.config.Config` and waits for them. May
import every layer below.
"""

from ._cli import build_parser, parse_args
from ._failures import KNOCK_ON_GRACE, USER_ERRORS, PipelineError, first_failure
from ._launcher import Roles, RunResult, exit_now, main, run_pipeline
from ._metrics import (
    METRICS,
    PLOT,
    WINDOW,
    MetricsLog,
    Progress,
    RateWindow,
    metric_row,
    plot,
    read_rows,
)
from ._placement import ROLES, PlacementError, check_alias_across_hosts, check_placement
from ._sinks import CompletionsFeed, Sink, TensorBoardSink, TrackerError, WandbSink, missing_tracker, open_sink

__all__ = [
    "KNOCK_ON_GRACE",
    "METRICS",
    "PLOT",
    "ROLES",
    "USER_ERRORS",
    "WINDOW",
    "CompletionsFeed",
    "MetricsLog",
    "PipelineError",
    "PlacementError",
    "Progress",
    "RateWindow",
    "Roles",
    "RunResult",
    "Sink",
    "TensorBoardSink",
    "TrackerError",
    "WandbSink",
    "build_parser",
    "check_alias_across_hosts",
    "check_placement",
    "exit_now",
    "first_failure",
    "main",
    "metric_row",
    "missing_tracker",
    "open_sink",
    "parse_args",
    "plot",
    "read_rows",
    "run_pipeline",
]
