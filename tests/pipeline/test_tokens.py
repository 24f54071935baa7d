"""The token path of GRPO: the sampler, the verifier, masking in the task's loss, and learning in one process.

The loss's arithmetic itself is tested on hand-computed batches in ``test_grpo_loss.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline import Config, DigitsTask, resolve, train_one_process
from pipeline.algorithm import draw, filter_logits
from pipeline.models import ModelConfig, TinyTransformer, completion_logps, generate
from pipeline.tasks import BOS, EOS, PAD, PLUS, SEP, DigitProblem, verify


def model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    net = TinyTransformer(ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=24))
    with torch.no_grad():  # a sharper model than the initial one, so mistakes in caching would show
        for p in net.parameters():
            p.mul_(20.0)
    return net.eval()


def test_cached_decoding_gives_the_logits_of_a_full_forward_pass():
    net = model().double()  # in float64 the two orders of summation agree to ~1e-12
    tokens = torch.randint(0, 16, (3, 14), generator=torch.Generator().manual_seed(1))
    full, _ = net(tokens)
    logits, cache = net(tokens[:, :5])
    stepwise = [logits]
    for position in range(5, 14):
        logits, cache = net(tokens[:, position : position + 1], cache, start=position)
        stepwise.append(logits)
    torch.testing.assert_close(torch.cat(stepwise, dim=1), full, rtol=1e-9, atol=1e-9)


def test_sampled_logps_are_the_policy_logps_of_the_sampled_tokens():
    net = model()
    prompts = DigitProblem("reverse", 4).prompts(3, torch.Generator().manual_seed(0))
    out = generate(net, prompts, samples=4, max_new_tokens=8, eos=EOS, pad=PAD, generator=torch.Generator())
    assert out.tokens.shape[0] == 12 and out.logps.shape == out.mask.shape
    recomputed, entropy = completion_logps(net, out.tokens, prompts.shape[1])
    torch.testing.assert_close(recomputed * out.mask, out.logps, rtol=1e-4, atol=1e-4)
    assert (entropy >= 0).all() and (entropy <= math.log(16) + 1e-4).all()


def test_a_completion_ends_at_its_eos():
    net = model()
    prompts = DigitProblem("reverse", 4).prompts(8, torch.Generator().manual_seed(0))
    out = generate(net, prompts, samples=8, max_new_tokens=8, eos=EOS, pad=PAD, generator=torch.Generator())
    completion = out.tokens[:, prompts.shape[1] :]
    for row, mask in zip(completion, out.mask, strict=True):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any(), "the mask is a prefix"
        ended = (row[:length] == EOS).nonzero()
        if len(ended):
            assert int(ended[0]) == length - 1, "the mask ends at the first EOS, EOS included"
            assert (row[length:] == PAD).all()
    assert (out.logps[out.mask == 0] == 0).all()


def test_greedy_decoding_is_deterministic_and_top_p_keeps_the_smallest_sufficient_set():
    net = model()
    prompts = DigitProblem("sort", 3).prompts(4, torch.Generator().manual_seed(0))
    first = generate(net, prompts, samples=2, max_new_tokens=5, eos=EOS, pad=PAD, temperature=0.0)
    again = generate(net, prompts, samples=2, max_new_tokens=5, eos=EOS, pad=PAD, temperature=0.0)
    assert torch.equal(first.tokens, again.tokens)
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    assert torch.isinf(filter_logits(logits, top_p=0.4)).tolist() == [[False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True]]
    assert not torch.isinf(filter_logits(logits, top_p=1.0)).any()


def test_min_p_keeps_the_tokens_within_its_share_of_the_likeliest_and_draws_only_them():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    assert torch.isinf(filter_logits(logits, min_p=0.5)).tolist() == [[False, False, True]]  # 0.2 < 0.25
    assert torch.isinf(filter_logits(logits, min_p=0.7)).tolist() == [[False, True, True]]  # 0.3 < 0.35
    assert torch.isinf(filter_logits(logits, top_k=2, min_p=0.1)).tolist() == [[False, False, True]]
    assert not torch.isinf(filter_logits(logits, min_p=0.0)).any()
    step = 3 * torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    token, logp = draw(step, 0.7, torch.Generator().manual_seed(1), min_p=0.3)
    chosen = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    assert (chosen >= logp.max(-1).values + math.log(0.3) - 1e-6).all(), "only tokens within min_p of the likeliest"
    assert torch.allclose(logp, (step / 0.7).log_softmax(-1)), "the recorded distribution is the policy's, uncut"
    assert (chosen < logp.max(-1).values - 1e-3).any(), "not greedy: other kept tokens are drawn too"


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"min_p": 0.999}])
def test_the_digit_tasks_sample_with_top_k_and_min_p(cut):
    """Either cut to the likeliest token makes sampling greedy: every sample of a prompt is the same."""
    task = DigitsTask(resolve(Config(digits=3, prompts=8, group=4, eval_size=16, **cut)))
    torch.manual_seed(0)
    batch = task.sample(task.build_policy(), torch.Generator().manual_seed(0))
    rows = batch.tokens.view(8, 4, -1)
    assert (rows == rows[:, :1]).all()
    uncut = DigitsTask(resolve(Config(digits=3, prompts=8, group=4, eval_size=16)))
    free = uncut.sample(uncut.build_policy(), torch.Generator().manual_seed(0)).tokens.view(8, 4, -1)
    assert (free != free[:, :1]).any(), "without a cut the samples of a prompt differ"


def test_generation_refuses_to_run_past_the_model_length():
    with pytest.raises(ValueError, match="exceed max_len"):
        generate(model(), torch.zeros(1, 20, dtype=torch.int64), samples=1, max_new_tokens=8, eos=EOS, pad=PAD)


def test_the_problems_answers():
    prompt = torch.tensor([[BOS, 3, 1, 2, SEP]])
    assert DigitProblem("reverse", 3).answers(prompt).tolist() == [[2, 1, 3]]
    assert DigitProblem("sort", 3).answers(prompt).tolist() == [[1, 2, 3]]
    add = DigitProblem("add", 2)
    assert add.answers(torch.tensor([[BOS, 4, 5, PLUS, 6, 7, SEP]])).tolist() == [[1, 1, 2]]
    drawn = add.prompts(50, torch.Generator().manual_seed(0))
    assert drawn.shape == (50, add.prompt_length) and (drawn[:, 3] == PLUS).all()
    with pytest.raises(ValueError, match="unknown digit task"):
        DigitProblem("juggle", 3)


def test_held_out_prompts_never_appear_in_training():
    problem = DigitProblem("reverse", 2)  # 100 possible inputs: collisions would be certain
    held_out = {problem.key(p) for p in problem.prompts(30, torch.Generator().manual_seed(1))}
    drawn = problem.prompts(500, torch.Generator().manual_seed(2), exclude=held_out)
    assert not {problem.key(p) for p in drawn} & held_out


@pytest.mark.parametrize(
    "completion, reward, exact",
    [
        ([2, 1, 3, EOS], 1.0, 1.0),  # right, and stops in the right place
        ([2, 1, 9, EOS], 0.75, 0.0),  # one wrong digit
        ([2, 1, 3, 3, EOS], 0.75, 0.0),  # right digits, but does not stop
        ([2, EOS], 0.25, 0.0),  # stops early: only the first digit counts
        ([EOS], 0.0, 0.0),
        ([1, 2, 3, EOS], 0.5, 0.0),  # 2nd digit and EOS right
    ],
)
def test_the_verifier_gives_partial_credit_per_position(completion, reward, exact):
    width = 6
    padded = completion + [PAD] * (width - len(completion))
    mask = [1.0] * len(completion) + [0.0] * (width - len(completion))
    verdict = verify(torch.tensor([padded]), torch.tensor([mask]), torch.tensor([[2, 1, 3]]))
    assert verdict.rewards.tolist() == [pytest.approx(reward)]
    assert verdict.exact.tolist() == [exact]
    assert verdict.lengths.tolist() == [len(completion)]


def test_a_truncated_completion_is_scored_on_what_it_has():
    verdict = verify(torch.tensor([[2, 1]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[2, 1, 3]]))
    assert verdict.rewards.tolist() == [0.5] and verdict.exact.tolist() == [0.0]


def test_tokens_after_eos_do_not_change_the_loss():
    config = resolve(Config(digits=3))
    task = DigitsTask(config)
    net = task.build_policy()
    batch = task.sample(net, torch.Generator().manual_seed(0))
    rewards = task.score(None, batch).rewards
    ref = task.reference_logps(net, batch)
    before = float(task.loss(net, batch, rewards, ref).loss.detach())
    prompt = batch.prompts.shape[1]
    garbled = batch.tokens.clone()
    assert (batch.mask == 0).any(), "some completions ended before max_new_tokens"
    garbled[:, prompt:][batch.mask == 0] = 7
    batch.tokens = garbled
    assert float(task.loss(net, batch, rewards, ref).loss.detach()) == pytest.approx(before, abs=1e-6)


def test_a_short_run_in_one_process_learns_to_reverse_three_digits():
    result = train_one_process(Config(digits=3, steps=300, target_score=0.9, eval_every=10))
    first = result.curve[0][1]
    assert first < 0.1, result.curve
    assert result.seconds_to_target is not None and result.score >= 0.9, result.curve


@pytest.mark.gpu
def test_the_one_process_reference_trains_on_a_gpu():
    """The digit task scores on the CPU: its rewards go to the trainer's GPU (the device mismatch a review found in
    ``bench_grpo.py --device cuda``'s baseline)."""
    result = train_one_process(Config(digits=3, steps=4, eval_every=2, device="cuda"))
    assert result.steps == 4 and len(result.curve) == 2


def test_a_state_moved_to_another_device_keeps_the_tensors_its_names_share():
    """A tied embedding and head is one tensor under two names: moved name by name (a resumed reference going to
    the GPU) it became two copies."""
    from pipeline.learning._learner import moved_state

    tied, other = torch.randn(4, 3), torch.randn(3)
    moved = moved_state({"embed.weight": tied, "head.weight": tied, "norm.weight": other}, torch.device("meta"))
    assert all(t.device.type == "meta" for t in moved.values())
    assert moved["embed.weight"] is moved["head.weight"] and moved["norm.weight"] is not moved["embed.weight"]
    halves = moved_state({"a": tied[:2], "b": tied[2:]}, torch.device("meta"))
    assert halves["a"] is not halves["b"], "views of one storage at different offsets stay two tensors"
