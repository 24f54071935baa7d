"""The default task: a synthetic contextual bandit, and the GRPO step that learns it.

Each rollout draws a random state and samples a *group* of G actions from
the policy; a fixed, frozen reward MLP scores each (state, one-hot action),
so every action has its own reward surface over the states. GRPO
normalises rewards within the group into advantages and applies a PPO-clip
update with a KL penalty toward a frozen reference policy.

Swap the task by subclassing :class:`BanditTask` (override ``build_policy``,
``build_reward`` or ``sample_state``) and pointing the pipeline at it with
``--task module:Class``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BanditTask", "GRPOLoss", "grpo_loss"]


class BanditTask:
    """State -> G sampled actions -> rewards from a fixed MLP. Deterministic per ``seed``."""

    state_dim = 4
    action_dim = 4
    hidden = 32  # policy width
    reward_hidden = 16
    group_size = 8

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def build_policy(self) -> torch.nn.Module:
        """A fresh policy; the trainer seeds torch before calling this."""
        return torch.nn.Sequential(
            torch.nn.Linear(self.state_dim, self.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.hidden, self.action_dim),
        )

    def build_reward(self) -> torch.nn.Module:
        """The frozen reward model; identical in every process for a given seed."""
        generator = torch.Generator().manual_seed(10_000 + self.seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(self.state_dim + self.action_dim, self.reward_hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(self.reward_hidden, 1),
        )
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
                p.requires_grad_(False)
        return net.eval()

    def sample_state(self, generator: torch.Generator) -> torch.Tensor:
        """A random state on ``generator``'s device."""
        return torch.randn(self.state_dim, generator=generator, device=generator.device)

    def rewards(self, reward_net: torch.nn.Module, state: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Reward of each action in ``actions`` ([G] long) taken in ``state`` ([state_dim])."""
        one_hot = torch.nn.functional.one_hot(actions, self.action_dim).float()
        inputs = torch.cat([state.unsqueeze(0).expand(len(actions), -1), one_hot], dim=-1)
        with torch.no_grad():
            rewards: torch.Tensor = reward_net(inputs).squeeze(-1)
        return rewards

    def eval_states(self, count: int = 256) -> torch.Tensor:
        """A fixed batch of states for measuring the policy."""
        generator = torch.Generator().manual_seed(20_000 + self.seed)
        return torch.stack([self.sample_state(generator) for _ in range(count)])

    def sample_group(
        self, policy: torch.nn.Module, state: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A group of ``group_size`` actions sampled from ``policy`` in ``state``, with their log-probs."""
        with torch.no_grad():
            logps = torch.log_softmax(policy(state), dim=-1)
        actions = torch.multinomial(logps.exp(), self.group_size, replacement=True, generator=generator)
        return actions, logps[actions]

    def reward_table(self, reward_net: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
        """Reward of every action in every state: ``[B, action_dim]``."""
        actions = torch.arange(self.action_dim, device=states.device)
        return torch.stack([self.rewards(reward_net, s, actions) for s in states])

    @staticmethod
    def score(policy: torch.nn.Module, states: torch.Tensor, table: torch.Tensor) -> float:
        """(expected reward - mean over actions) / (best - mean), averaged: 1 optimal, 0 random."""
        with torch.no_grad():
            probs = torch.softmax(policy(states), dim=-1)
            mean = table.mean(-1)
            score = ((probs * table).sum(-1) - mean) / (table.max(-1).values - mean).clamp_min(1e-6)
        return float(score.mean())

    def normalized_score(self, policy: torch.nn.Module, reward_net: torch.nn.Module, states: torch.Tensor) -> float:
        """:meth:`score` on ``states``, building their reward table first."""
        return self.score(policy, states, self.reward_table(reward_net, states))


@dataclass
class GRPOLoss:
    loss: torch.Tensor
    ppo: float
    kl: float


def grpo_loss(
    policy: torch.nn.Module,
    state: torch.Tensor,
    actions: torch.Tensor,
    old_logps: torch.Tensor,
    rewards: torch.Tensor,
    ref_logps: torch.Tensor,
    clip: float,
    kl_coeff: float,
) -> GRPOLoss:
    """Group-relative advantages, PPO-clip on the sampled actions, k3 KL to the reference."""
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    logps = torch.log_softmax(policy(state), dim=-1)[actions]
    ratio = (logps - old_logps).exp()
    ppo = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
    log_ratio = ref_logps - logps
    kl = (log_ratio.exp() - log_ratio - 1).mean()  # non-negative, low-variance estimator
    return GRPOLoss(ppo + kl_coeff * kl, float(ppo.detach()), float(kl.detach()))
