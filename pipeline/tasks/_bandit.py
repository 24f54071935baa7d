"""``--task bandit``: a synthetic contextual bandit learned by an MLP, the smallest GRPO there is.

Each rollout draws a random state and samples a *group* of ``config.group``
actions from the policy; a fixed, frozen reward MLP (the scorer's model)
scores each (state, one-hot action), so every action has its own reward
surface over the states. The loss is :func:`pipeline.algorithm.token_grpo_loss`
with one "token" per sample. Evaluation reports the normalized score: the
policy's expected reward on fixed states, 0 for a uniform policy and 1 for
the best action everywhere. Each step takes milliseconds, which makes the
bandit the task the runtime's tests and restart drills use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from ..algorithm import group_advantages, token_grpo_loss, token_weights
from ._completion_loss import loss_spec
from ._interface import LossReport, Scores, Task

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["BanditSamples", "BanditTask"]

#: Seed offsets of the reward model's weights and of the evaluation states.
REWARD_SEED, EVAL_SEED = 10_000, 20_000


@dataclass
class BanditSamples:
    """One group: the state, the sampled actions and their behaviour log-probabilities."""

    state: torch.Tensor  # [state_dim]
    actions: torch.Tensor  # [G] int64
    logps: torch.Tensor  # [G]


class BanditTask(Task):
    """State -> G sampled actions -> rewards from a fixed MLP. Deterministic per seed."""

    defaults: ClassVar[dict[str, float]] = {"lr": 0.02, "kl_coeff": 0.05, "clip": 0.2}
    primary: ClassVar[str] = "score"
    state_dim = 4
    action_dim = 4
    hidden = 32  # policy width
    reward_hidden = 16

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._eval: tuple[torch.Tensor, torch.Tensor] | None = None  # states and their reward table, built once

    def build_policy(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(self.state_dim, self.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, self.action_dim),
        )

    def build_scorer(self, device: torch.device) -> torch.nn.Module:
        """The frozen reward model; identical in every process for a given seed."""
        generator = torch.Generator(device="cpu").manual_seed(REWARD_SEED + self.seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(self.state_dim + self.action_dim, self.reward_hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.reward_hidden, 1),
        )
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, device="cpu"))
                p.requires_grad_(False)
        return net.eval().to(device)

    def sample_state(self, generator: torch.Generator) -> torch.Tensor:
        """A random state on ``generator``'s device."""
        return torch.randn(self.state_dim, generator=generator, device=generator.device)

    def sample(self, policy: torch.nn.Module, generator: torch.Generator, ticket: int = 0) -> BanditSamples:
        state = self.sample_state(generator)
        with torch.no_grad():
            logps = torch.log_softmax(policy(state.to(_dtype_of(policy))).float(), dim=-1)
        actions = torch.multinomial(logps.exp(), self.config.group, replacement=True, generator=generator)
        return BanditSamples(state, actions, logps[actions])

    def rewards(self, reward_net: torch.nn.Module, state: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Reward of each action in ``actions`` ([G] long) taken in ``state`` ([state_dim])."""
        one_hot = torch.nn.functional.one_hot(actions, self.action_dim).float()
        inputs = torch.cat([state.unsqueeze(0).expand(len(actions), -1), one_hot], dim=-1)
        with torch.no_grad():
            rewards: torch.Tensor = reward_net(inputs).squeeze(-1)
        return rewards

    def score(self, scorer: torch.nn.Module, samples: BanditSamples) -> Scores:
        return Scores(self.rewards(scorer, samples.state, samples.actions))

    def reference_logps(self, reference: torch.nn.Module, samples: BanditSamples) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(reference(samples.state.to(_dtype_of(reference))).float(), dim=-1)[samples.actions]

    def loss(
        self,
        policy: torch.nn.Module,
        samples: BanditSamples,
        rewards: torch.Tensor,
        ref_logps: torch.Tensor | None,
        rows: slice | None = None,
        batch: slice | None = None,
    ) -> LossReport:
        part = slice(None) if rows is None else rows
        spec = loss_spec(self.config, 1)
        logp_all = torch.log_softmax(policy(samples.state), dim=-1)
        actions = samples.actions[part]
        ones = torch.ones(len(samples.actions), 1, device=samples.actions.device)
        entropy = -(logp_all.exp() * logp_all).sum().expand(len(actions), 1)
        out = token_grpo_loss(
            logp_all[actions].unsqueeze(1),
            samples.logps[part].unsqueeze(1),
            None if ref_logps is None else ref_logps[part].unsqueeze(1),
            ones[part],
            group_advantages(rewards, len(rewards), self.config.scale_rewards or "group")[part],
            spec,
            entropy=entropy,
            weights=token_weights(ones, spec.kind, 1, batch)[part],
            tokens=float(len(ones[slice(None) if batch is None else batch])),
        )
        return LossReport.of(out)

    def rows(self, samples: BanditSamples) -> int:
        return len(samples.actions)

    def eval_states(self, count: int) -> torch.Tensor:
        """A fixed batch of states for measuring the policy."""
        generator = torch.Generator(device="cpu").manual_seed(EVAL_SEED + self.seed)
        return torch.stack([self.sample_state(generator) for _ in range(count)])

    def reward_table(self, reward_net: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
        """Reward of every action in every state: ``[B, action_dim]``."""
        actions = torch.arange(self.action_dim, device=states.device)
        return torch.stack([self.rewards(reward_net, s, actions) for s in states])

    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """Normalized score on the fixed states: (expected - mean) / (best - mean) reward, averaged."""
        device = next(policy.parameters()).device
        if self._eval is None:
            states = self.eval_states(self.config.eval_size).to(device)
            self._eval = states, self.reward_table(self.build_scorer(device), states)
        states, table = self._eval
        with torch.no_grad():
            probs = torch.softmax(policy(states), dim=-1)
            mean = table.mean(-1)
            score = ((probs * table).sum(-1) - mean) / (table.max(-1).values - mean).clamp_min(1e-6)
        return {"score": float(score.mean())}

    def measure(self, samples: BanditSamples) -> tuple[int, float]:
        return len(samples.actions), 1.0


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model`` holds its weights in (bfloat16 on a run's generators and reference with ``--dtype``)."""
    return next(model.parameters()).dtype
