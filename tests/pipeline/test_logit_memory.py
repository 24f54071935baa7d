"""Log-probabilities without logits over the whole vocabulary for the whole batch: same numbers, bounded memory."""

from __future__ import annotations

import os

import pytest
import torch
from harness import ROOT, last_json, run_python
from pipeline_support import tiny_qwen2

from pipeline.algorithm import chunk_positions, chunked_token_logps, token_logps
from pipeline.models import missing_compiler


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logps_and_gradients_equal_the_full_computation(temperature):
    torch.manual_seed(0)
    hidden = torch.randn(6, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=True)
    targets = torch.randint(0, 50, (6, 9), device="cpu")
    weights = torch.randn(6, 9)

    full_logps, full_entropy = token_logps(head(hidden), targets, temperature)
    (full_logps * weights).sum().backward()
    expected = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None

    logps, entropy = chunked_token_logps(hidden, head, targets, temperature, vocab=50, budget=50 * 7)  # 8 chunks
    assert not entropy.requires_grad, "the entropy is a metric: it keeps no graph"
    (logps * weights).sum().backward()
    torch.testing.assert_close(logps, full_logps.detach())
    torch.testing.assert_close(entropy, full_entropy.detach())
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(
    missing_compiler(torch.device("cpu")) is not None, reason="torch.compile on a CPU builds C++: no compiler here"
)
def test_compiled_chunks_with_an_entropy_bonus_equal_the_eager_ones():
    """--compile: each chunk's work compiled, its written-out backward of the log-probabilities and entropies
    included (the path without a bonus: tests/pipeline/test_hf.py's compiled learner)."""
    torch.manual_seed(0)
    hidden = torch.randn(6, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=True)
    targets = torch.randint(0, 50, (6, 9), device="cpu")
    weights, entropy_weights = torch.randn(6, 9), torch.randn(6, 9)
    results = []
    for compiled in (False, True):
        hidden.grad, head.weight.grad, head.bias.grad = None, None, None
        logps, entropy = chunked_token_logps(
            hidden, head, targets, 0.7, vocab=50, budget=50 * 7, entropy_grad=True, compiled=compiled
        )
        ((logps * weights).sum() + (entropy * entropy_weights).sum()).backward()
        results.append((logps.detach(), entropy.detach(), hidden.grad, head.weight.grad, head.bias.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_chunk_holds_at_most_the_budget():
    assert chunk_positions(151_936) == 220  # 2**25 logits: 128 MiB of float32 per chunk
    assert chunk_positions(16) == 2**21 and chunk_positions(10**9) == 1


def test_the_split_model_gives_the_models_own_log_probs_and_falls_back_when_it_cannot(caplog):
    pytest.importorskip("transformers", reason="needs the hf extra")
    from pipeline.models import CompletionLogps

    model = tiny_qwen2(300)
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], device="cpu")
    tokens = torch.randint(3, 300, (2, 10), device="cpu")
    attention = torch.cat([prompt_mask, torch.ones(2, 6, dtype=torch.long, device="cpu")], 1)[:, :-1]
    position_ids = (attention.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1], attention_mask=attention, position_ids=position_ids).logits
    want, want_entropy = token_logps(logits[:, 3:].float(), tokens[:, 4:], 0.9)

    split = CompletionLogps(model, budget=300 * 5)
    got, entropy = split(tokens, prompt_mask, 0.9)
    assert split.split is not None, "a Qwen2 splits into body and head"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)

    whole = CompletionLogps(model, budget=300 * 5)
    whole.split = None  # a model whose head cannot be taken apart: logits at completion positions only
    got, _ = whole(tokens, prompt_mask, 0.9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    capped = CompletionLogps(model)  # a head the split does not reproduce (say, an unknown logit transform)
    assert capped.split is not None
    capped.split = capped.split._replace(head=lambda hidden: model.lm_head(hidden) * 2)
    got, _ = capped(tokens, prompt_mask, 0.9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert capped.split is None and capped.path == "logits_to_keep" and split.path == "head in chunks"
    assert "could not be taken apart" in caplog.text


def test_a_head_adapted_by_lora_is_still_taken_apart_and_scored_in_chunks():
    """``--lora-target-modules ...,lm_head``: PEFT wraps the head in its own layer, which is no ``nn.Linear``; the
    split still takes it (its logits checked against the model's), not the whole [N, T, V] logits of the fallback."""
    pytest.importorskip("peft", reason="needs the hf extra")
    from pipeline.models import CompletionLogps, LoraAdapter

    model = tiny_qwen2(300, tie_word_embeddings=False)  # (a tied head takes no adapter: refused)
    LoraAdapter(model, 4, 8.0, "q_proj,lm_head")
    with torch.no_grad():  # the adapters start at B = 0: move them, so the head's LoRA term counts
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    assert not isinstance(model.get_output_embeddings(), torch.nn.Linear)
    prompt_mask = torch.ones(2, 4, dtype=torch.long, device="cpu")
    tokens = torch.randint(3, 300, (2, 10), device="cpu")
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1], attention_mask=torch.ones(2, 9, dtype=torch.long)).logits
    want, _ = token_logps(logits[:, 3:].float(), tokens[:, 4:], 1.0)
    split = CompletionLogps(model, budget=300 * 2)
    got, _ = split(tokens, prompt_mask, 1.0)
    assert split.path == "head in chunks"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_micro_batches_follow_the_token_budget():
    from pipeline import Config
    from pipeline.tasks import DigitsTask, resolve

    task = DigitsTask(resolve(Config()))
    samples = task.sample(task.build_policy(), torch.Generator(device="cpu").manual_seed(0))
    rows, width = samples.tokens.shape
    assert task.micro_batches(samples, 0, 0) == [slice(None)]
    assert task.micro_batches(samples, 0, rows * width) == [slice(None)], "the digit task's rollout fits the default"
    parts = task.micro_batches(samples, 0, 100 * width)
    assert [p.stop - p.start for p in parts] == [100, 100, rows - 200]
    assert task.micro_batches(samples, 64, 100 * width)[0] == slice(0, 64), "--micro-batch wins over the budget"


def peak_of_one_step(rows: int, new: int, how: str) -> dict[str, float]:
    """Peak resident memory (MB) of a fresh process taking one GRPO training step (log-probs, loss, backward, Adam)."""
    bench = os.path.join(ROOT, "benchmarks", "bench_logit_memory.py")
    out = run_python(bench, "--step", str(rows), str(new), how, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(last_json(out.stdout))


#: The stated bound for one GRPO step (log-probs, loss, backward, Adam) of 256 rows x 64 new tokens at a
#: 151,936-token vocabulary, measured at 999 MB (a 2-layer, 16-wide Qwen2: its embedding is 9.7 M parameters). The computation before held
#: float32 logits at every position: 256 x 71 x 151,936 x 4 B = 11 GB for the logits alone, and log_softmax and
#: the entropy as much again each; measured at 16 rows it took 3.5 GB (benchmarks/bench_logit_memory.py).
PEAK_LIMIT_MB = 1500


def test_one_step_at_a_real_vocabulary_stays_under_the_stated_peak():
    pytest.importorskip("transformers", reason="needs the hf extra")
    old_logits_mb = 256 * 71 * 151_936 * 4 / 2**20
    assert old_logits_mb > 7 * PEAK_LIMIT_MB
    new = peak_of_one_step(256, 64, "new")
    assert new["peak_mb"] < PEAK_LIMIT_MB, new


def test_an_entropy_bonus_keeps_the_step_in_chunks():
    """With --entropy-coef the entropy is differentiable and recomputed chunk by chunk with the log-probs through the
    pair's written-out backward (measured 915 MB at 256 rows x 64 new tokens, 857 MB at these 64 x 32), where the old
    computation's logits would be 1.4 GB here (64 x 39 x 151,936 x 4 B) and their log-softmax as much again."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    assert 2 * 64 * 39 * 151_936 * 4 / 2**20 > 1.9 * PEAK_LIMIT_MB
    bonus = peak_of_one_step(64, 32, "bonus")
    assert bonus["peak_mb"] < PEAK_LIMIT_MB, bonus


def test_a_model_without_a_split_or_logits_to_keep_is_scored_from_its_whole_logits_and_says_so(caplog):
    """The last resort: a forward that takes no ``logits_to_keep`` and a head that cannot be taken apart gives
    logits at every position; the log-probs are still right, and the path and a warning name that memory cost."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    from pipeline.models import CompletionLogps

    inner = tiny_qwen2(300)

    class Plain(torch.nn.Module):  # no base_model, no output embeddings, no logits_to_keep
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache=False):
            return inner(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
            )

    prompt_mask = torch.ones(2, 4, dtype=torch.long, device="cpu")
    tokens = torch.randint(3, 300, (2, 10), device="cpu")
    with torch.no_grad():
        logits = inner(input_ids=tokens[:, :-1], attention_mask=torch.ones(2, 9, dtype=torch.long)).logits
    want, _ = token_logps(logits[:, 3:].float(), tokens[:, 4:], 1.0)
    plain = CompletionLogps(Plain())
    got, _ = plain(tokens, prompt_mask, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert plain.split is None and plain.path == "full logits"
    assert "logits at every position" in caplog.text
