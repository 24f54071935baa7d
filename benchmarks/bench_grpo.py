"""The GRPO pipeline against the same GRPO trained in one process, side by side.

    python benchmarks/bench_grpo.py [--steps 2000] [--seeds 0 1 2] [--mode async]
    python benchmarks/bench_grpo.py --device cuda --transport cuda-ipc   # on a GPU

For each seed, runs ``python -m pipeline.grpo``'s pipeline (default flags)
and the one-process, on-policy loop with the same task and seed. Prints
trainer steps/s of both and their ratio (target >= 0.4), the final
normalized scores (target: pipeline mean >= 0.8 and within 0.05 of the
one-process mean), startup and stop times, the weight-sync time per update
(the trainer's publish plus the send of the manifest, median over steps),
and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import uvloop

from pipeline import Config, run_pipeline, train_one_process
from pipeline.metrics import read_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="device of every role (cpu, cuda, cuda:N)")
    parser.add_argument("--transport", default="shm", choices=["shm", "cuda-ipc"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same single-threaded torch the actors use
    rows = []
    sync_ms: list[float] = []
    for seed in args.seeds:
        config = Config(
            steps=args.steps,
            seed=seed,
            mode=args.mode,
            generators=args.generators,
            run_dir=tempfile.mkdtemp(prefix="bench-grpo-"),
            device=args.device,
            transport=args.transport,
        )
        one = train_one_process(config)
        result = uvloop.run(run_pipeline(config, quiet=True))
        rows.append((seed, result, one))
        sync_ms.append(statistics.median(r["weight_sync_ms"] for r in read_rows(config.run_dir)))
        print(
            f"seed {seed}: pipeline {result.steps_per_second:6.0f} steps/s score {result.score:.3f} "
            f"(dropped {result.dropped}, startup {result.startup_seconds:.2f}s, stop {result.stop_seconds:.2f}s, "
            f"weight sync {sync_ms[-1]:.3f} ms) | "
            f"one process {one.steps_per_second:6.0f} steps/s score {one.score:.3f}"
        )
    pipe_rate = statistics.median(r.steps_per_second for _, r, _ in rows)
    one_rate = statistics.median(o.steps_per_second for _, _, o in rows)
    pipe_score = statistics.mean(r.score or 0.0 for _, r, _ in rows)
    one_score = statistics.mean(o.score for _, _, o in rows)
    ratio = pipe_rate / one_rate
    print(
        f"steps/s: pipeline {pipe_rate:.0f} vs one process {one_rate:.0f} -> ratio {ratio:.2f} (target >= 0.4)\n"
        f"final normalized score over seeds {args.seeds}: pipeline {pipe_score:.3f}, one process {one_score:.3f} "
        f"(target: >= 0.8 and within 0.05)"
    )
    print(
        json.dumps(
            {
                "bench": "grpo",
                "mode": args.mode,
                "device": args.device,
                "transport": args.transport,
                "weight_sync_ms": round(statistics.median(sync_ms), 3),
                "generators": args.generators,
                "steps": args.steps,
                "seeds": args.seeds,
                "pipeline_steps_per_s": round(pipe_rate, 1),
                "one_process_steps_per_s": round(one_rate, 1),
                "ratio": round(ratio, 3),
                "pipeline_score": round(pipe_score, 3),
                "one_process_score": round(one_score, 3),
                "score_gap": round(one_score - pipe_score, 3),
                "startup_s": round(statistics.median(r.startup_seconds for _, r, _ in rows), 2),
                "stop_s": round(statistics.median(r.stop_seconds for _, r, _ in rows), 2),
                "dropped_stale": [r.dropped for _, r, _ in rows],
                "target_ratio": ">= 0.4",
            }
        )
    )


if __name__ == "__main__":
    main()
