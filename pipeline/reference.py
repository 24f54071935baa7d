"""The same GRPO task trained in one process, on-policy, with no messaging.

The yardstick for the pipeline: ``bench_grpo.py`` compares steps/s and the
acceptance check compares final scores against it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from .messages import Config
from .roles import load_task
from .task import grpo_loss


@dataclass
class ReferenceResult:
    steps: int
    seconds: float
    score: float

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds


def train_one_process(config: Config) -> ReferenceResult:
    """Generate, score, reference and train in one loop on the trainer's device; returns the final score."""
    task = load_task(config)
    device = torch.device(config.device_of("trainer"))
    torch.manual_seed(config.seed)
    policy = task.build_policy().to(device)
    ref = copy.deepcopy(policy).requires_grad_(False)
    reward_net = task.build_reward().to(device)
    optim = torch.optim.Adam(policy.parameters(), lr=config.lr)
    rng = torch.Generator(device=device).manual_seed(1_000_003 * (config.seed + 1) + 7_919)
    start = time.perf_counter()
    for _ in range(config.steps):
        state = task.sample_state(rng)
        actions, logps = task.sample_group(policy, state, rng)
        rewards = task.rewards(reward_net, state, actions)
        with torch.no_grad():
            ref_logps = torch.log_softmax(ref(state), dim=-1)[actions]
        out = grpo_loss(policy, state, actions, logps, rewards, ref_logps, config.clip, config.kl_coeff)
        optim.zero_grad()
        out.loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
    seconds = time.perf_counter() - start
    score = task.normalized_score(policy, reward_net, task.eval_states(config.eval_states).to(device))
    return ReferenceResult(config.steps, seconds, score)
