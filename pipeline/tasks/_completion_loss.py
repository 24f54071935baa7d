"""GRPO's loss over a task's completions, in passes of a bounded size: the loss every token-level task shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..algorithm import LossSpec, group_advantages, token_grpo_loss, token_weights
from ._interface import LossReport

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["completion_loss", "loss_spec"]


def loss_spec(config: Config, max_length: int = 0) -> LossSpec:
    """The GRPO variant a resolved ``config`` names; ``max_length`` is the completion limit (``dr_grpo``'s L)."""
    weights = config.importance_mode()
    return LossSpec(
        kind=config.loss,
        clip_low=config.hyper("clip"),
        clip_high=config.hyper("epsilon_high"),
        dual_clip=config.dual_clip,
        kl_coeff=config.hyper("kl_coeff"),
        max_length=max_length,
        is_cap=0.0 if weights is None else config.is_cap,
        is_mode=weights or "token_truncate",
        is_min=config.is_min,
        level=config.importance_sampling_level,
        top_entropy=config.top_entropy_quantile,
        off_policy_mask=config.off_policy_mask_threshold,
        kl_is_weighted=config.use_bias_correction_kl,
        sapo_tau_pos=config.sapo_temperature_pos,
        sapo_tau_neg=config.sapo_temperature_neg,
        vespo_k_pos=config.vespo_k_pos,
        vespo_lambda_pos=config.vespo_lambda_pos,
        vespo_k_neg=config.vespo_k_neg,
        vespo_lambda_neg=config.vespo_lambda_neg,
    )


def completion_loss(
    config: Config,
    max_length: int,
    policy_logps: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    behaviour: torch.Tensor,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group: int,
    truncated: torch.Tensor,
    rows: slice | None,
    batch: slice | None = None,
) -> LossReport:
    """The GRPO loss of the completions in ``rows`` of one rollout of token completions.

    ``policy_logps(part)`` gives the policy's log-probabilities and entropies
    [n, T] of those rows; ``behaviour``, ``ref_logps`` and ``mask`` [N, T],
    ``rewards`` and ``truncated`` [N] are the whole rollout's, so advantages
    and normalisers are the whole batch's whatever the micro-batch. ``batch``
    (a mini-batch holding ``rows``) makes the normalisers its rows' alone;
    the advantages stay the rollout's.
    """
    spec = loss_spec(config, max_length)
    if config.mask_truncated:  # a completion cut off at the limit has no verdict on its end: it does not train
        mask = mask * (~truncated).to(mask.dtype).unsqueeze(1)
    part = slice(None) if rows is None else rows
    advantages = group_advantages(rewards, group, config.scale_rewards or "group")
    weights = token_weights(mask, spec.kind, spec.max_length, batch)
    logps, entropy = policy_logps(part)
    out = token_grpo_loss(
        logps,
        behaviour[part],
        None if ref_logps is None else ref_logps[part],
        mask[part],
        advantages[part],
        spec,
        entropy=entropy,
        weights=weights[part],
        tokens=float(mask[slice(None) if batch is None else batch].sum().clamp_min(1.0)),
    )
    return LossReport.of(out)
