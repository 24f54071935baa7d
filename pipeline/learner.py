"""The trainer's half of GRPO, shared by the Trainer actor and the one-process baseline.

A :class:`Learner` owns the policy being trained, its optimiser and the
frozen reference weights (the policy as initialised), applies one update per
batch and evaluates on the task's held-out set. Keeping it out of the actor
means the pipeline and :func:`pipeline.reference.train_one_process` run the
same arithmetic, so their learning curves compare like for like.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from .task import LossReport, Task

__all__ = ["Learner", "Update"]


@dataclass
class Update:
    """One optimiser step's loss terms, gradient norm and duration."""

    report: LossReport
    grad_norm: float
    seconds: float


class Learner:
    """Policy + Adam + reference weights for one task on one device."""

    def __init__(self, task: Task, device: torch.device) -> None:
        self.task = task
        self.device = device
        torch.manual_seed(task.seed)  # every run of a seed starts from the same policy
        self.policy = task.build_policy().to(device)
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=task.config.hyper("lr"))
        self.reference_state = copy.deepcopy(self.policy.state_dict())

    def update(self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor) -> Update:
        """One GRPO step on ``samples`` (already on this device)."""
        started = time.perf_counter()
        report = self.task.loss(self.policy, samples, rewards, ref_logps)
        self.optim.zero_grad()
        report.loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), float("inf"))
        self.optim.step()
        return Update(report, float(grad_norm), time.perf_counter() - started)

    def evaluate(self) -> dict[str, float]:
        """The task's held-out metrics for the current policy."""
        metrics = self.task.evaluate(self.policy)
        if self.task.primary not in metrics:
            raise KeyError(f"{type(self.task).__name__}.evaluate must report {self.task.primary!r}")
        return metrics

    def reference(self) -> torch.nn.Module:
        """A frozen copy of the initial policy (the one-process baseline's RefModel)."""
        model = self.task.build_policy().to(self.device)
        model.load_state_dict(self.reference_state)
        return model.requires_grad_(False).eval()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the learner."""
        return {
            "policy": self.policy.state_dict(),
            "optimizer": self.optim.state_dict(),
            "ref": self.reference_state,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optim.load_state_dict(state["optimizer"])
        self.reference_state = {name: value.to(self.device) for name, value in state["ref"].items()}
