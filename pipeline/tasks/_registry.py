"""Which task a run trains: ``--task`` names a built-in task or a user's ``module:Class``; its defaults fill the config."""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from ..algorithm import CISPO_CAP
from ._bandit import BanditTask
from ._digit_task import DigitsTask
from ._digits import DIGIT_TASKS
from ._hf import HFTask
from ._interface import Task

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["load_task", "resolve", "task_class"]


def task_class(name: str) -> type[Task]:
    """The task class a ``--task`` value names: a built-in name or ``module:Class``."""
    if name == "bandit":
        return BanditTask
    if name == "hf":
        return HFTask
    if name in DIGIT_TASKS:
        return DigitsTask
    module_name, sep, qualname = name.partition(":")
    if not sep:
        raise ValueError(f"unknown task {name!r}: use bandit, {', '.join(DIGIT_TASKS)}, hf, or module:Class")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TypeError(f"{name} must be a subclass of pipeline.Task")
    return obj


def load_task(config: Config) -> Task:
    """The task of the run, built for this role."""
    return task_class(config.task)(config)


def resolve(config: Config) -> Config:
    """``config`` with every setting it leaves unset filled in: the task's defaults, then those that follow.

    The clip's upper bound defaults to the lower one, or for ``cispo``, where
    it caps the ratio itself, to 5 (ScaleRL's value; TRL takes the clip's,
    which would weigh every on-policy token 0.2); the reward scaling to none
    for ``dr_grpo`` (the paper drops the std), to the batch's for GDPO
    (``normalize_then_sum``) and to the group's std otherwise.
    """
    defaults = task_class(config.task).defaults
    changes: dict[str, Any] = {
        name: defaults[name] for name in ("lr", "clip", "kl_coeff") if getattr(config, name) is None
    }
    if config.epsilon_high is None:
        changes["epsilon_high"] = CISPO_CAP if config.loss == "cispo" else changes.get("clip", config.clip)
    if config.scale_rewards is None:
        if config.multi_objective_aggregation == "normalize_then_sum":
            changes["scale_rewards"] = "batch"  # GDPO: the decoupled sum is normalised over the batch
        else:
            changes["scale_rewards"] = "none" if config.loss == "dr_grpo" else "group"
    return dataclasses.replace(config, **changes) if changes else config
