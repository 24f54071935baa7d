"""GRPO's loss on tokens: group advantages, the clipped ratio and its variants, the k3 KL, token weights.

For ``N`` completions (``G`` per prompt) with rewards ``r`` [N] and a
completion mask ``m`` [N, T]:

* **advantage** ``A_i = (r_i - mean_g(r)) / (s + 1e-4)``, the same for every
  token of completion ``i``; ``s`` is the std of its group (``scale="group"``),
  of the whole batch (``"batch"``), or 1 with no ``+ 1e-4`` (``"none"``);
* **ratio** ``rho = exp(log pi(y_t) - log mu(y_t))`` against the behaviour
  log-probabilities the generator recorded — per token, or (``level=
  "sequence"``, GSPO) one ratio per completion, the exponential of its tokens'
  mean log-ratio, shared by its tokens;
* **policy term** ``max(-rho A, -clip(rho, 1 - eps_low, 1 + eps_high) A)``,
  and where ``A < 0`` at most ``-C A`` (the dual clip; ``C = 0`` turns it off;
  TRL's two-sided ``delta`` is this clip with ``C = delta`` for any
  ``delta >= 1 + eps_high``, the range TRL recommends); or, for ``cispo``
  (MiniMax-M1), ``-sg(min(rho, eps_high)) A log pi``: the capped ratio weighs
  the plain policy gradient and no token's gradient is ever zeroed; or, for
  ``sapo`` (Qwen's SAPO), ``-(4 / tau) sigmoid(tau (rho - 1)) A``, a soft gate
  in place of the clip (``tau`` one temperature for ``A > 0``, another for
  the rest): its gradient is the policy gradient at ``rho = 1`` and fades
  smoothly away from it; or, for ``vespo`` (VESPO), ``-sg(phi(w)) A log pi``
  with ``w`` the completion's ratio, the exponential of the *sum* of its
  tokens' log-ratios (times their importance weights, if any), and
  ``phi(w) = exp(lam + k log w - lam w)``, a Gamma-shaped weight with
  ``phi(1) = 1`` that fades both for ``w`` far below 1 (power ``k``) and
  above it (decay ``lam``), ``k``, ``lam`` one pair for ``A >= 0`` and one
  for the rest;
* **off-policy mask** (a threshold ``delta``; DeepSeek-V3.2, TRL's
  ``off_policy_mask_threshold``): a completion with ``A < 0`` whose tokens'
  mean ``log mu - log pi`` exceeds ``delta`` drops out of the policy term;
* **top entropy** (``top_entropy`` below 1): the policy term only for
  the tokens whose entropy is in that top share of the pass's unmasked tokens (the
  high-entropy "forking" tokens; TRL's ``top_entropy_quantile``, whose quantile
  is each micro-batch's too), the KL for every token;
* **importance weights** (``is_cap`` above 0; TRL's vLLM importance
  sampling): the ratio is then to the trainer's own log-probs before the
  update, and each token's policy term is weighted by ``w = pi_old / mu`` —
  per token, or per completion (the exponential of the sum of its tokens'
  log-ratios) — truncated to ``[is_min, is_cap]`` or, in the ``mask`` modes,
  zeroed outside it;
* **KL** to the reference, k3: ``exp(d) - d - 1`` with ``d = log pi_ref - log pi``,
  times ``rho`` with ``kl_is_weighted`` (TRL's ``use_bias_correction_kl``: the
  estimate under the behaviour's samples, corrected to the policy's);
* **entropy** ``H``: the mean entropy of the tokens the policy term trains
  (every unmasked token, or the top-entropy share), reported as a
  differentiable term, ``entropy_bonus``, which the learner subtracts times
  its coefficient (TRL's ``entropy_coef``; :class:`EntropyControl`) whatever
  the variant's weights, so the coefficient means the same for every loss;
* **loss** ``sum_{i,t} w_{i,t} (policy + beta KL)``, the weights ``w`` set by
  the variant (:func:`token_weights`): ``grpo`` averages each completion's
  tokens, then the completions (so does ``sapo``); ``dapo``, ``cispo`` and
  ``vespo`` average every token of the batch; ``dr_grpo`` divides by the constant ``N x L`` (``L`` the
  completion limit); ``luspo`` (LUSPO: GSPO's sequence ratio, each completion
  weighted by its length) divides every token's term by ``N`` alone.

Weights are computed over a whole batch, so a micro-batch's loss is its share
of the batch's loss and gradients accumulated over micro-batches equal the
batch's (but for a top-entropy share below 1: its threshold is each pass's). Masked positions are excluded before any ``exp``: whatever numbers
padding holds, they can neither overflow nor turn ``inf x 0`` into NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = [
    "CISPO_CAP",
    "IS_MODES",
    "LOSSES",
    "RATIO_LEVELS",
    "REWARD_SCALES",
    "IsMode",
    "LossKind",
    "LossSpec",
    "RatioLevel",
    "RewardScale",
    "TokenLoss",
    "group_advantages",
    "high_entropy_tokens",
    "nan_moments",
    "token_grpo_loss",
    "token_weights",
]

#: ``grpo``: per-completion token mean; ``dr_grpo``: constant normaliser; ``dapo``: token mean over the batch;
#: ``cispo``: the capped ratio as a weight on the policy gradient (no token's gradient zeroed), dapo's mean;
#: ``sapo``: a soft, temperature-controlled gate on the ratio in place of the clip, grpo's mean;
#: ``luspo``: the clip on GSPO's sequence ratio, each completion's term times its length (a sum over its tokens);
#: ``vespo``: a Gamma-shaped weight of the completion's ratio on the policy gradient, dapo's mean.
LossKind = Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
#: What divides a group's centred rewards: its own std, the batch's, or nothing.
RewardScale = Literal["group", "batch", "none"]
#: One importance ratio per token (GRPO), or per completion, the geometric mean of its tokens' (GSPO).
RatioLevel = Literal["token", "sequence"]
#: Importance weights against the behaviour policy: per token or per completion, truncated or masked outside bounds.
IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IS_MODES: tuple[str, ...] = get_args(IsMode)
LOSSES: tuple[str, ...] = get_args(LossKind)
#: cispo's cap on the ratio (eps_max) where none is given: ScaleRL's recommended value.
CISPO_CAP = 5.0
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
REWARD_SCALES: tuple[str, ...] = get_args(RewardScale)


@dataclass(frozen=True)
class LossSpec:
    """Which GRPO: the normalisation, the clip range, the dual clip and the KL weight."""

    kind: LossKind = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.2  # cispo: the cap on the ratio itself (eps_max), not 1 + it
    dual_clip: float = 3.0  # 0: off
    kl_coeff: float = 0.0
    max_length: int = 0  # dr_grpo's L; 0: the width of the mask
    is_cap: float = 0.0  # > 0: importance weights with this upper bound; 0: none, the ratio is to the behaviour
    is_mode: IsMode = "token_truncate"  # per token or per completion; truncated to the bounds or masked outside
    is_min: float = 0.0  # the importance weight's lower bound (0: none)
    level: RatioLevel = "token"  # sequence: one ratio per completion (GSPO, TRL's importance_sampling_level)
    top_entropy: float = 1.0  # < 1: the policy term for this top share of tokens by entropy only
    off_policy_mask: float | None = None  # delta: A < 0 completions further than it from the behaviour drop out
    kl_is_weighted: bool = False  # the KL term times the ratio (TRL's use_bias_correction_kl)
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature where A > 0
    sapo_tau_neg: float = 1.05  # sapo: where A <= 0 (steeper: a negative token's update fades sooner)
    vespo_k_pos: float = 2.0  # vespo: the weight's power of w where A >= 0 (how fast it fades below w = 1)
    vespo_lambda_pos: float = 3.0  # vespo: its decay where A >= 0 (how fast it fades above w = 1)
    vespo_k_neg: float = 3.0  # vespo: the same where A < 0
    vespo_lambda_neg: float = 2.0


def nan_moments(values: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and population std of ``values`` along ``dim`` (kept), leaving NaNs (unscored rewards) out; 0
    where none is left."""
    present = ~values.isnan()
    count = present.sum(dim, keepdim=True).clamp_min(1)
    mean = torch.where(present, values, torch.zeros_like(values)).sum(dim, keepdim=True) / count
    centred = torch.where(present, values - mean, torch.zeros_like(values))
    return mean, (centred.square().sum(dim, keepdim=True) / count).sqrt()


def group_advantages(
    rewards: torch.Tensor, group: int, scale: RewardScale = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Rewards [N] centred within consecutive groups of ``group`` samples, scaled as ``scale`` says.

    A NaN reward (a completion no reward function scored) is left out of its
    group's mean and std, and its advantage is 0, as in TRL.
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"unknown reward scaling {scale!r}; choose one of {', '.join(REWARD_SCALES)}")
    grouped = rewards.view(-1, group)
    mean, std = nan_moments(grouped, 1)
    centred = grouped - mean
    if scale == "group":
        centred = centred / (std + eps)
    elif scale == "batch":
        centred = centred / (nan_moments(rewards.view(1, -1), 1)[1] + eps)
    return centred.reshape(-1).nan_to_num(0.0)


def group_spread(rewards: torch.Tensor, group: int, signal: torch.Tensor | None = None) -> tuple[float, float]:
    """Rewards [N] in consecutive groups of ``group``: the mean of the groups' (population) stds, and the share of
    groups whose advantages are all 0 (TRL's ``reward_std`` and ``frac_reward_zero_std``): it teaches nothing.

    That share is of the groups whose rewards are all equal, or, given the
    ``signal`` the advantages come from where it is not the rewards (GDPO's
    sum of normalised rewards), whose signal is: anti-correlated functions
    can sum to a flat total whose signal is not. NaN rewards (unscored) are
    left out.
    """
    std = nan_moments(rewards.view(-1, group), 1)[1].squeeze(1)
    flat = std if signal is None else nan_moments(signal.view(-1, group), 1)[1].squeeze(1)
    return float(std.mean()), float(torch.isclose(flat, torch.zeros_like(flat)).float().mean())


def high_entropy_tokens(entropy: torch.Tensor, real: torch.Tensor, share: float) -> torch.Tensor:
    """The tokens of ``real`` [N, T] whose ``entropy`` is in the top ``share`` of theirs: at or above its
    (1 - share) quantile, so ties at the threshold all stay and the highest one always does."""
    values = entropy[real].float()
    if share >= 1 or values.numel() == 0:
        return real
    # the (1 - share) quantile, interpolated as torch.quantile does (which refuses over 2**24 values)
    ordered = values.sort().values
    position = (1.0 - share) * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    threshold = ordered[low] + (position - low) * (ordered[high] - ordered[low])
    return real & (entropy >= threshold.to(entropy.dtype))


def token_weights(mask: torch.Tensor, kind: LossKind, max_length: int = 0, within: slice | None = None) -> torch.Tensor:
    """Each token's weight [N, T] in the loss of the batch ``mask`` [N, T] describes (0 where masked).

    ``within``: the loss is that of those rows alone (a mini-batch, one optimiser step's), the other rows weigh 0.
    """
    if within is not None:
        weights = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        weights[within] = token_weights(mask[within], kind, max_length)
        return weights
    mask = mask.to(torch.float32)
    rows = max(1, mask.shape[0])
    if kind in ("dapo", "cispo", "vespo"):
        return mask / mask.sum().clamp_min(1.0)
    if kind == "luspo":
        return mask / rows
    if kind in ("grpo", "sapo"):
        return mask / (mask.sum(1, keepdim=True).clamp_min(1.0) * rows)
    if kind == "dr_grpo":
        return mask / (rows * (max_length or mask.shape[1]))
    raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")


@dataclass
class TokenLoss:
    """The loss to minimise and, as token means over the batch, what RL users watch."""

    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float  # tokens whose clipped term was the one taken (cispo: whose ratio was capped)
    dual_clip_fraction: float  # tokens (A < 0) held at -C A by the dual clip
    entropy: float
    logp_diff: float = 0.0  # mean |log π_trainer - log π_behaviour| before the update: engine mismatch + staleness
    is_weight: float = 1.0  # importance weights: the mean token weight, π_trainer/π_behaviour bounded
    is_truncated: float = 0.0  # importance weights: tokens whose weight was outside the bounds (truncated or masked)
    off_policy_masked: float = 0.0  # tokens of completions the off-policy mask took out of the policy term
    trained_entropy: float = 0.0  # the mean entropy of the tokens the policy term trains (the bonus's H)
    vespo_weight: float = 0.0  # vespo: the mean of its weight phi(w) over the tokens (1 on-policy; 0 for the others)
    entropy_bonus: torch.Tensor | None = None  # that H as this batch's share, differentiable where the entropy is


def _importance_weights(gap: torch.Tensor, real: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's weight [N, T] from ``gap`` = log pi_old - log mu (0 where masked), and the tokens outside the
    bounds: per token or, at sequence level, the completion's summed log-ratio shared by its tokens."""
    dtype, gap = gap.dtype, gap.float()  # a completion's sum in float32, whatever the log-probs' type
    if spec.is_mode.startswith("sequence"):
        gap = torch.where(real, gap.sum(1, keepdim=True).expand_as(gap), torch.zeros_like(gap))
    elif not spec.is_mode.startswith("token"):
        raise ValueError(f"unknown importance weights {spec.is_mode!r}; choose one of {', '.join(IS_MODES)}")
    weight = gap.exp()  # may be inf (a long completion's sum): then outside the bounds, truncated or masked
    outside = real & ((weight > spec.is_cap) | (weight < spec.is_min))
    if spec.is_mode.endswith("mask"):
        weight = torch.where(outside, torch.zeros_like(weight), weight)
    else:
        weight = weight.clamp(spec.is_min, spec.is_cap)
    return torch.where(real, weight, torch.ones_like(weight)).to(dtype), outside


#: VESPO's floor on a completion's log-ratio, log 1e-8 (as the paper's code), and its ceiling.
_VESPO_LOG_RANGE = (math.log(1e-8), 20.0)


def _gamma_weights(
    log_ratio: torch.Tensor,
    is_weight: torch.Tensor | None,
    real: torch.Tensor,
    adv: torch.Tensor,
    spec: LossSpec,
) -> torch.Tensor:
    """VESPO's weight [N, 1] of each completion, no gradient: ``phi(w) = exp(lam + k log w - lam w)``, ``log w`` the
    sum of its tokens' log-ratios (0 where masked) and of the logs of their importance weights (a sequence form's
    weight counted once), within ``_VESPO_LOG_RANGE``; an overflow or NaN weighs 0."""
    low, high = _VESPO_LOG_RANGE
    with torch.no_grad():
        log_w = log_ratio.float().clamp(-20.0, 20.0).sum(1, keepdim=True)
        if is_weight is not None:
            logs = torch.where(real, is_weight.float().log().clamp(low, high), torch.zeros_like(log_ratio.float()))
            total = logs.sum(1, keepdim=True)
            if spec.is_mode.startswith("sequence"):  # each token holds the completion's one weight
                total = total / real.sum(1, keepdim=True).clamp_min(1)
            log_w = log_w + total
        log_w = log_w.clamp(low, high)
        positive = adv >= 0
        k = torch.where(positive, spec.vespo_k_pos, spec.vespo_k_neg)
        lam = torch.where(positive, spec.vespo_lambda_pos, spec.vespo_lambda_neg).clamp_min(1e-4)
        phi = (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return phi.to(log_ratio.dtype)


def token_grpo_loss(
    logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    tokens: float | None = None,
) -> TokenLoss:
    """The loss of completions [N, T] (``advantages`` [N]); ``ref_logps`` None means no KL term.

    ``weights`` and ``tokens`` (the batch's unmasked token count) default to
    this batch's own; a micro-batch passes its rows of the whole batch's, so
    its loss and figures are its share of the batch's and add up to them.
    """
    real = mask > 0
    if weights is None:
        weights = token_weights(mask, spec.kind, spec.max_length)
    per_token_mean = real.to(logps.dtype) / (tokens if tokens is not None else float(real.sum().clamp_min(1)))
    trainer_gap = torch.where(real, logps.detach() - behaviour_logps, torch.zeros_like(logps))
    is_weight = torch.ones_like(logps)
    outside = torch.zeros_like(real)
    if spec.is_cap > 0:
        # the ratio is to the trainer's own log-probs before this update (1 in value, the policy gradient in its
        # gradient) and each token is weighted by π_trainer/π_behaviour, bounded, which absorbs both an engine whose
        # numerics differ from the trainer's and the rollout's staleness
        anchor = logps.detach()
        is_weight, outside = _importance_weights(trainer_gap, real, spec)
    else:
        anchor = behaviour_logps
    log_ratio = torch.where(real, logps - anchor, torch.zeros_like(logps))
    if spec.kind == "luspo" and spec.level != "sequence":
        raise ValueError("luspo weighs GSPO's sequence ratio by the completion's length: it needs the sequence level")
    if spec.level == "sequence":  # GSPO: a completion's tokens share exp(their mean log-ratio), clipped as one
        mean = log_ratio.sum(1, keepdim=True) / real.sum(1, keepdim=True).clamp_min(1)
        log_ratio = torch.where(real, mean.expand_as(log_ratio), torch.zeros_like(log_ratio))
    elif spec.level != "token":
        raise ValueError(f"unknown ratio level {spec.level!r}; choose one of {', '.join(RATIO_LEVELS)}")
    # e^20 is past every clip and gate; bounding the exponent keeps a wild ratio from inf (and inf x 0 from NaN)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    adv = advantages.unsqueeze(1).to(logps.dtype)
    dual = torch.zeros_like(real)
    phi: torch.Tensor | None = None  # vespo's weight [N, 1]
    if spec.kind == "vespo":  # the completion's Gamma weight on -A log pi: its gradient is -sg(phi(w)) A grad log pi
        if spec.level != "token":
            raise ValueError("vespo takes a completion's ratio from its tokens' log-ratios: leave the level at token")
        capped = torch.zeros_like(real)
        phi = _gamma_weights(log_ratio, is_weight if spec.is_cap > 0 else None, real, adv, spec)
        policy = -phi * adv * torch.where(real, logps, torch.zeros_like(logps))
    elif spec.kind == "cispo":  # the capped ratio weighs -A log pi: its gradient is -sg(min(rho, cap)) A grad log pi
        capped = ratio > spec.clip_high
        policy = -ratio.detach().clamp(max=spec.clip_high) * adv * torch.where(real, logps, torch.zeros_like(logps))
    elif spec.kind == "sapo":  # the gate 4 sigmoid(tau (rho - 1)) / tau: slope 1 at rho = 1, bounded by 4 / tau
        capped = torch.zeros_like(real)
        tau = torch.where(adv > 0, spec.sapo_tau_pos, spec.sapo_tau_neg)
        policy = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    else:
        unclipped = -ratio * adv
        clipped = -ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high) * adv
        capped = clipped > unclipped
        policy = torch.maximum(unclipped, clipped)
        if spec.dual_clip > 0:
            cap = -spec.dual_clip * adv
            dual = (adv < 0) & (policy > cap)
            policy = torch.where(dual, cap.expand_as(policy), policy)
    if spec.kind != "vespo":  # vespo's weight holds the importance weights already
        policy = policy * is_weight
    dropped = torch.zeros_like(real)
    if spec.off_policy_mask is not None:  # the behaviour's own log-probs: engine mismatch and staleness both count
        drift = torch.where(real, behaviour_logps - logps.detach(), torch.zeros_like(logps))
        far = drift.sum(1) / real.sum(1).clamp_min(1) > spec.off_policy_mask
        dropped = ((advantages < 0) & far).unsqueeze(1) & real
        policy = torch.where(dropped, torch.zeros_like(policy), policy)
    trained = real
    if spec.top_entropy < 1:
        if entropy is None:
            raise ValueError("a top-entropy share below 1 needs the tokens' entropies")
        trained = high_entropy_tokens(entropy, real, spec.top_entropy)
        policy = policy * trained.to(policy.dtype)
    bonus = None
    if entropy is not None:  # this pass's share of the trained tokens' mean: its tokens' share of the batch's
        share = real.sum() / trained.sum().clamp_min(1) / (tokens if tokens is not None else real.sum().clamp_min(1))
        bonus = torch.where(trained, entropy, torch.zeros_like(entropy)).sum() * share
    per_token = policy
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        d = torch.where(real, ref_logps - logps, torch.zeros_like(logps))
        kl = d.exp() - d - 1
        if spec.kl_is_weighted:
            kl = kl * ratio
        per_token = per_token + spec.kl_coeff * kl
    loss = (per_token * weights.to(per_token.dtype)).sum()
    with torch.no_grad():
        return TokenLoss(
            loss,
            float((policy * per_token_mean).sum()),
            float((kl * per_token_mean).sum()),
            float((capped & real).to(logps.dtype).mul(per_token_mean).sum()),
            float((dual & real).to(logps.dtype).mul(per_token_mean).sum()),
            float((torch.where(real, entropy, 0.0) * per_token_mean).sum()) if entropy is not None else 0.0,
            float((trainer_gap.abs() * per_token_mean).sum()),
            float((is_weight * per_token_mean).sum()),
            float(outside.to(logps.dtype).mul(per_token_mean).sum()),
            float(dropped.to(logps.dtype).mul(per_token_mean).sum()),
            float(bonus.detach()) if bonus is not None else 0.0,
            float((phi * per_token_mean).sum()) if phi is not None else 0.0,
            entropy_bonus=bonus,
        )
