"""The typed messages that flow around the pipeline, and its configuration."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from actors import WeightManifest

__all__ = ["Config", "Grant", "InstallMode", "Mode", "RefScoredRollout", "Rollout", "ScoredRollout", "StepReport"]

#: ``async``: generators run ahead of the trainer (bounded); ``sync``: lock-step, on-policy.
Mode = Literal["async", "sync"]
#: How generators install weights: ``copy`` into their parameters, or ``alias`` the published slot.
InstallMode = Literal["copy", "alias"]


@dataclass
class Rollout:
    """One GRPO group from a generator: a state, G sampled actions and their log-probs."""

    generator: int
    rollout_id: int
    version: int  # policy version that produced it
    state: torch.Tensor
    actions: torch.Tensor
    logps: torch.Tensor


@dataclass
class ScoredRollout:
    rollout: Rollout
    rewards: torch.Tensor
    scorer_queue: int = 0  # scorer's backlog when it forwarded this


@dataclass
class RefScoredRollout:
    rollout: Rollout
    rewards: torch.Tensor
    ref_logps: torch.Tensor
    scorer_queue: int = 0
    ref_queue: int = 0


@dataclass
class Grant:
    """Permission for a generator to produce ``count`` more rollouts.

    ``min_version`` (sync mode) makes the generator wait for that policy
    version before producing; ``manifest`` carries it when the trainer
    sends weights with the grant.
    """

    count: int
    min_version: int = 0
    manifest: WeightManifest | None = None


@dataclass
class StepReport:
    """One row of metrics.jsonl, sent by the trainer to the controller after each step."""

    step: int
    time: float
    version: int
    reward_mean: float
    score: float | None
    loss: float
    kl: float
    version_lag: int
    dropped_stale: int
    trainer_queue: int
    scorer_queue: int
    ref_queue: int
    weight_sync_ms: float
    generator: int


@dataclass
class Config:
    """Everything the roles need; travels to every actor as a constructor argument."""

    steps: int = 2000
    generators: int = 2
    mode: Mode = "async"
    max_staleness: int = 8
    transport: str = "shm"
    seed: int = 0
    lr: float = 0.02
    clip: float = 0.2
    kl_coeff: float = 0.05
    max_inflight: int = 2  # rollouts a generator may have ahead of the trainer
    eval_every: int = 20
    eval_states: int = 256
    checkpoint_every: int = 200
    generator_restarts: int = 3  # a dead generator is restarted at most this often per minute
    target_score: float | None = None
    task: str = "pipeline.task:BanditTask"
    run_dir: str = ""
    device: str = "cpu"  # every role's device, unless ``devices`` names one for it
    devices: dict[str, str] = field(default_factory=dict)  # role -> device: trainer, generator, scorer, ref
    install: InstallMode = "copy"  # "alias": zero-copy, read-only views of the published slot
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def device_of(self, role: str) -> str:
        """The device ``role`` runs on."""
        return self.devices.get(role, self.device)
