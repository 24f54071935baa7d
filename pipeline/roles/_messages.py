"""The typed messages that flow between the roles: rollouts, scored rollouts, grants and the trainer's step reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actors import WeightManifest

__all__ = [
    "WAKE",
    "GeneratorTimes",
    "Grant",
    "Rollout",
    "ScoredRollout",
    "StepReport",
]

#: The ticket of a :class:`Grant` that only wakes a generator.
WAKE = -1


@dataclass
class GeneratorTimes:
    """Where a generator's time went since it sent its previous rollout (seconds)."""

    cycle: float = 0.0  # since the previous rollout was sent
    wait: float = 0.0  # blocked: no credit, or the policy a grant requires not yet here
    generate: float = 0.0  # sampling this rollout
    install: float = 0.0  # installing weights before it
    delivery: float | None = None  # last installed update: trainer's publish -> start of its install


@dataclass
class Rollout:
    """One batch of samples from a generator, with the policy version that drew them.

    ``samples`` is the task's own dataclass of CPU tensors (the behaviour
    log-probabilities included); ``tokens`` and ``response_length`` are the
    task's :meth:`~pipeline.tasks.Task.measure` of it.
    """

    generator: int
    rollout_id: int
    version: int  # policy version that produced it
    samples: Any
    tokens: int = 0
    response_length: float = 0.0
    times: GeneratorTimes = field(default_factory=GeneratorTimes)
    ticket: int = -1  # the trainer step it was granted for (pipeline.roles)
    peak_gpu_gb: float | None = None  # the generator's peak GPU memory so far (torch's allocator); None on a CPU
    reserved_gpu_gb: float | None = None  # the most its caching allocator has reserved (cached blocks included)


@dataclass
class ScoredRollout:
    """A rollout with the verifier's reward per sample (and exact correctness, if the task has it).

    The RefModel passes it on with ``ref_logps``, the reference policy's
    log-probabilities of the samples; a run without a KL term (β = 0) has
    no RefModel and the scorer's rollouts reach the trainer without them.
    """

    rollout: Rollout
    rewards: torch.Tensor
    accuracy: torch.Tensor | None = None
    scorer_queue: int = 0  # scorer's backlog when it forwarded this
    ref_logps: torch.Tensor | None = None
    ref_queue: int = 0  # reference model's backlog when it forwarded this
    reward_components: dict[str, float] = field(default_factory=dict)  # each reward function's mean
    reward_metrics: dict[str, float] = field(default_factory=dict)  # what the reward functions logged (log_metric)
    reward_total: torch.Tensor | None = None  # the weighted sum of the rewards, where ``rewards`` is not it (GDPO)


@dataclass
class Grant:
    """A ticket: permission for a generator to produce the rollout the trainer trains at step ``ticket``.

    The generator draws it with policy version ``min_version`` or newer,
    so it is at most ``max_staleness`` versions old when trained
    (:mod:`pipeline.roles`); ``manifest`` carries the weights when the
    trainer knows the generator lacks them. A ticket of :data:`WAKE` only
    wakes a generator waiting for one (``drain``).
    """

    ticket: int
    min_version: int = 0
    manifest: WeightManifest | None = None


@dataclass
class StepReport:
    """What the trainer measured in one step; :class:`pipeline.run.MetricsLog` turns it into a row."""

    step: int
    time: float  # seconds since training started
    version: int
    generator: int
    staleness: int  # policy versions between the sample's and the trainer's
    dropped_stale: int  # cumulative since the trainer started: duplicates (a restarted generator's ticket, twice)
    reward_mean: float
    reward_std: float
    accuracy: float | None  # exact match of the sampled completions, if the task has it
    evaluation: dict[str, float] | None  # held-out metrics, on evaluation steps
    score: float | None  # the newest held-out value of the task's primary metric
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    entropy: float
    grad_norm: float  # before clipping
    response_length: float
    tokens: int  # tokens in the trained rollout
    tokens_received: int  # cumulative tokens of every rollout that reached the trainer (dropped ones too)
    wait_batch: float  # seconds the trainer waited for this batch
    train: float  # seconds of the update itself
    publish: float  # seconds to publish the new version
    generator_times: GeneratorTimes
    trainer_queue: int
    scorer_queue: int
    ref_queue: int
    dual_clip_fraction: float = 0.0
    logp_diff: float = 0.0  # mean |log π_trainer - log π_behaviour| of the rollout's tokens, before the update
    is_weight: float = 1.0  # --is-correction tis: the mean token weight
    is_truncated: float = 0.0  # --is-correction tis: the share of tokens whose weight was capped
    off_policy_masked: float = 0.0  # --off-policy-mask-threshold: the share of tokens out of the policy term
    lr: float = 0.0  # the learning rate this step used
    vespo_weight: float = 0.0  # --loss vespo: the mean weight phi(w) over the rollout's tokens
    trained_entropy: float = 0.0  # the mean entropy of the tokens the policy term trained (what the bonus raises)
    entropy_coef: float = 0.0  # --entropy-coef: the bonus's coefficient after this step (adaptive: as it moved)
    update_bytes: int = 0  # bytes of the newest weight update published (in the generators' dtype)
    trainer_peak_gpu_gb: float | None = None  # the trainer's peak GPU memory so far; None on a CPU
    generator_peak_gpu_gb: float | None = None  # that of the generator that drew this rollout
    trainer_reserved_gpu_gb: float | None = None  # the most the trainer's caching allocator has reserved
    generator_reserved_gpu_gb: float | None = None  # that of the generator that drew this rollout
    reward_components: dict[str, float] = field(default_factory=dict)  # each reward function's mean
    reward_metrics: dict[str, float] = field(default_factory=dict)  # what the reward functions logged (log_metric)
    reward_group_std: float | None = None  # the mean std within the rollout's groups (None: rows not in groups)
    reward_zero_std: float | None = None  # the share of its groups whose advantages are all 0: they teach nothing
