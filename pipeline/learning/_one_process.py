"""The same GRPO trained in one process, on-policy, with no messaging: the pipeline's yardstick.

Sample, verify, score against the reference and update in one loop on the
trainer's device, with the very :class:`~pipeline.learning.Learner` the
Trainer actor uses. ``bench_grpo.py`` compares the wall time both need to
reach a held-out target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import Config, SettingsError, check_settings
from ..tasks import check_task_settings, load_task, resolve
from ._learner import Learner

__all__ = ["ReferenceResult", "train_one_process"]


@dataclass
class ReferenceResult:
    steps: int
    seconds: float
    score: float
    seconds_to_target: float | None = None  # wall time (evaluations included) when the target was reached
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out primary metric)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds


def train_one_process(config: Config) -> ReferenceResult:
    """Train ``config``'s task for ``config.steps`` (or until ``config.target_score``) in this process.

    Its settings are checked as the pipeline's are. It samples with the
    trainer's own module (on-policy, every step), so an engine holding weights
    of its own (vLLM, which the pipeline updates by message) is refused.
    """
    check_settings(config)
    check_task_settings(config)
    if config.engine not in ("builtin", "hf"):
        raise SettingsError(
            f"--engine {config.engine}: the one-process run samples the trainer's own model, which that engine would "
            "hold a copy of and never see updated; use the pipeline (python -m pipeline.grpo)"
        )
    config = resolve(config)
    torch.set_num_threads(config.threads)
    task = load_task(config)
    device = torch.device(config.device_of("trainer"))
    learner = Learner(task, device)
    task.build_engine(learner.policy)  # --engine hf and --decode pick how the trainer's own module samples
    reference = learner.reference() if config.hyper("kl_coeff") > 0 else None  # β = 0: no reference at all
    scorer = task.build_scorer(device)
    rng = torch.Generator(device=device).manual_seed(1_000_003 * (config.seed + 1) + 7_919)
    curve: list[tuple[int, float]] = []
    reached: float | None = None
    score = 0.0
    start = time.perf_counter()
    step = 0
    while step < config.steps:
        with torch.no_grad():
            samples = task.sample(learner.policy, rng, ticket=step)
            scores = task.score(scorer, samples)
            ref_logps = None if reference is None else task.reference_logps(reference, samples)
        learner.update(samples, scores.rewards.to(device), ref_logps)  # a task may score on the CPU
        step += 1
        if reference is not None and config.syncs_reference_after(step):
            learner.mix_reference(config.ref_model_mixup_alpha)
            reference.load_state_dict(learner.reference_state)
        if step % config.eval_every == 0 or step == config.steps:
            score = learner.evaluate(step)[task.primary]
            curve.append((step, score))
            if config.target_score is not None and score >= config.target_score:
                reached = time.perf_counter() - start
                break
    return ReferenceResult(step, time.perf_counter() - start, score, reached, curve)
