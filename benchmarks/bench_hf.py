"""Pipeline throughput: a Hugging Face model against the built-in transformer of about the same size.

    python benchmarks/bench_hf.py [--model DIR] [--steps 100] [--repeat 3] [--json]

Runs ``python -m pipeline.grpo``'s pipeline (2 generators, async, shm) for a
fixed number of steps twice per round, interleaved: the built-in ``tiny``
preset on the digit reversal (104 k parameters), and a Hugging Face causal
LM on ``examples/tiny_hf_model.py``'s task (a random 127 k-parameter Qwen2,
built in a temporary folder unless ``--model`` names one). Both take 32
prompts x 8 samples per step. Prints, per side, the medians over the
rounds of steps/s, completion tokens per second (generated and trained:
nothing is dropped), the weight sync
per update (publish + install) and where a step's time goes (generation,
the trainer's update), the ratio HF / built-in, and one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from typing import Any

import uvloop

from pipeline import Config, run_pipeline
from pipeline.run import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example_model(folder: str) -> str:
    """Build examples/tiny_hf_model.py's model and task in ``folder``; the folder."""
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([folder])
    return folder


def _run(config: Config) -> dict[str, float]:
    result = uvloop.run(run_pipeline(config, quiet=True))
    rows = [r for r in read_rows(config.run_dir) if r["step"] > 10]  # past the warm-up
    span = rows[-1]["time"] - rows[0]["time"]
    steps = len(rows) - 1
    return {
        "steps_per_s": steps / span,
        "tokens_per_s": sum(r["tokens/step"] for r in rows[1:]) / span,  # trained = generated: nothing dropped
        "weight_sync_ms": statistics.median(r["timing/weight_sync_ms"] for r in rows),
        "generate_ms": statistics.median(r["timing/generate_ms"] for r in rows),
        "train_ms": statistics.median(r["timing/train_ms"] for r in rows),
        "wall_s": result.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder whose task folder holds train.jsonl, rewards.py")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.dirname(os.path.abspath(args.model)) if args.model else _example_model(tmp)
        common: dict[str, Any] = {
            "steps": args.steps,
            "target_score": None,
            "eval_every": 10_000,
            "lr": 2e-3,
            "kl_coeff": 0.0,
        }  # β 0 on both sides: no reference process (the hf default)
        sides = {
            "builtin": lambda run: Config(task="reverse", model="tiny", run_dir=run, **common),
            "hf": lambda run: Config(
                task="hf",
                model=os.path.join(folder, "model"),
                dataset=os.path.join(folder, "train.jsonl"),
                rewards=[os.path.join(folder, "rewards.py") + ":reversed_digits"],
                max_new_tokens=5,
                eval_size=16,
                run_dir=run,
                **common,
            ),
        }
        results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for round_ in range(args.repeat):
            for name, make in sides.items():
                results[name].append(_run(make(os.path.join(tmp, f"{name}-{round_}"))))
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    ratio = medians["hf"]["steps_per_s"] / medians["builtin"]["steps_per_s"]
    record = {
        "bench": "hf_throughput",
        "steps": args.steps,
        "repeat": args.repeat,
        **{f"{name}_{k}": round(v, 3) for name, m in medians.items() for k, v in m.items()},
        "ratio_steps_per_s": round(ratio, 3),
    }
    if not args.json:
        for name, m in medians.items():
            print(
                f"{name:8s} {m['steps_per_s']:6.1f} steps/s  {m['tokens_per_s']:8.0f} completion tokens/s  "
                f"weight sync {m['weight_sync_ms']:.2f} ms  generate {m['generate_ms']:.1f} ms  "
                f"train {m['train_ms']:.1f} ms per step (medians of {args.repeat})"
            )
        print(f"HF / built-in steps/s: {ratio:.2f} (goal: within 2x, i.e. >= 0.5)")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
