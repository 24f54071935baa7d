"""The entropy bonus (TRL's ``entropy_coef``) and Skywork-OR1's adaptive control of its coefficient: the term's value
and gradient on hand-computed batches and through the chunked head, micro-batches adding up, the controller's steps,
the learner's gradient and its checkpoint, the flags and what they refuse."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from pipeline_support import tiny_qwen2

from pipeline import Config, DigitsTask, Learner, resolve
from pipeline.algorithm import EntropyControl, LossSpec, chunked_token_logps, token_grpo_loss, token_logps
from pipeline.config import SettingsError, check_settings
from pipeline.grpo import main, parse_args
from pipeline.tasks import LossReport

MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -1.0])
LOGPS = torch.tensor([[-0.5, -1.0], [-1.5, -7.0]])
# a pad's entropy is huge: it must count nowhere
ENTROPY = torch.tensor([[0.2, 0.9], [0.5, 50.0]])


def _bonus(spec: LossSpec, entropy: torch.Tensor, **kwargs):  # type: ignore[no-untyped-def]
    return token_grpo_loss(LOGPS, LOGPS, None, MASK, ADVANTAGES, spec, entropy=entropy, **kwargs)


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_the_bonus_is_the_mean_entropy_of_the_trained_tokens_whatever_the_loss(kind):
    entropy = ENTROPY.clone().requires_grad_(True)
    out = _bonus(LossSpec(kind=kind), entropy)
    assert out.entropy_bonus is not None
    assert float(out.entropy_bonus.detach()) == pytest.approx((0.2 + 0.9 + 0.5) / 3, abs=1e-6)
    assert out.trained_entropy == pytest.approx((0.2 + 0.9 + 0.5) / 3, abs=1e-6)
    out.entropy_bonus.backward()  # type: ignore[no-untyped-call]
    assert entropy.grad is not None
    torch.testing.assert_close(entropy.grad, torch.tensor([[1 / 3, 1 / 3], [1 / 3, 0.0]]))


def test_a_pads_entropy_that_is_not_finite_counts_nowhere():
    """Padding may hold any number: an infinite or NaN entropy there made ``actor/entropy`` NaN (the figure was the
    entropies times a 0 weight, and inf times 0 is NaN), while the bonus and the trained entropy masked it."""
    for pad in (math.inf, math.nan):
        out = _bonus(LossSpec(), torch.tensor([[0.2, 0.9], [0.5, pad]]))
        assert out.entropy == pytest.approx((0.2 + 0.9 + 0.5) / 3, abs=1e-6)
        assert out.trained_entropy == pytest.approx((0.2 + 0.9 + 0.5) / 3, abs=1e-6)


def test_with_a_top_entropy_share_the_bonus_is_the_mean_over_the_high_entropy_tokens():
    # the top two thirds of 0.2, 0.9, 0.5 are 0.9 and 0.5 (TRL applies the bonus to the same tokens as the policy term)
    out = _bonus(LossSpec(top_entropy=0.6), ENTROPY)
    assert out.trained_entropy == pytest.approx((0.9 + 0.5) / 2, abs=1e-6)
    assert out.entropy == pytest.approx((0.2 + 0.9 + 0.5) / 3, abs=1e-6), "actor/entropy stays every token's mean"


def test_a_micro_batchs_bonus_is_its_share_of_the_batchs():
    whole = _bonus(LossSpec(), ENTROPY)
    parts = [
        token_grpo_loss(
            LOGPS[rows], LOGPS[rows], None, MASK[rows], ADVANTAGES[rows], LossSpec(), entropy=ENTROPY[rows], tokens=3.0
        )
        for rows in (slice(0, 1), slice(1, 2))
    ]
    assert sum(p.trained_entropy for p in parts) == pytest.approx(whole.trained_entropy, abs=1e-6)
    assert parts[0].trained_entropy == pytest.approx((0.2 + 0.9) / 3, abs=1e-6)


def test_the_report_takes_the_bonus_off_its_loss_and_refuses_without_one():
    out = _bonus(LossSpec(kind="dapo"), ENTROPY)
    report = LossReport.of(out).with_entropy_bonus(0.5)
    assert float(report.loss) == pytest.approx(float(out.loss) - 0.5 * (0.2 + 0.9 + 0.5) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="reported no entropy_bonus"):
        LossReport(torch.zeros(()), 0.0, 0.0).with_entropy_bonus(0.5)


@pytest.mark.parametrize("budget", [50 * 7, 50 * 100], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("terms", [(1.0, 0.3), (0.0, 0.3), (1.0, 0.0)], ids=["both", "entropy-only", "logps-only"])
def test_the_chunked_heads_entropy_is_differentiable_when_the_bonus_asks(budget, terms):
    """The written-out backward of the pair equals autograd's on the full logits, whichever outputs the loss uses."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50)
    targets = torch.randint(0, 50, (6, 9), device="cpu")
    weights = torch.randn(6, 9)
    a, b = terms
    full_logps, full_entropy = token_logps(head(hidden), targets, 0.8)
    (a * full_logps * weights + b * full_entropy * weights.flip(0)).sum().backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None

    logps, entropy = chunked_token_logps(hidden, head, targets, 0.8, vocab=50, budget=budget, entropy_grad=True)
    assert entropy.requires_grad
    torch.testing.assert_close(logps, full_logps.detach())
    torch.testing.assert_close(entropy, full_entropy.detach())
    (a * logps * weights + b * entropy * weights.flip(0)).sum().backward()
    for got, want in zip((hidden.grad, head.weight.grad), expected, strict=True):
        torch.testing.assert_close(got, want)
    _, metric = chunked_token_logps(hidden, head, targets, 0.8, vocab=50, budget=budget)
    assert not metric.requires_grad, "without the bonus the entropy is a metric with no graph"


def test_a_hugging_face_policys_entropy_has_the_full_computations_gradient():
    pytest.importorskip("transformers", reason="needs the hf extra")
    from pipeline.models import CompletionLogps

    model = tiny_qwen2(300)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device="cpu")
    tokens = torch.randint(3, 300, (2, 8), device="cpu")
    attention = torch.cat([prompt_mask, torch.ones(2, 5, dtype=torch.long, device="cpu")], 1)[:, :-1]
    logits = model(input_ids=tokens[:, :-1], attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(0))
    _, want = token_logps(logits.logits[:, 2:].float(), tokens[:, 3:], 1.0)
    want.sum().backward()
    expected = model.lm_head.weight.grad.clone()
    model.zero_grad()
    _, entropy = CompletionLogps(model, budget=300 * 3)(tokens, prompt_mask, 1.0, True)  # several chunks
    entropy.sum().backward()
    torch.testing.assert_close(model.lm_head.weight.grad, expected, rtol=1e-4, atol=1e-5)


def test_a_fixed_coefficient_stays_and_zero_needs_no_entropy_gradient():
    fixed = EntropyControl(0.01)
    fixed.observe(0.0)
    assert (fixed.active, fixed.applied(), fixed.coef) == (True, 0.01, 0.01)
    assert not EntropyControl(0.0).active


def test_the_adaptive_coefficient_steps_toward_the_target_within_its_bounds():
    control = EntropyControl(0.0, adaptive=True, target=0.5, delta=0.1, low=0.0, high=0.25)
    assert control.active and control.applied() == 0.0, "no step measured yet: no bonus"
    applied = []
    for entropy in (0.4, 0.3, 0.2, 0.9, 0.6, 0.45):
        control.observe(entropy)
        applied.append(control.applied())
    # up at 0.4, 0.3, 0.2 (0.1, 0.2, then 0.25 the cap), down at 0.9 and 0.6 (0.15, 0.05), up at 0.45 (0.15);
    # applied only after a step at or below the target
    assert applied == pytest.approx([0.1, 0.2, 0.25, 0.0, 0.0, 0.15])
    restored = EntropyControl(0.0, adaptive=True, target=0.5)
    restored.load(control.state())
    assert (restored.coef, restored.last_entropy) == (control.coef, 0.45)
    floor = EntropyControl(0.02, adaptive=True, delta=0.05, low=0.01)
    floor.observe(3.0)
    assert floor.coef == 0.01 and floor.applied() == 0.0


def _task(**settings):  # type: ignore[no-untyped-def]
    task = DigitsTask(resolve(Config(digits=3, prompts=6, group=4, eval_size=16, lr=1e-2, **settings)))
    torch.manual_seed(0)
    batch = task.sample(task.build_policy(), torch.Generator().manual_seed(0))
    return task, batch, task.score(None, batch).rewards


def test_the_learner_descends_the_loss_less_the_bonus():
    """One step with --entropy-coef c: its gradient is the task loss's minus c times the bonus's (from the same
    policy), and the report's loss is the loss with the bonus taken off."""
    task, batch, rewards = _task(entropy_coef=0.3, micro_batch=7, max_grad_norm=0)
    learner = Learner(task, torch.device("cpu"))
    plain = task.loss(learner.policy, batch, rewards, None)
    assert plain.entropy_bonus is not None
    (plain.loss - 0.3 * plain.entropy_bonus).backward()  # type: ignore[no-untyped-call]
    expected = [p.grad.clone() for p in learner.policy.parameters()]
    learner.policy.zero_grad()
    before = [p.detach().clone() for p in learner.policy.parameters()]
    update = learner.update(batch, rewards, None)
    assert float(update.report.loss) == pytest.approx(
        float(plain.loss.detach()) - 0.3 * plain.trained_entropy, abs=1e-5
    )
    assert update.report.trained_entropy == pytest.approx(plain.trained_entropy, abs=1e-6)
    assert update.entropy_coef == 0.3
    got = [p.grad for p in learner.policy.parameters()]
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, want, atol=1e-6, rtol=1e-5)
    assert any(not torch.equal(b, p) for b, p in zip(before, learner.policy.parameters(), strict=True))


def test_the_adaptive_bonus_applies_only_after_a_step_at_or_below_the_target():
    """Step 1 (no entropy measured yet) descends the plain loss; its entropy is under the 5-nat target, so step 2
    descends the loss less the coefficient the controller then holds times H."""
    task, batch, rewards = _task(
        use_adaptive_entropy=True, entropy_coef=0.2, entropy_target=5.0, entropy_coef_delta=0.1, max_grad_norm=0
    )
    learner = Learner(task, torch.device("cpu"))
    for coef in (0.0, 0.3):
        report = task.loss(learner.policy, batch, rewards, None)
        assert report.entropy_bonus is not None
        learner.policy.zero_grad()
        (report.loss - coef * report.entropy_bonus).backward()  # type: ignore[no-untyped-call]
        expected = [p.grad.clone() for p in learner.policy.parameters()]
        update = learner.update(batch, rewards, None)
        for got, want in zip((p.grad for p in learner.policy.parameters()), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert update.report.entropy_bonus is None and not update.report.loss.requires_grad, "no graph kept"
    assert learner.entropy.coef == pytest.approx(0.4)


def test_the_trained_entropy_travels_with_the_figures_ranks_sum():
    report = LossReport.of(_bonus(LossSpec(top_entropy=0.6), ENTROPY))
    summed = LossReport.from_figures(report.loss, report.figures())
    assert summed.trained_entropy == report.trained_entropy == pytest.approx(0.7, abs=1e-6)


def test_a_positive_coefficient_raises_the_entropy_a_negative_one_lowers_it():
    entropies = {}
    for coef in (-1.0, 1.0):
        task, batch, rewards = _task(entropy_coef=coef)
        learner = Learner(task, torch.device("cpu"))
        for _ in range(5):
            learner.update(batch, rewards, None)
        entropies[coef] = task.loss(learner.policy, batch, rewards, None).entropy
    assert entropies[1.0] > entropies[-1.0] + 0.05, entropies


def test_adaptive_control_moves_the_coefficient_each_optimiser_step_and_is_checkpointed(tmp_path):
    from pipeline.learning import checkpoint

    task, batch, rewards = _task(
        use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0, entropy_coef_delta=0.02, num_iterations=2
    )
    learner = Learner(task, torch.device("cpu"))
    update = learner.update(batch, rewards, None)
    assert update.entropy_coef == pytest.approx(0.05), "two optimiser steps below a target of 5 nats: up twice"
    assert learner.entropy.last_entropy == pytest.approx(update.report.trained_entropy, rel=0.2)
    checkpoint.save(str(tmp_path), learner.state())
    fresh = Learner(task, torch.device("cpu"))
    assert fresh.entropy.state() != learner.entropy.state()
    fresh.resume(str(tmp_path))
    assert fresh.entropy.state() == learner.entropy.state()
    old = {k: v for k, v in learner.state().items() if k != "entropy"}  # a checkpoint from before the bonus
    Learner(task, torch.device("cpu")).load_state(old)


def test_a_task_that_reports_no_bonus_is_refused_by_name():
    task, batch, rewards = _task(entropy_coef=0.1)

    class NoBonus(DigitsTask):
        def loss(self, policy, samples, rewards, ref_logps, rows=None):  # type: ignore[no-untyped-def]
            report = super().loss(policy, samples, rewards, ref_logps, rows)
            return dataclasses.replace(report, entropy_bonus=None)

    learner = Learner(NoBonus(task.config), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"--entropy-coef: NoBonus\.loss reported no entropy_bonus"):
        learner.update(batch, rewards, None)


def test_the_flags_reach_the_config():
    config, _ = parse_args(
        [
            "--entropy-coef",
            "0.02",
            "--use-adaptive-entropy",
            "--entropy-coef-min",
            "0.01",
            "--entropy-coef-max",
            "0.5",
            "--entropy-coef-delta",
            "0.001",
            "--entropy-target",
            "1.5",
        ]
    )
    assert config.entropy_control() == EntropyControl(0.02, True, 1.5, 0.001, 0.01, 0.5)
    assert parse_args([])[0].entropy_control() == EntropyControl(0.0, False, 0.2, 0.005, 0.0, 1.0)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--entropy-coef", "nan"], "--entropy-coef nan: must be a finite number"),
        (
            ["--entropy-target", "1", "--entropy-coef-max", "0.3"],
            "--entropy-coef-max, --entropy-target set the adaptive entropy control: add --use-adaptive-entropy",
        ),
        (
            ["--use-adaptive-entropy", "--entropy-coef-min", "0.5", "--entropy-coef-max", "0.1"],
            "--entropy-coef-min 0.5 above --entropy-coef-max 0.1",
        ),
        (["--use-adaptive-entropy", "--entropy-coef-delta", "0"], "--entropy-coef-delta 0.0: the coefficient's step"),
        (
            ["--use-adaptive-entropy", "--entropy-coef", "2"],
            "--entropy-coef 2.0 with --use-adaptive-entropy: the coefficient starts there, so within",
        ),
        (["--no-disable-dropout"], "--no-disable-dropout keeps a Hugging Face policy's dropout (--task hf)"),
        (["--use-adaptive-entropy", "--entropy-target", "-1"], "--entropy-target -1.0: an entropy is at least 0"),
    ],
)
def test_bad_entropy_settings_are_one_line_and_exit_2(tmp_path, capsys, flags, message):
    run_dir = tmp_path / "run"
    assert main([*flags, "--run-dir", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not run_dir.exists()
    with pytest.raises(SettingsError):
        check_settings(Config(entropy_coef=math.inf))
