"""An asynchronous GRPO pipeline on the ``actors`` runtime.

Generator xN -> Scorer -> RefModel -> Trainer, each an actor in its own
process, linked by typed ports; fresh weights go to the generators as
shared-memory manifests. Run it with ``python -m pipeline.grpo``.
"""

from typing import TYPE_CHECKING, Any

from .messages import Config, Grant, RefScoredRollout, Rollout, ScoredRollout, StepReport
from .reference import ReferenceResult, train_one_process
from .roles import Generator, RefModel, Scorer, Trainer, load_task
from .task import BanditTask, grpo_loss

if TYPE_CHECKING:
    from .grpo import PipelineError, Roles, RunResult, main, run_pipeline

_LAUNCHER = {"PipelineError", "Roles", "RunResult", "main", "run_pipeline"}


def __getattr__(name: str) -> Any:
    # The launcher loads on first use, so ``python -m pipeline.grpo`` runs it
    # as __main__ without the package having imported it first.
    if name in _LAUNCHER:
        from . import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = [
    "BanditTask",
    "Config",
    "Generator",
    "Grant",
    "PipelineError",
    "RefModel",
    "RefScoredRollout",
    "ReferenceResult",
    "Roles",
    "Rollout",
    "RunResult",
    "ScoredRollout",
    "Scorer",
    "StepReport",
    "Trainer",
    "grpo_loss",
    "load_task",
    "main",
    "run_pipeline",
    "train_one_process",
]
