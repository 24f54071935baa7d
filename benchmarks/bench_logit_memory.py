"""Peak memory of one trainer pass at a real vocabulary: log-probs chunk by chunk against full logits.

    python benchmarks/bench_logit_memory.py [--rows 256] [--new 64] [--old-rows 16,32] [--repeat 3] [--compiled]

Each measurement is a fresh process that builds a 2-layer, 16-wide Qwen2 with
Qwen2.5's 151,936-token vocabulary, takes one GRPO training step (the
completions' log-probs, the clipped loss, backward, an Adam step) over
``rows`` completions of ``new`` tokens after an 8-token prompt, and reports
its peak resident memory. ``new``: :class:`pipeline.models.CompletionLogps`
(hidden states through the head in chunks, the entropy without a graph).
``bonus``: the same with an entropy bonus in the loss (``--entropy-coef``: the
entropy differentiable, recomputed chunk by chunk with the log-probabilities).
``compiled`` (``--compiled``; ``--compile``'s head): the chunks' work compiled
by ``torch.compile``, the compilation inside the measured step (a run's
first). ``old`` (the raw baseline, what the pipeline did before): logits at every
position in float32, then ``log_softmax``, the gather and the entropy over
all of them. The old computation cannot run at the full row count on a 24 GB
machine, so it is measured at fewer rows and its growth per row extrapolated
(it is linear in the rows). Prints the medians, the ratio, and one JSON line.

``--step ROWS NEW new|bonus|compiled|old`` runs one measurement in this process and prints
its JSON line (the test suite and the rounds above use it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VOCAB = 151_936
PROMPT = 8


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ``ru_maxrss``, not inherited from a parent's across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def one_step(rows: int, new: int, how: str) -> dict[str, float]:
    """One GRPO training step in this process (log-probs, the loss, backward, Adam); its peak memory (MB) and seconds."""
    import torch
    import transformers

    from pipeline.algorithm import LossSpec, group_advantages, token_grpo_loss, token_logps
    from pipeline.models import CompletionLogps

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    tokens = torch.randint(0, VOCAB, (rows, PROMPT + new), device="cpu")
    prompt_mask = torch.ones(rows, PROMPT, dtype=torch.long, device="cpu")
    mask = torch.ones(rows, new, device="cpu")
    advantages = group_advantages(torch.rand(rows, device="cpu"), 8 if rows % 8 == 0 else 1)
    before = peak_rss_mb()
    started = time.perf_counter()
    if how == "old":
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, PROMPT - 1 :].float()
        logps, entropy = token_logps(logits, tokens[:, PROMPT:], 1.0)
    else:
        logps, entropy = CompletionLogps(model, compiled=how == "compiled")(tokens, prompt_mask, 1.0, how == "bonus")
    loss = token_grpo_loss(logps, logps.detach(), None, mask, advantages, LossSpec(), entropy=entropy)
    objective = loss.loss - 0.01 * loss.entropy_bonus if how == "bonus" else loss.loss
    objective.backward()  # type: ignore[no-untyped-call,operator]
    optimizer.step()
    seconds = time.perf_counter() - started
    peak = peak_rss_mb()
    return {"peak_mb": peak, "step_mb": peak - before, "seconds": seconds}


def measure(rows: int, new: int, how: str, timeout: float = 900) -> dict[str, float]:
    """:func:`one_step` in a fresh process (its peak is its own)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--step", str(rows), str(new), how],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {how} pass at {rows} rows failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--old-rows", default="16,32", help="row counts the old computation is measured at")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compiled", action="store_true", help="also the compiled head (needs a C++ compiler)")
    parser.add_argument("--step", nargs=3, metavar=("ROWS", "NEW", "HOW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        rows, new, how = args.step
        if how not in ("new", "bonus", "compiled", "old"):
            parser.error(f"--step {rows} {new} {how}: the third is new, bonus, compiled or old")
        print(json.dumps(one_step(int(rows), int(new), how)))
        return 0
    old_rows = [int(r) for r in args.old_rows.split(",")]
    new_runs = [measure(args.rows, args.new, "new") for _ in range(args.repeat)]
    bonus_runs = [measure(args.rows, args.new, "bonus") for _ in range(args.repeat)]
    compiled_runs = [measure(args.rows, args.new, "compiled") for _ in range(args.repeat)] if args.compiled else []
    old_runs = {r: [measure(r, args.new, "old") for _ in range(args.repeat)] for r in old_rows}
    new_peak = statistics.median(run["peak_mb"] for run in new_runs)
    new_seconds = statistics.median(run["seconds"] for run in new_runs)
    bonus_peak = statistics.median(run["peak_mb"] for run in bonus_runs)
    bonus_seconds = statistics.median(run["seconds"] for run in bonus_runs)
    old_peaks = {r: statistics.median(run["peak_mb"] for run in runs) for r, runs in old_runs.items()}
    low, high = min(old_rows), max(old_rows)
    per_row = (old_peaks[high] - old_peaks[low]) / (high - low) if high > low else old_peaks[low] / low
    old_at_rows = old_peaks[low] + per_row * (args.rows - low)
    print(f"one GRPO step, {args.rows} rows x {args.new} new tokens, vocabulary {VOCAB:,}, medians of {args.repeat}:")
    print(f"  chunked (new):    peak {new_peak:8.0f} MB   {new_seconds:.1f} s")
    print(f"  with an entropy bonus: peak {bonus_peak:8.0f} MB   {bonus_seconds:.1f} s")
    if compiled_runs:
        compiled_peak = statistics.median(run["peak_mb"] for run in compiled_runs)
        compiled_seconds = statistics.median(run["seconds"] for run in compiled_runs)
        print(
            f"  compiled head (--compile), its compilation included: peak {compiled_peak:8.0f} MB   {compiled_seconds:.1f} s"
        )
    for r in old_rows:
        print(f"  full logits (old) at {r} rows: peak {old_peaks[r]:8.0f} MB")
    print(f"  full logits (old) at {args.rows} rows, extrapolated at {per_row:.0f} MB a row: {old_at_rows:8.0f} MB")
    print(f"  old / new at {args.rows} rows: {old_at_rows / new_peak:.1f}x")
    record = {
        "bench": "logit_memory",
        "rows": args.rows,
        "new_tokens": args.new,
        "vocab": VOCAB,
        "new_peak_mb": round(new_peak, 1),
        "new_seconds": round(new_seconds, 2),
        "bonus_peak_mb": round(bonus_peak, 1),
        "bonus_seconds": round(bonus_seconds, 2),
        **(
            {"compiled_peak_mb": round(compiled_peak, 1), "compiled_seconds": round(compiled_seconds, 2)}
            if compiled_runs
            else {}
        ),
        "old_peak_mb": {str(r): round(v, 1) for r, v in old_peaks.items()},
        "old_peak_mb_extrapolated": round(old_at_rows, 1),
        "ratio": round(old_at_rows / new_peak, 2),
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
