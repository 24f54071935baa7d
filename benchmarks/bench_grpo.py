"""Wall time to a held-out target: the GRPO pipeline against the same GRPO in one process.

    python benchmarks/bench_grpo.py [--seeds 0 1 2] [--target 0.99] [--generators 2]
    python benchmarks/bench_grpo.py --device cuda --transport cuda-ipc --model gpu-300m   # on a GPU

For each seed, trains the default task (a tiny transformer reversing 6
digits) twice: the pipeline exactly as ``python -m pipeline.grpo`` runs it
(separate processes, asynchronous, start-up included), and the one-process,
on-policy loop with the same task, seed, model and hyper-parameters (the
same :class:`~pipeline.learner.Learner`), measured in the same run. Both
stop at the first evaluation (every 10 steps) that reaches ``--target``
held-out exact match. Prints each seed's wall time and steps to the target,
the ratio pipeline / one process (the goal is <= 1.0: overlapping
generation with training should win back the messaging and start-up costs),
the pipeline's pace (tokens/s generated and trained, idle ratios), its
staleness and weight-sync times, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch
import uvloop

from pipeline import Config, run_pipeline, train_one_process
from pipeline.metrics import read_rows


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.99, help="held-out exact match to reach")
    parser.add_argument("--steps", type=int, default=1000, help="give up after this many steps")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--digits", type=int, default=6)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--device", default="cpu", help="device of every role (cpu, cuda, cuda:N)")
    parser.add_argument("--transport", default="shm", choices=["shm", "cuda-ipc"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same single-threaded torch each role uses
    results = []
    for seed in args.seeds:
        config = Config(
            task=args.task,
            digits=args.digits,
            model=args.model,
            steps=args.steps,
            target_score=args.target,
            seed=seed,
            mode=args.mode,
            generators=args.generators,
            run_dir=tempfile.mkdtemp(prefix="bench-grpo-"),
            device=args.device,
            transport=args.transport,
        )
        one = train_one_process(config)
        started = time.perf_counter()
        pipe = uvloop.run(run_pipeline(config, quiet=True))
        whole = time.perf_counter() - started
        to_target = pipe.startup_seconds + pipe.seconds if pipe.target_reached else float("inf")
        one_to_target = one.seconds_to_target if one.seconds_to_target is not None else float("inf")
        rows = read_rows(config.run_dir)
        steady = rows[len(rows) // 4 :] or rows  # past the start-up transient
        seed_result = {
            "seed": seed,
            "pipeline_s": to_target,
            "pipeline_steps": pipe.steps,
            "pipeline_whole_run_s": whole,
            "startup_s": pipe.startup_seconds,
            "one_process_s": one_to_target,
            "one_process_steps": one.steps,
            "tokens_generated_per_s": _median(steady, "perf/tokens_generated_per_s"),
            "tokens_trained_per_s": _median(steady, "perf/tokens_trained_per_s"),
            "trainer_idle": _median(steady, "perf/trainer_idle_ratio"),
            "generator_idle": _median(steady, "perf/generator_idle_ratio"),
            "staleness_mean": statistics.mean(r["staleness/lag"] for r in rows),
            "staleness_max": max(r["staleness/lag"] for r in rows),
            "dropped": pipe.dropped,
            "publish_ms": _median(rows, "timing/publish_ms"),
            "install_ms": _median(rows, "timing/install_ms"),
            "delivery_ms": _median(rows, "timing/delivery_ms"),
            "weight_sync_ms": _median(rows, "timing/weight_sync_ms"),
        }
        results.append(seed_result)
        print(
            f"seed {seed}: pipeline {to_target:5.1f} s to {args.target} ({pipe.steps} steps, start-up "
            f"{pipe.startup_seconds:.2f} s, whole run {whole:.1f} s) | one process {one_to_target:5.1f} s "
            f"({one.steps} steps) -> {to_target / one_to_target:.2f}x"
        )
        print(
            f"         pace {seed_result['tokens_generated_per_s'] / 1000:.1f}k tok/s generated, "
            f"{seed_result['tokens_trained_per_s'] / 1000:.1f}k trained; idle trainer "
            f"{seed_result['trainer_idle']:.2f}, generators {seed_result['generator_idle']:.2f}; staleness mean "
            f"{seed_result['staleness_mean']:.1f} max {seed_result['staleness_max']}; weight sync "
            f"{seed_result['weight_sync_ms']:.2f} ms (publish {seed_result['publish_ms']:.2f}, install "
            f"{seed_result['install_ms']:.2f}), delivery {seed_result['delivery_ms']:.1f} ms"
        )
    pipe_s = statistics.median(r["pipeline_s"] for r in results)
    one_s = statistics.median(r["one_process_s"] for r in results)
    ratio = pipe_s / one_s
    print(
        f"median over seeds {args.seeds}: pipeline {pipe_s:.1f} s vs one process {one_s:.1f} s to "
        f"{args.target} held-out exact match -> ratio {ratio:.2f} (goal <= 1.0)"
    )
    print(
        json.dumps(
            {
                "bench": "grpo",
                "task": f"{args.task}-{args.digits}",
                "model": args.model,
                "device": args.device,
                "transport": args.transport,
                "generators": args.generators,
                "mode": args.mode,
                "target": args.target,
                "seeds": args.seeds,
                "pipeline_s_to_target": round(pipe_s, 2),
                "one_process_s_to_target": round(one_s, 2),
                "ratio": round(ratio, 3),
                "goal_ratio": "<= 1.0",
                "per_seed": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in results],
            }
        )
    )


if __name__ == "__main__":
    main()
