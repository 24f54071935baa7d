"""GRPO's arithmetic on hand-computed batches: every loss variant, clip, dual clip, KL, masks, micro-batches,
the behaviour log-probs under top-p, gradient clipping, the learning-rate schedule and bfloat16."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from pipeline import Config, DigitsTask, Learner, resolve, train_one_process
from pipeline.algorithm import (
    LossSpec,
    group_advantages,
    group_spread,
    high_entropy_tokens,
    token_grpo_loss,
    token_weights,
)
from pipeline.learning import lr_factor
from pipeline.models import completion_logps
from pipeline.tasks import EOS, PAD, TokenBatch, loss_spec

# Two completions of one prompt; the second is one token long. Ratios e^0.5, 1 | e^-0.5, (masked).
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])
BEHAVIOUR = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
LOGPS = torch.tensor([[-0.5, -1.0], [-1.5, -7.0]])
REF = torch.tensor([[-1.0, -1.0], [-1.0, -3.0]])
# Policy terms: token 1: max(-1.6487, -1.2) = -1.2 (clipped); token 2: -1; token 3 (A = -1, ratio 0.6065):
# max(0.6065, 0.8) = 0.8 (clipped). k3 with d = ref - logp = -0.5, 0, 0.5.
POLICY = [-1.2, -1.0, 0.8]
KL = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(0.5) - 0.5 - 1]


def loss(spec: LossSpec, **kwargs):  # type: ignore[no-untyped-def]
    return token_grpo_loss(LOGPS, BEHAVIOUR, REF, MASK, ADVANTAGES, spec, **kwargs)


def test_tis_weights_each_token_by_the_truncated_ratio_to_the_behaviour_policy():
    # the trainer's log-probs before the update vs the behaviour's: e^0.5 (capped at 1.5), 1, e^-0.5
    out = loss(LossSpec(kind="dapo", is_cap=1.5))
    weights = [1.5, 1.0, math.exp(-0.5)]
    # the ratio is to the trainer's own log-probs (1 in value), so each term is -A times the weight
    assert out.policy_loss == pytest.approx((-1.5 - 1.0 + math.exp(-0.5)) / 3, abs=1e-5)
    assert out.is_weight == pytest.approx(sum(weights) / 3, abs=1e-5)
    assert out.is_truncated == pytest.approx(1 / 3) and out.clip_fraction == 0
    assert out.logp_diff == pytest.approx((0.5 + 0.0 + 0.5) / 3, abs=1e-5)


def test_tis_gradient_is_the_weighted_policy_gradient():
    logps = LOGPS.clone().requires_grad_(True)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="dapo", is_cap=1.5))
    out.loss.backward()
    expected = torch.tensor([[-1.5, -1.0], [math.exp(-0.5), 0.0]]) / 3  # d/dlogp of -A·w·e^(logp - sg(logp))
    assert torch.allclose(logps.grad, expected, atol=1e-6)


@pytest.mark.parametrize(
    "mode, is_min, weights, outside",
    [
        # token log-ratios of the trainer to the behaviour: 0.5, 0 | -0.5; bounds [is_min, 1.5]
        ("token_truncate", 0.7, [1.5, 1.0, 0.7], 2 / 3),
        ("token_mask", 0.0, [0.0, 1.0, math.exp(-0.5)], 1 / 3),
        ("token_mask", 0.7, [0.0, 1.0, 0.0], 2 / 3),
        # a completion's summed log-ratio, shared by its tokens: row 0 e^0.5 (past 1.5), row 1 e^-0.5
        ("sequence_truncate", 0.0, [1.5, 1.5, math.exp(-0.5)], 2 / 3),
        ("sequence_truncate", 0.7, [1.5, 1.5, 0.7], 1.0),
        ("sequence_mask", 0.0, [0.0, 0.0, math.exp(-0.5)], 2 / 3),
        ("sequence_mask", 0.7, [0.0, 0.0, 0.0], 1.0),
    ],
)
def test_importance_weights_per_token_or_completion_truncated_or_masked(mode, is_min, weights, outside):
    logps = LOGPS.clone().requires_grad_(True)
    spec = LossSpec(kind="dapo", is_cap=1.5, is_mode=mode, is_min=is_min)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, spec)
    # the ratio is to the trainer's own log-probs (1 in value): each term is -A times its weight
    assert out.policy_loss == pytest.approx((-weights[0] - weights[1] + weights[2]) / 3, abs=1e-5)
    assert out.is_weight == pytest.approx(sum(weights) / 3, abs=1e-5)
    assert out.is_truncated == pytest.approx(outside)
    out.loss.backward()
    expected = torch.tensor([[-weights[0], -weights[1]], [weights[2], 0.0]]) / 3
    assert torch.allclose(logps.grad, expected, atol=1e-6)


def test_a_sequence_weight_past_any_float_is_bounded_not_nan():
    # 40 tokens each 3 nats more likely to the trainer than to the sampler: e^120 overflows float32 (and bfloat16's
    # range is float32's, its precision less): truncated to the cap, or masked, never inf x 0
    logps = torch.zeros(2, 40, dtype=torch.bfloat16, requires_grad=True)
    behaviour = torch.full((2, 40), -3.0, dtype=torch.bfloat16)
    for mode, weight in (("sequence_truncate", 2.0), ("sequence_mask", 0.0)):
        spec = LossSpec(kind="dapo", is_cap=2.0, is_mode=mode)
        out = token_grpo_loss(logps, behaviour, None, torch.ones(2, 40), torch.tensor([1.0, -1.0]), spec)
        assert math.isfinite(float(out.loss.detach())) and out.is_weight == pytest.approx(weight), mode
        assert out.is_truncated == 1.0


def test_gspo_shares_one_clipped_ratio_per_completion():
    # row 0's log-ratios 0.5 and 0 share e^0.25 = 1.284, clipped to 1.2 (A = 1); row 1's one token e^-0.5, held
    # at 0.8 (A = -1): every token's clipped term is the one taken
    out = loss(LossSpec(kind="dapo", level="sequence"))
    assert out.policy_loss == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-5)
    assert out.clip_fraction == pytest.approx(1.0)
    assert out.logp_diff == pytest.approx(1 / 3, abs=1e-5), "the mismatch stays a token mean"


def test_gspo_gradient_flows_through_the_mean_log_ratio():
    logps = LOGPS.clone().requires_grad_(True)
    wide = LossSpec(kind="dapo", clip_low=0.9, clip_high=1.0, dual_clip=0, level="sequence")
    token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, wide).loss.backward()
    # a completion's n tokens each carry -A e^(mean log-ratio), weighted 1/3 (dapo), and each token's log-prob
    # enters that mean with 1/n: its gradient is n x 1/n of one term's
    row0 = -math.exp(0.25) / 3
    expected = torch.tensor([[row0, row0], [math.exp(-0.5) / 3, 0.0]])
    assert logps.grad is not None and torch.allclose(logps.grad, expected, atol=1e-6)
    token_level = token_grpo_loss(LOGPS, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="dapo"))
    same = LOGPS.clone()
    same[0] = BEHAVIOUR[0] + 0.25  # one log-ratio across a completion: the two levels agree
    assert loss(LossSpec(kind="dapo", level="sequence")).policy_loss != pytest.approx(token_level.policy_loss)
    for level in ("token", "sequence"):
        out = token_grpo_loss(same, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="dapo", level=level))  # type: ignore[arg-type]
        assert out.policy_loss == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-5), level
    with pytest.raises(ValueError, match="unknown ratio level 'word'; choose one of token, sequence"):
        loss(LossSpec(level="word"))  # type: ignore[arg-type]


def test_the_high_entropy_tokens_are_the_top_share_of_the_unmasked_ones():
    entropy = torch.tensor([[0.1, 0.9, 0.5], [0.7, 0.3, 9.0]])
    real = torch.tensor([[True, True, True], [True, True, False]])  # the 9.0 is padding
    # the 0.6 quantile of 0.1 0.3 0.5 0.7 0.9 is 0.58: 0.7 and 0.9 stay, two of five
    assert high_entropy_tokens(entropy, real, 0.4).tolist() == [[False, True, False], [True, False, False]]
    assert high_entropy_tokens(entropy, real, 0.01).sum() == 1, "the highest one always stays"
    assert torch.equal(high_entropy_tokens(entropy, real, 1.0), real)
    assert torch.equal(high_entropy_tokens(torch.full((2, 3), 0.5), real, 0.2), real), "ties at the threshold stay"
    nothing = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(high_entropy_tokens(entropy, nothing, 0.5), nothing)


def test_the_high_entropy_threshold_is_torch_quantiles_and_has_no_size_limit():
    entropy = torch.rand(64, 50, generator=torch.Generator().manual_seed(3))
    real = torch.rand(64, 50, generator=torch.Generator().manual_seed(4)) > 0.3
    for share in (0.05, 0.2, 0.5, 0.93):
        want = real & (entropy >= torch.quantile(entropy[real], 1 - share))
        assert torch.equal(high_entropy_tokens(entropy, real, share), want), share
    many = torch.arange(2**24 + 8, dtype=torch.float32).view(1, -1)  # torch.quantile refuses over 2**24 values
    kept = high_entropy_tokens(many, torch.ones_like(many, dtype=torch.bool), 0.25)
    assert int(kept.sum()) == pytest.approx(0.25 * many.numel(), abs=2)


def test_top_entropy_trains_the_policy_term_of_the_high_entropy_tokens_only():
    # entropies 0.2, 0.9 | 0.5 (and a pad's 5.0): the top third is token 2 alone, whose term is -1 (A = 1, ratio 1)
    entropy = torch.tensor([[0.2, 0.9], [0.5, 5.0]])
    logps = LOGPS.clone().requires_grad_(True)
    spec = LossSpec(kind="dapo", kl_coeff=0.1, top_entropy=1 / 3)
    out = token_grpo_loss(logps, BEHAVIOUR, REF, MASK, ADVANTAGES, spec, entropy=entropy)
    assert out.policy_loss == pytest.approx(-1.0 / 3, abs=1e-5)
    assert out.kl == pytest.approx(sum(KL) / 3, abs=1e-5), "the KL counts every token"
    assert float(out.loss.detach()) == pytest.approx((-1.0 + 0.1 * sum(KL)) / 3, abs=1e-5)
    out.loss.backward()  # type: ignore[no-untyped-call]
    assert logps.grad is not None
    # token 1 and 3 keep only their KL's gradient: d/dlogp of β (e^d - d - 1), d = ref - logp, over 3 tokens
    kl_grad = [0.1 * (1 - math.exp(-0.5)) / 3, 0.1 * (1 - math.exp(0.5)) / 3]
    assert float(logps.grad[0, 0]) == pytest.approx(kl_grad[0], abs=1e-6)
    assert float(logps.grad[1, 0]) == pytest.approx(kl_grad[1], abs=1e-6)
    with pytest.raises(ValueError, match="needs the tokens' entropies"):
        token_grpo_loss(LOGPS, BEHAVIOUR, REF, MASK, ADVANTAGES, spec)


def test_without_tis_the_mismatch_is_still_measured():
    out = loss(LossSpec(kind="dapo"))
    assert out.logp_diff == pytest.approx(1 / 3, abs=1e-5) and out.is_weight == pytest.approx(1.0)


def test_dapo_averages_every_token_of_the_batch():
    out = loss(LossSpec(kind="dapo", kl_coeff=0.1))
    assert out.policy_loss == pytest.approx(sum(POLICY) / 3, abs=1e-5)
    assert out.kl == pytest.approx(sum(KL) / 3, abs=1e-5)
    assert float(out.loss) == pytest.approx((sum(POLICY) + 0.1 * sum(KL)) / 3, abs=1e-5)
    assert out.clip_fraction == pytest.approx(2 / 3) and out.dual_clip_fraction == 0


def test_grpo_averages_each_completion_then_the_completions():
    out = loss(LossSpec(kind="grpo", kl_coeff=0.1))
    first = (POLICY[0] + POLICY[1] + 0.1 * (KL[0] + KL[1])) / 2
    second = POLICY[2] + 0.1 * KL[2]
    assert float(out.loss) == pytest.approx((first + second) / 2, abs=1e-5)
    assert out.policy_loss == pytest.approx(sum(POLICY) / 3, abs=1e-5), "figures stay token means"


def test_cispo_weighs_the_policy_gradient_by_the_capped_ratio_and_never_zeroes_it():
    # ratios e^0.5 (capped at 1.5), 1, e^-0.5; each term -w A log pi with w = min(ratio, 1.5) held constant;
    # the dual clip (on by default) has no clipped branch to bound here
    logps = LOGPS.clone()
    logps[1, 1] = float("-inf")  # a masked position's log-prob, whatever it holds, reaches neither loss nor gradient
    logps.requires_grad_(True)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="cispo", clip_high=1.5))
    w = [1.5, 1.0, math.exp(-0.5)]
    assert out.policy_loss == pytest.approx((-w[0] * -0.5 - w[1] * -1.0 + w[2] * -1.5) / 3, abs=1e-5)
    assert out.clip_fraction == pytest.approx(1 / 3) and out.dual_clip_fraction == 0
    out.loss.backward()
    # token 1's ratio is past the cap, yet its gradient is -1.5 A / 3, where the clipped objective's is 0
    expected = torch.tensor([[-w[0], -w[1]], [w[2], 0.0]]) / 3
    assert torch.allclose(logps.grad, expected, atol=1e-6)


def test_sapo_gates_the_ratio_softly_with_a_temperature_per_advantage_sign():
    # ratios e^0.5, 1 (A = 1, tau 1) | e^-0.5 (A = -1, tau 1.05); grpo's weights 1/4, 1/4 | 1/2
    logps = LOGPS.clone().requires_grad_(True)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="sapo"))
    rho, tau, adv = [math.exp(0.5), 1.0, math.exp(-0.5)], [1.0, 1.0, 1.05], [1.0, 1.0, -1.0]
    gate = [1 / (1 + math.exp(-t * (r - 1))) for r, t in zip(rho, tau, strict=True)]
    terms = [-4 / t * g * a for t, g, a in zip(tau, gate, adv, strict=True)]
    assert float(out.loss.detach()) == pytest.approx(terms[0] / 4 + terms[1] / 4 + terms[2] / 2, abs=1e-6)
    assert out.policy_loss == pytest.approx(sum(terms) / 3, abs=1e-5)
    assert out.clip_fraction == 0 and out.dual_clip_fraction == 0, "a soft gate clips nothing"
    out.loss.backward()
    # d/dlogp = -4 g (1 - g) rho A: the unclipped surrogate's -rho A scaled by 4 g (1 - g), 1 at rho = 1 only
    grad = [-4 * g * (1 - g) * r * a for g, r, a in zip(gate, rho, adv, strict=True)]
    expected = torch.tensor([[grad[0] / 4, grad[1] / 4], [grad[2] / 2, 0.0]])
    assert torch.allclose(logps.grad, expected, atol=1e-6)
    assert grad[1] == pytest.approx(-1.0) and abs(grad[0]) < rho[0], "on-policy: the policy gradient; off it, less"


def test_luspo_is_gspo_with_each_completion_weighted_by_its_length():
    # sequence ratios e^0.25 (A = 1: clipped at 1.2, both tokens -1.2) | e^-0.5 (A = -1: clipped at 0.8); a token's
    # term over N = 2 completions, so a completion counts its length times: (-1.2 - 1.2 + 0.8) / 2
    logps = LOGPS.clone().requires_grad_(True)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="luspo", level="sequence"))
    assert float(out.loss.detach()) == pytest.approx(-0.8, abs=1e-6)
    gspo = token_grpo_loss(LOGPS, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="grpo", level="sequence"))
    assert float(gspo.loss) == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6), "GSPO: each completion's mean"
    assert out.clip_fraction == pytest.approx(1.0)
    with pytest.raises(ValueError, match="needs the sequence level"):
        token_grpo_loss(LOGPS, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="luspo"))


def _vespo_weight(log_w: float, positive: bool) -> float:
    k, lam = (2.0, 3.0) if positive else (3.0, 2.0)
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_weighs_the_policy_gradient_by_a_gamma_function_of_the_completions_ratio():
    # log w = the sum of a completion's log-ratios: 0.5 + 0 (A = 1) | -0.5 (A = -1); -phi A log pi, over 3 tokens
    logps = LOGPS.clone().requires_grad_(True)
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="vespo"))
    phi = [_vespo_weight(0.5, True), _vespo_weight(-0.5, False)]
    terms = [phi[0] * 0.5, phi[0] * 1.0, -phi[1] * 1.5]
    assert float(out.loss.detach()) == pytest.approx(sum(terms) / 3, abs=1e-6)
    out.loss.backward()
    expected = torch.tensor([[-phi[0], -phi[0]], [phi[1], 0.0]]) / 3
    assert torch.allclose(logps.grad, expected, atol=1e-6)
    assert _vespo_weight(0.0, True) == pytest.approx(1.0) == _vespo_weight(0.0, False), "phi(1) = 1"
    assert out.clip_fraction == 0 and out.dual_clip_fraction == 0
    assert out.vespo_weight == pytest.approx((2 * phi[0] + phi[1]) / 3, abs=1e-6), "phi's token mean"
    with pytest.raises(ValueError, match="leave the level at token"):
        token_grpo_loss(LOGPS, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kind="vespo", level="sequence"))


@pytest.mark.parametrize(
    "mode, cap, log_w",
    [("token_truncate", 2.0, 0.5), ("sequence_truncate", 2.0, 0.5), ("token_truncate", 1.5, math.log(1.5))],
)
def test_vespos_weight_takes_in_the_importance_weights_instead_of_being_multiplied_by_them(mode, cap, log_w):
    """With importance weights the ratio is to the trainer's own log-probs (1 in value) and the weights pi/mu join
    w in log space (TRL's VESPO): bounded at cap 2 they are the whole ratio, so the loss is the one without them; a
    cap of 1.5 truncates the first token's e^0.5, and the completion's w with it."""
    logps = LOGPS.clone().requires_grad_(True)
    spec = LossSpec(kind="vespo", is_cap=cap, is_mode=mode)  # type: ignore[arg-type]
    out = token_grpo_loss(logps, BEHAVIOUR, None, MASK, ADVANTAGES, spec)
    phi = [_vespo_weight(log_w, True), _vespo_weight(-0.5, False)]
    assert float(out.loss.detach()) == pytest.approx((phi[0] * 1.5 - phi[1] * 1.5) / 3, abs=1e-6)
    out.loss.backward()
    assert torch.allclose(logps.grad, torch.tensor([[-phi[0], -phi[0]], [phi[1], 0.0]]) / 3, atol=1e-6)


def test_vespos_weight_of_a_wild_ratio_is_zero_not_nan():
    logps = torch.tensor([[30.0, 30.0], [-40.0, 0.0]], requires_grad=True)  # log w 40 (capped at 20) | -39
    out = token_grpo_loss(logps, torch.zeros(2, 2), None, MASK, ADVANTAGES, LossSpec(kind="vespo"))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logps.grad).all()
    assert float(logps.grad.abs().max()) < 1e-6, "w = e^20 and e^-18.4: both weigh (almost) nothing"


@pytest.mark.parametrize("delta", [1.2, 1.5, 2.5])
def test_trls_two_sided_delta_is_the_dual_clip(delta):
    """TRL's ``delta`` (INTELLECT-2): -min(min(rho, delta) A, clip(rho) A); equal to ``dual_clip=delta`` in value
    and gradient for every ratio and advantage sign, for any delta from 1 + eps up."""
    torch.manual_seed(0)
    behaviour = torch.randn(8, 6)
    start = behaviour + torch.randn(8, 6)  # ratios from e^-3 to e^3: below, inside and past both bounds
    advantages = torch.randn(8)
    mask = torch.ones(8, 6)
    eps = 0.2
    ours = start.clone().requires_grad_(True)
    out = token_grpo_loss(ours, behaviour, None, mask, advantages, LossSpec(kind="dapo", dual_clip=delta))
    out.loss.backward()
    theirs = start.clone().requires_grad_(True)
    coef = (theirs - behaviour).exp()
    a = advantages.unsqueeze(1)
    trl = -torch.minimum(coef.clamp(max=delta) * a, coef.clamp(1 - eps, 1 + eps) * a)
    (trl.sum() / mask.sum()).backward()
    assert float(out.loss.detach()) == pytest.approx(float(trl.detach().sum() / mask.sum()), abs=1e-6)
    assert out.dual_clip_fraction > 0, "some negative-advantage ratios pass delta"
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-7)


@pytest.mark.parametrize("threshold, dropped", [(0.4, True), (0.6, False)])
def test_the_off_policy_mask_drops_negative_advantage_completions_that_drifted(threshold, dropped):
    # mean log mu - log pi: row 0 (A = 1) (-0.5 + 0) / 2; row 1 (A = -1) 0.5: dropped when the threshold is below 0.5
    out = loss(LossSpec(kind="dapo", kl_coeff=0.1, off_policy_mask=threshold))
    policy = POLICY[:2] + ([0.0] if dropped else POLICY[2:])
    assert out.policy_loss == pytest.approx(sum(policy) / 3, abs=1e-5)
    assert out.off_policy_masked == pytest.approx(1 / 3 if dropped else 0.0)
    assert out.kl == pytest.approx(sum(KL) / 3, abs=1e-5), "the KL term keeps every token"
    # a positive advantage is never dropped, however far its completion drifted
    flipped = token_grpo_loss(LOGPS, BEHAVIOUR, REF, MASK, -ADVANTAGES, LossSpec(kind="dapo", off_policy_mask=-1.0))
    assert flipped.off_policy_masked == pytest.approx(2 / 3), "row 0 (now A = -1, drift -0.25 > -1) only"


@pytest.mark.parametrize("is_cap", [0.0, 10.0], ids=["ratio-to-behaviour", "importance-weights"])
def test_the_off_policy_mask_takes_a_completions_mean_drift_from_the_behaviour_and_keeps_its_kl(is_cap):
    # drifts log mu - log pi per token, threshold 0.5: row a (A < 0) 0.9, 0, 0 (sum 0.9, mean 0.3: kept); row b
    # (A < 0) 0.75, 0.25 (mean 0.5, at the threshold: kept); row c (A < 0) 1, 0.5 (mean 0.75: dropped); row d
    # (A > 0) 2, 2 (kept). Under importance weights the ratio's anchor is the trainer itself; the drift is not.
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    drift = torch.tensor([[0.9, 0, 0], [0.75, 0.25, 0], [1.0, 0.5, 0], [2.0, 2.0, 0]])
    logps = torch.full((4, 3), -1.0, requires_grad=True)
    behaviour, ref = -1.0 + drift, torch.full((4, 3), -1.5)
    advantages = torch.tensor([-1.0, -1.0, -1.0, 1.0])
    spec = LossSpec(kind="dapo", kl_coeff=0.1, off_policy_mask=0.5, is_cap=is_cap, dual_clip=0)
    out = token_grpo_loss(logps, behaviour, ref, mask, advantages, spec)
    assert out.off_policy_masked == pytest.approx(2 / 9)
    out.loss.backward()
    kl_gradient = 0.1 * (1 - math.exp(-0.5)) / 9  # d/dlogp of beta (e^d - d - 1), d = ref - logp = -0.5
    dropped = logps.grad[2, :2]
    assert torch.allclose(dropped, torch.full((2,), kl_gradient), atol=1e-7), "only the KL term's gradient is left"
    # the loss without the mask is more by row c's policy terms exactly, so rows a, b and d kept theirs; row c's
    # terms (A = -1): the clipped 0.8 for ratios e^-1 and e^-0.5, or the weights themselves under importance weights
    unmasked = token_grpo_loss(logps, behaviour, ref, mask, advantages, dataclasses.replace(spec, off_policy_mask=None))
    row_c = [0.8, 0.8] if is_cap == 0 else [math.exp(-1.0), math.exp(-0.5)]
    assert float(unmasked.loss.detach() - out.loss.detach()) == pytest.approx(sum(row_c) / 9, abs=1e-6)


def test_the_bias_corrected_kl_is_weighted_by_the_ratio_with_its_gradient():
    ratio = [math.exp(0.5), 1.0, math.exp(-0.5)]
    logps = LOGPS.clone().requires_grad_(True)
    spec = LossSpec(kind="dapo", kl_coeff=1.0, kl_is_weighted=True)
    out = token_grpo_loss(logps, BEHAVIOUR, REF, MASK, ADVANTAGES, spec)
    assert out.kl == pytest.approx(sum(k * r for k, r in zip(KL, ratio, strict=True)) / 3, abs=1e-6)
    out.loss.backward()
    plain = LOGPS.clone().requires_grad_(True)
    token_grpo_loss(plain, BEHAVIOUR, None, MASK, ADVANTAGES, spec).loss.backward()
    # d/dlogp [rho (e^d - d - 1)] with d = ref - logp: rho (e^d - d - 1) + rho (1 - e^d)
    d = [-0.5, 0.0, 0.5]
    kl_grad = [r * (math.exp(x) - x - 1) + r * (1 - math.exp(x)) for r, x in zip(ratio, d, strict=True)]
    expected = plain.grad + torch.tensor([[kl_grad[0], kl_grad[1]], [kl_grad[2], 0.0]]) / 3
    assert torch.allclose(logps.grad, expected, atol=1e-6)


def test_dr_grpo_divides_by_a_constant():
    out = loss(LossSpec(kind="dr_grpo", kl_coeff=0.1, max_length=4))
    assert float(out.loss) == pytest.approx((sum(POLICY) + 0.1 * sum(KL)) / (2 * 4), abs=1e-5)
    no_limit = loss(LossSpec(kind="dr_grpo", kl_coeff=0.1))  # L defaults to the mask's width, 2
    assert float(no_limit.loss) == pytest.approx((sum(POLICY) + 0.1 * sum(KL)) / (2 * 2), abs=1e-5)


def test_clip_higher_raises_only_the_upper_bound():
    out = loss(LossSpec(kind="dapo", clip_high=0.28))
    assert out.policy_loss == pytest.approx((-1.28 - 1.0 + 0.8) / 3, abs=1e-5)


def test_dual_clip_bounds_a_negative_advantage_with_a_large_ratio():
    logps = torch.tensor([[math.log(5.0) - 1.0]], requires_grad=True)  # ratio 5 against behaviour -1
    behaviour, ref, mask, advantage = torch.tensor([[-1.0]]), None, torch.ones(1, 1), torch.tensor([-1.0])
    free = token_grpo_loss(logps, behaviour, ref, mask, advantage, LossSpec(dual_clip=0))
    assert float(free.loss.detach()) == pytest.approx(5.0, abs=1e-5), "unbounded: -ratio * A"
    held = token_grpo_loss(logps, behaviour, ref, mask, advantage, LossSpec(dual_clip=3.0))
    assert float(held.loss.detach()) == pytest.approx(3.0, abs=1e-5) and held.dual_clip_fraction == 1.0
    held.loss.backward()  # type: ignore[no-untyped-call]
    assert logps.grad is not None and float(logps.grad) == 0.0, "the capped term is flat"
    positive = token_grpo_loss(logps, behaviour, ref, mask, -advantage, LossSpec(dual_clip=3.0))
    assert float(positive.loss.detach()) == pytest.approx(-1.2, abs=1e-5), "a positive advantage is never dual-clipped"


def test_no_reference_means_no_kl_term():
    out = token_grpo_loss(LOGPS, BEHAVIOUR, None, MASK, ADVANTAGES, LossSpec(kl_coeff=0.5))
    assert out.kl == 0 and float(out.loss) == pytest.approx(sum(POLICY) / 3, abs=1e-5)


@pytest.mark.parametrize(
    "scale, expected",
    [
        ("group", [1.0, -1.0, 0.0, 0.0]),
        ("none", [0.5, -0.5, 0.0, 0.0]),
        ("batch", [0.5 / math.sqrt(5.1875), -0.5 / math.sqrt(5.1875), 0.0, 0.0]),  # population std of 1, 0, 5, 5
    ],
)
def test_reward_scaling(scale, expected):
    advantages = group_advantages(torch.tensor([1.0, 0.0, 5.0, 5.0]), group=2, scale=scale)
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=5e-4, rtol=0)  # (the std's 1e-4 guard)


def test_a_completion_no_reward_function_scored_is_left_out_of_its_group_and_gets_no_advantage():
    """TRL's rule: a NaN reward (every function returned None) is out of its group's mean and std and its
    advantage is 0; counted as 0 it would push that completion down and lift its siblings for nothing."""
    nan = math.nan
    rewards = torch.tensor([1.0, 1.0, 1.0, nan, 0.0, 2.0, nan, nan])
    for scale in ("group", "batch", "none"):
        advantages = group_advantages(rewards, group=4, scale=scale)
        assert not advantages.isnan().any()
        assert advantages[:4].tolist() == [0.0] * 4, scale  # the scored three are equal: nothing to teach
        assert advantages[6:].tolist() == [0.0, 0.0]
        assert advantages[4] == -advantages[5] != 0
    torch.testing.assert_close(group_advantages(rewards, 4)[4:6], torch.tensor([-1.0, 1.0]), atol=5e-4, rtol=0)
    torch.testing.assert_close(group_advantages(torch.full((4,), nan), 4), torch.zeros(4))  # a group all unscored
    std, zero = group_spread(rewards, 4)
    assert std == pytest.approx(0.5) and zero == 0.5


def test_group_spread_is_the_mean_within_group_std_and_the_share_of_groups_that_teach_nothing():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0, 0.3, 0.3, 2.0, 0.0])
    std, zero = group_spread(rewards, 2)
    assert std == pytest.approx((0.5 + 0 + 0 + 1.0) / 4) and zero == 0.5
    assert group_spread(rewards, 4) == (pytest.approx((math.sqrt(5.1875) + math.sqrt(0.6225)) / 2), 0.0)


def test_a_group_whose_rewards_nearly_tie_gets_advantages_near_0():
    """The guard under the std is TRL's 1e-4: with 1e-6, rewards 1e-5 apart (a reward model's float noise) got
    advantages near ±0.83, as if one completion were clearly better."""
    advantages = group_advantages(torch.tensor([0.0, 1e-5, 0.0, 1e-5]), group=4)
    assert advantages.abs().max() < 0.1


def test_padding_cannot_make_nan_whatever_it_holds():
    """Padded positions with huge log-ratio and KL exponents: excluded before exp, so no inf * 0."""
    mask = torch.tensor([[1.0, 0.0]])
    logps = torch.tensor([[-0.5, -1000.0]], requires_grad=True)
    behaviour = torch.tensor([[-0.5, -2000.0]])  # exp(1000) at the pad
    ref = torch.tensor([[-0.5, 0.0]])  # exp(1000) at the pad again
    out = token_grpo_loss(logps, behaviour, ref, mask, torch.tensor([1.0]), LossSpec(kl_coeff=0.1, dual_clip=0))
    out.loss.backward()  # type: ignore[no-untyped-call]
    assert math.isfinite(float(out.loss.detach())) and math.isfinite(out.kl) and math.isfinite(out.policy_loss)
    assert logps.grad is not None and torch.isfinite(logps.grad).all() and logps.grad[0, 1] == 0


def test_weights_of_each_variant_sum_as_their_normalisers_say():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert float(token_weights(mask, "dapo").sum()) == pytest.approx(1.0)
    assert float(token_weights(mask, "grpo").sum()) == pytest.approx(2 / 3), "an empty completion counts as 0"
    assert float(token_weights(mask, "dr_grpo", 6).sum()) == pytest.approx(4 / 18)


def _task(**settings) -> tuple[DigitsTask, torch.nn.Module, TokenBatch, torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    task = DigitsTask(resolve(Config(digits=3, prompts=6, group=4, eval_size=16, **settings)))
    torch.manual_seed(0)
    net = task.build_policy()
    batch = task.sample(net, torch.Generator().manual_seed(0))
    rewards = task.score(None, batch).rewards
    ref = task.reference_logps(net, batch) - 0.05  # not the policy itself, so the KL term has a gradient
    return task, net, batch, rewards, ref


def _gradient(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    "settings",
    [
        {"loss": "grpo"},
        {"loss": "dr_grpo"},
        {"loss": "dapo"},
        {"loss": "dapo", "importance_sampling_level": "sequence"},
        {"loss": "cispo", "epsilon_high": 1.05},
        {"loss": "sapo", "sapo_temperature_neg": 2.0},
        {"loss": "luspo", "importance_sampling_level": "sequence"},
        {"loss": "vespo", "vespo_lambda_pos": 1.5},
        {"loss": "vespo", "is_correction": "token_mask", "is_cap": 1.05},
        {"loss": "dapo", "is_correction": "sequence_mask", "is_cap": 1.2, "is_min": 0.8},
        {"loss": "dapo", "off_policy_mask_threshold": 0.02, "use_bias_correction_kl": True},
    ],
    ids=[
        "grpo",
        "dr_grpo",
        "dapo",
        "gspo",
        "cispo",
        "sapo",
        "luspo",
        "vespo",
        "vespo-token-mask",
        "sequence-mask",
        "off-policy-mask-and-bias-corrected-kl",
    ],
)
def test_micro_batches_accumulate_the_whole_batchs_gradient(settings):
    task, net, batch, rewards, ref = _task(**settings, micro_batch=5, mask_truncated=True)
    if settings != {"loss": "dapo"}:  # behaviour log-probs off the policy's, so the ratios are not 1
        batch = dataclasses.replace(batch, logps=batch.logps + 0.2 * (torch.rand(batch.logps.shape) - 0.5))
    whole = task.loss(net, batch, rewards, ref)
    whole.loss.backward()  # type: ignore[no-untyped-call]
    expected = _gradient(net)
    net.zero_grad()
    parts = task.micro_batches(batch, 5)
    assert len(parts) == 5, "24 samples in micro-batches of 5"
    total = None
    for rows in parts:
        report = task.loss(net, batch, rewards, ref, rows)
        report.loss.backward()  # type: ignore[no-untyped-call]
        total = report if total is None else total.add(report)
    assert total is not None
    torch.testing.assert_close(_gradient(net), expected, atol=1e-6, rtol=0)
    assert float(total.loss) == pytest.approx(float(whole.loss.detach()), abs=1e-6)
    for name in (
        "policy_loss",
        "kl",
        "clip_fraction",
        "entropy",
        "off_policy_masked",
        "is_weight",
        "is_truncated",
        "vespo_weight",
    ):
        assert getattr(total, name) == pytest.approx(getattr(whole, name), abs=1e-6), name
    if "off_policy_mask_threshold" in settings:
        assert 0 < whole.off_policy_masked < 1, "the drift puts some completions past the threshold, not all"
    if "is_correction" in settings:
        assert 0 < whole.is_truncated < 1, "some completions' weights fall outside the bounds, not all"
    if settings["loss"] == "cispo":
        assert 0 < whole.clip_fraction < 1, "some ratios pass the cap"


@pytest.mark.parametrize(
    "settings",
    [
        {"loss": "dapo"},
        {"loss": "grpo"},
        {"loss": "dr_grpo"},
        {"loss": "cispo"},
        {"loss": "vespo"},
        {"loss": "luspo", "importance_sampling_level": "sequence"},
    ],
    ids=["dapo", "grpo", "dr_grpo", "cispo", "vespo", "luspo"],
)
def test_a_mini_batchs_loss_is_its_own_rows_with_the_whole_rollouts_advantages(settings):
    """--mini-batches: the loss of rows 0-11 of 24 is token_grpo_loss on those rows alone (their own normaliser,
    whatever it counts) with the advantages of the whole rollout; micro-batches of it add up to it."""
    task, net, batch, rewards, ref = _task(**settings)
    half = slice(0, 12)
    advantages = group_advantages(rewards, 4)
    logps, entropy = completion_logps(net, batch.tokens[half], batch.prompts.shape[1])
    direct = token_grpo_loss(
        logps,
        batch.logps[half],
        ref[half],
        batch.mask[half],
        advantages[half],
        loss_spec(task.config, 5),
        entropy=entropy.detach(),
    )
    mine = task.loss(net, batch, rewards, ref, half, batch=half)
    assert float(mine.loss.detach()) == pytest.approx(float(direct.loss.detach()), abs=1e-6)
    assert mine.kl == pytest.approx(direct.kl, abs=1e-6) and mine.entropy == pytest.approx(direct.entropy, abs=1e-6)
    mine.loss.backward()  # type: ignore[no-untyped-call]
    expected = _gradient(net)
    net.zero_grad()
    for rows in (slice(0, 5), slice(5, 12)):
        task.loss(net, batch, rewards, ref, rows, batch=half).loss.backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(_gradient(net), expected, atol=1e-6, rtol=0)
    whole = task.loss(net, batch, rewards, ref, half)
    assert float(whole.loss.detach()) == pytest.approx(float(mine.loss.detach()) / 2, rel=0.2), "a share of 24 rows"


def test_mini_batches_take_one_optimiser_step_on_each_part():
    """K = 2: two optimiser steps a rollout, rows 0-11 then 12-23, each its own loss (as above): the same weights
    as stepping on those losses by hand; the schedule counts both; the report is their mean, the mismatch the
    first's; micro-batches inside a mini-batch change nothing."""
    task, _, batch, rewards, ref = _task(mini_batches=2, lr=1e-2, max_grad_norm=0)
    learner = Learner(task, torch.device("cpu"))
    update = learner.update(batch, rewards, ref)
    assert learner.schedule.last_epoch == 2
    by_hand = Learner(task, torch.device("cpu"))
    losses = []
    for part in (slice(0, 12), slice(12, 24)):
        by_hand.optim.zero_grad()
        report = task.loss(by_hand.policy, batch, rewards, ref, part, batch=part)
        report.loss.backward()  # type: ignore[no-untyped-call]
        by_hand.optim.step()
        losses.append(report)
    for mine, theirs in zip(learner.policy.parameters(), by_hand.policy.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert float(update.report.loss) == pytest.approx(sum(float(r.loss.detach()) for r in losses) / 2, abs=1e-6)
    assert update.report.logp_diff == pytest.approx(losses[0].logp_diff, abs=1e-7)
    micro = Learner(_task(mini_batches=2, lr=1e-2, max_grad_norm=0, micro_batch=5)[0], torch.device("cpu"))
    assert micro._passes(batch, slice(12, 24)) == [slice(12, 17), slice(17, 22), slice(22, 24)]
    in_passes = micro.update(batch, rewards, ref)  # (Adam's steps would magnify the passes' rounding: the figures)
    assert in_passes.grad_norm == pytest.approx(update.grad_norm, rel=1e-4)
    assert float(in_passes.report.loss) == pytest.approx(float(update.report.loss), abs=1e-5)
    both = Learner(_task(mini_batches=2, num_iterations=2, lr=1e-2, max_grad_norm=0)[0], torch.device("cpu"))
    both.update(batch, rewards, ref)
    for part in (slice(0, 12), slice(12, 24)):  # the second iteration, by hand: each part again, in turn
        by_hand.optim.zero_grad()
        task.loss(by_hand.policy, batch, rewards, ref, part, batch=part).loss.backward()  # type: ignore[no-untyped-call]
        by_hand.optim.step()
    assert both.schedule.last_epoch == 4
    for mine, theirs in zip(both.policy.parameters(), by_hand.policy.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    stretched = lr_factor(Config(steps=10, warmup_steps=2, num_iterations=2, mini_batches=2))  # 8 of 40 steps
    assert [stretched(s) for s in (0, 3, 7, 8)] == [0.125, 0.5, 1.0, 1.0]


def test_a_task_whose_loss_takes_no_batch_is_refused_mini_batches_by_name():
    task = _task(mini_batches=2)[0]

    class Old(DigitsTask):
        def loss(self, policy, samples, rewards, ref_logps, rows=None):  # type: ignore[no-untyped-def,override]
            return super().loss(policy, samples, rewards, ref_logps, rows)

    Learner(Old(dataclasses.replace(task.config, mini_batches=1)), torch.device("cpu"))  # one step a rollout: fine
    with pytest.raises(ValueError, match=r"--mini-batches 2: Old\.loss takes no batch="):
        Learner(Old(task.config), torch.device("cpu"))


def test_the_learner_steps_in_micro_batches_as_in_one():
    updates = []
    for micro in (0, 7):
        task, _, batch, rewards, ref = _task(micro_batch=micro, lr=1e-2)
        learner = Learner(task, torch.device("cpu"))
        updates.append((learner.update(batch, rewards, ref), _gradient(learner.policy)))
    (whole, whole_gradient), (parts, parts_gradient) = updates
    assert parts.grad_norm == pytest.approx(whole.grad_norm, abs=1e-6)
    torch.testing.assert_close(parts_gradient, whole_gradient, atol=1e-6, rtol=0)
    assert float(parts.report.loss) == pytest.approx(float(whole.report.loss), abs=1e-6)


def test_num_iterations_takes_that_many_optimiser_steps_on_one_rollout():
    """μ = 3 is three optimiser steps on the same rollout, each ratio to the behaviour log-probs: the same as three
    updates of μ = 1; the report holds their means, and the first's mismatch (before the rollout's update)."""
    task, _, batch, rewards, ref = _task(lr=1e-2, num_iterations=3)
    learner = Learner(task, torch.device("cpu"))
    update = learner.update(batch, rewards, ref)
    once = Learner(_task(lr=1e-2)[0], torch.device("cpu"))
    singles = [once.update(batch, rewards, ref) for _ in range(3)]
    for mine, theirs in zip(learner.policy.parameters(), once.policy.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    assert learner.schedule.last_epoch == 3 and once.schedule.last_epoch == 3
    assert singles[2].report.logp_diff > singles[0].report.logp_diff, "the later steps' policy moved off"
    assert update.report.logp_diff == pytest.approx(singles[0].report.logp_diff, abs=1e-7)
    assert update.grad_norm == pytest.approx(sum(s.grad_norm for s in singles) / 3, rel=1e-5)
    for name in ("policy_loss", "clip_fraction", "entropy"):
        want = sum(getattr(s.report, name) for s in singles) / 3
        assert getattr(update.report, name) == pytest.approx(want, abs=1e-6), name
    assert float(update.report.loss) == pytest.approx(sum(float(s.report.loss) for s in singles) / 3, abs=1e-6)
    stretched = lr_factor(Config(steps=10, warmup_steps=2, num_iterations=2))  # counted in rollouts: 4 of 20
    assert [stretched(s) for s in (0, 1, 3, 19)] == [0.25, 0.5, 1.0, 1.0]


def test_mixing_the_reference_takes_alpha_of_the_policy_and_the_one_process_run_syncs_it(monkeypatch):
    task, _, batch, rewards, ref = _task(lr=1e-2)
    learner = Learner(task, torch.device("cpu"))
    learner.update(batch, rewards, ref)
    before = {name: value.clone() for name, value in learner.reference_state.items()}
    policy = learner.policy.state_dict()
    learner.mix_reference(0.6)
    for name, value in learner.reference_state.items():
        torch.testing.assert_close(value, 0.6 * policy[name] + 0.4 * before[name], atol=1e-6, rtol=0)
    assert any(not torch.equal(value, before[name]) for name, value in learner.reference_state.items())
    mixes: list[float] = []
    mix = Learner.mix_reference
    monkeypatch.setattr(Learner, "mix_reference", lambda self, alpha: mixes.append(alpha) or mix(self, alpha))
    loaded: list[int] = []
    load = torch.nn.Module.load_state_dict
    monkeypatch.setattr(
        torch.nn.Module, "load_state_dict", lambda self, *a, **k: loaded.append(1) or load(self, *a, **k)
    )
    settings = {"steps": 4, "target_score": None, "eval_every": 4, "sync_ref_model": True, "ref_model_sync_steps": 2}
    assert train_one_process(dataclasses.replace(task.config, **settings)).steps == 4
    assert mixes == [0.6, 0.6], "synced at steps 2 and 4"
    assert len(loaded) == 3, "the reference model loads its weights when built and at each sync"


def test_mask_truncated_takes_cut_off_completions_out_of_the_loss():
    task, net, batch, rewards, ref = _task(mask_truncated=True, max_new_tokens=4)
    truncated = task.truncated(batch)
    assert truncated.any() and not truncated.all(), "the random policy ends some completions in time, not all"
    before = float(task.loss(net, batch, rewards, ref).loss.detach())
    changed = dataclasses.replace(batch, logps=batch.logps - 0.3 * truncated.unsqueeze(1).float())
    assert float(task.loss(net, changed, rewards, ref).loss.detach()) == pytest.approx(before, abs=1e-7)
    task.config = dataclasses.replace(task.config, mask_truncated=False)
    assert float(task.loss(net, changed, rewards, ref).loss.detach()) != pytest.approx(before, abs=1e-4), (
        "without the flag they train"
    )


def test_truncated_means_no_eos_within_the_limit():
    prompts = torch.tensor([[11, 1, 2, 12]] * 3)
    tokens = torch.cat([prompts, torch.tensor([[1, 2, EOS], [1, 2, 3], [EOS, PAD, PAD]])], dim=1)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    batch = TokenBatch(prompts, tokens, torch.zeros(3, 3), mask, group=3)
    assert DigitsTask.truncated(batch).tolist() == [False, True, False]


@pytest.mark.parametrize(
    "sampling",
    [
        *({"top_p": top_p, "temperature": temperature} for top_p in (0.3, 0.7, 0.9, 1.0) for temperature in (0.7, 1.0)),
        {"top_k": 3, "temperature": 0.7},
        {"min_p": 0.2, "temperature": 0.7},
        {"top_k": 4, "top_p": 0.9, "min_p": 0.1, "temperature": 1.0},
        {"repetition_penalty": 1.5, "temperature": 0.7},
    ],
)
def test_the_ratio_is_one_at_lag_zero_whatever_the_sampling(sampling):
    """The generator's behaviour log-probs are the trainer's log-probs of the same policy."""
    temperature = sampling["temperature"]
    task = DigitsTask(resolve(Config(digits=4, prompts=16, group=8, **sampling)))
    torch.manual_seed(1)
    net = task.build_policy().eval()
    with torch.no_grad():
        for p in net.parameters():  # a sharper policy than the initial one: the nucleus then cuts
            p.mul_(4.0)
    batch = task.sample(net, torch.Generator().manual_seed(2))
    logps, _ = completion_logps(net, batch.tokens, batch.prompts.shape[1], temperature)  # type: ignore[arg-type]
    ratio = torch.where(batch.mask > 0, (logps - batch.logps).exp(), torch.ones_like(logps))
    assert (ratio - 1).abs().max() < 1e-5


def test_gradients_are_clipped_and_the_norm_before_is_reported():
    task, _, batch, rewards, ref = _task(max_grad_norm=1e-3)
    learner = Learner(task, torch.device("cpu"))
    update = learner.update(batch, rewards, ref)
    after = float(torch.linalg.vector_norm(_gradient(learner.policy)))
    assert update.grad_norm > 1e-2 and after == pytest.approx(1e-3, rel=1e-3)
    unclipped = Learner(_task(max_grad_norm=0)[0], torch.device("cpu"))
    assert unclipped.update(batch, rewards, ref).grad_norm == pytest.approx(update.grad_norm, rel=1e-5)
    assert float(torch.linalg.vector_norm(_gradient(unclipped.policy))) == pytest.approx(update.grad_norm, rel=1e-5)


def test_learning_rate_schedules():
    cosine = lr_factor(Config(steps=10, warmup_steps=2, lr_schedule="cosine"))
    assert [round(cosine(s), 4) for s in range(11)] == [
        0.5,
        1.0,
        1.0,
        round(0.5 * (1 + math.cos(math.pi / 8)), 4),
        round(0.5 * (1 + math.cos(math.pi * 2 / 8)), 4),
        round(0.5 * (1 + math.cos(math.pi * 3 / 8)), 4),
        0.5,
        round(0.5 * (1 + math.cos(math.pi * 5 / 8)), 4),
        round(0.5 * (1 + math.cos(math.pi * 6 / 8)), 4),
        round(0.5 * (1 + math.cos(math.pi * 7 / 8)), 4),
        0.0,
    ]
    constant = lr_factor(Config(steps=10, warmup_steps=4))
    assert [constant(s) for s in (0, 1, 3, 4, 9)] == [0.25, 0.5, 1.0, 1.0, 1.0]
    task, _, batch, rewards, ref = _task(lr=1e-2, steps=4, lr_schedule="cosine", warmup_steps=1)
    learner = Learner(task, torch.device("cpu"))
    lrs = [learner.update(batch, rewards, ref).lr for _ in range(4)]
    assert lrs == pytest.approx([1e-2, 1e-2, 0.75e-2, 0.25e-2], abs=1e-9), "each step reports the rate it used"
    resumed = Learner(task, torch.device("cpu"))
    resumed.load_state(learner.state())
    assert resumed.optim.param_groups[0]["lr"] == learner.optim.param_groups[0]["lr"], "a checkpoint keeps it"
    # resumed with twice the steps: the optimizer brought the old schedule's last rate (0: the cosine's end), and
    # the first resumed step trained at it; each step follows this run's schedule now
    longer = Learner(_task(lr=1e-2, steps=8, lr_schedule="cosine", warmup_steps=1)[0], torch.device("cpu"))
    longer.load_state(learner.state())
    assert longer.update(batch, rewards, ref).lr == pytest.approx(1e-2 * 0.5 * (1 + math.cos(3 * math.pi / 7)))


def test_bfloat16_trains_under_autocast_and_keeps_float32_weights():
    task, _, batch, rewards, ref = _task(dtype="bfloat16", lr=1e-2)
    learner = Learner(task, torch.device("cpu"))
    before = {name: value.clone() for name, value in learner.policy.state_dict().items()}
    update = learner.update(batch, rewards, ref)
    assert math.isfinite(float(update.report.loss)) and update.grad_norm > 0
    state = learner.policy.state_dict()
    assert all(value.dtype == torch.float32 for value in state.values()), "weights stay (and publish) in float32"
    assert any(not torch.equal(state[name], before[name]) for name in state)


def test_one_process_training_refuses_what_the_pipeline_refuses_and_engines_it_cannot_update():
    """The yardstick checks its settings as the pipeline does; it samples the trainer's own module, so an engine
    holding weights of its own (vLLM, which the pipeline updates by message) is refused, not silently ignored."""
    from pipeline.config import SettingsError

    with pytest.raises(SettingsError, match="--group 1"):
        train_one_process(Config(task="bandit", steps=1, group=1))
    with pytest.raises(SettingsError, match="--engine vllm: the one-process run samples the trainer's own model"):
        train_one_process(Config(task="hf", dataset="p.jsonl", rewards=("exact_match",), engine="vllm"))  # type: ignore[arg-type]


def test_one_process_training_without_a_kl_term_builds_no_reference(monkeypatch):
    def no_reference(self):  # type: ignore[no-untyped-def]
        raise AssertionError("β = 0 must not build a reference model")

    monkeypatch.setattr(Learner, "reference", no_reference)
    result = train_one_process(Config(task="bandit", steps=20, kl_coeff=0.0))
    assert result.steps == 20


def test_every_loss_flag_reaches_the_loss_spec():
    """What the CLI and config say is what the loss computes: each field of the spec from its setting."""
    from pipeline.tasks import loss_spec

    config = Config(
        loss="cispo",
        epsilon_high=3.0,
        off_policy_mask_threshold=0.3,
        use_bias_correction_kl=True,
        sapo_temperature_pos=2.0,
        sapo_temperature_neg=3.0,
        vespo_k_pos=1.0,
        vespo_lambda_pos=2.0,
        vespo_k_neg=4.0,
        vespo_lambda_neg=5.0,
        is_correction="sequence_mask",
        is_cap=4.0,
        is_min=0.5,
        importance_sampling_level="sequence",
        top_entropy_quantile=0.5,
        dual_clip=5.0,
        kl_coeff=0.07,
        clip=0.1,
    )
    assert loss_spec(resolve(config), 9) == LossSpec(
        kind="cispo",
        clip_low=0.1,
        clip_high=3.0,
        dual_clip=5.0,
        kl_coeff=0.07,
        max_length=9,
        is_cap=4.0,
        level="sequence",
        top_entropy=0.5,
        off_policy_mask=0.3,
        kl_is_weighted=True,
        sapo_tau_pos=2.0,
        sapo_tau_neg=3.0,
        vespo_k_pos=1.0,
        vespo_lambda_pos=2.0,
        vespo_k_neg=4.0,
        vespo_lambda_neg=5.0,
        is_mode="sequence_mask",
        is_min=0.5,
    )
    assert loss_spec(resolve(Config(is_correction="tis")), 9).is_mode == "token_truncate"
    assert loss_spec(resolve(Config(is_correction="none", is_cap=4.0)), 9).is_cap == 0, "no weights without one"


def test_bfloat16_casts_each_weight_once_a_step_and_steps_exactly_as_a_cast_each_pass():
    """The passes of one optimiser step share autocast's casts of the weights (they do not change within a step):
    each float32 weight is cast to bfloat16 once a step, not once a pass, and the step is bit for bit the one whose
    passes each cast the weights again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        def __init__(self, weights: set[int]) -> None:
            super().__init__()
            self.weights, self.count = weights, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.weights:
                self.count += kwargs.get("dtype") == torch.bfloat16
            return func(*args, **kwargs)

    task, _, batch, rewards, ref = _task(dtype="bfloat16", lr=1e-2, micro_batch=5)
    learners = {"kept": Learner(task, torch.device("cpu")), "each pass": Learner(task, torch.device("cpu"))}
    learners["each pass"]._casts_kept = contextlib.ExitStack  # type: ignore[method-assign]
    casts, losses = {}, {}
    for name, learner in learners.items():
        assert len(learner._passes(batch, None)) == 5
        weights = {p.data_ptr() for p in learner.policy.parameters() if p.dim() == 2}
        with WeightCasts(weights) as counted:
            losses[name] = float(learner.update(batch, rewards, ref).report.loss)
        casts[name] = counted.count
    assert casts["kept"] > 0 and casts["each pass"] == 5 * casts["kept"], casts
    assert losses["kept"] == losses["each pass"]
    for kept, each in zip(learners["kept"].policy.parameters(), learners["each pass"].policy.parameters(), strict=True):
        assert torch.equal(kept, each)
