"""GRPO on tokens: group-relative advantages, a clipped ratio per token, k3 KL to the reference.

For ``N = B x G`` completions of ``B`` prompts (``G`` each), with rewards
``r`` [N]:

* advantage ``A_i = (r_i - mean(r of its group)) / (std(r of its group) + 1e-6)``,
  the same for every token of completion ``i``;
* ratio ``rho_t = exp(log pi(y_t) - log pi_behaviour(y_t))`` against the
  log-probabilities the generator sampled with, carried in the rollout, so a
  stale sample is corrected, not just counted;
* policy loss ``-min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A)``;
* KL to the reference, the k3 estimator ``exp(d) - d - 1`` with
  ``d = log pi_ref(y_t) - log pi(y_t)`` (non-negative, low variance);
* loss = mean over every completion token (the mask ends each completion at
  its EOS) of ``policy loss + beta * KL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenLoss", "group_advantages", "token_grpo_loss"]


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """Rewards [N] normalised within consecutive groups of ``group`` samples."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True, unbiased=False) if group > 1 else torch.ones_like(mean)
    return ((grouped - mean) / (std + eps)).view(-1)


@dataclass
class TokenLoss:
    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float
    entropy: float


def token_grpo_loss(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip: float,
    kl_coeff: float,
    entropy: torch.Tensor | None = None,
) -> TokenLoss:
    """The loss over completion tokens ([N, T] each; ``advantages`` [N])."""
    tokens = mask.sum().clamp_min(1.0)
    ratio = (logps - behaviour_logps).exp()
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip, 1 + clip) * adv
    policy = -torch.min(unclipped, clipped)
    d = ref_logps - logps
    kl = d.exp() - d - 1
    loss = ((policy + kl_coeff * kl) * mask).sum() / tokens
    with torch.no_grad():
        clip_fraction = float(((clipped < unclipped).float() * mask).sum() / tokens)
        mean_entropy = float((entropy * mask).sum() / tokens) if entropy is not None else 0.0
        return TokenLoss(
            loss, float((policy * mask).sum() / tokens), float((kl * mask).sum() / tokens), clip_fraction, mean_entropy
        )
