"""Wall time to a held-out target: the GRPO pipeline against the same GRPO in one process, on the same cores.

    python benchmarks/bench_grpo.py [--seeds 0 1 2] [--target 0.99] [--json]
    python benchmarks/bench_grpo.py --lr 1e-3 --kl-coeff 0.02 --baseline-kl-coeff 0.02   # the CLI's defaults
    python benchmarks/bench_grpo.py --device cuda --transport cuda-ipc --model gpu-300m   # on a GPU
    python benchmarks/bench_grpo.py --trainer-ranks 2      # the trainer as two ranks, sharded (FSDP2)
    python benchmarks/bench_grpo.py --trainer-ranks 2 --trainer-shard ddp   # two replicas

For each seed, trains the default task (a tiny transformer reversing 6
digits) three ways, all measured in this run: the pipeline exactly as
``python -m pipeline.grpo`` runs it (separate processes, asynchronous,
start-up included), and the one-process, on-policy loop (the same
:class:`~pipeline.learning.Learner`, task and seed) with
one torch thread and with as many threads as the pipeline has cores
(``--baseline-threads``; default 1 and this machine's cores). All stop at
the first evaluation (every 10 steps) that reaches ``--target`` held-out
exact match. Each side runs with the best settings one search found for it
(the same grid for both): the pipeline at lr 2e-3, the one process at lr
1e-3 (on-policy, 2e-3 does not converge), both with β = 0.

The headline is ``ratio_same_cores``: pipeline ÷ one process with as many
threads as cores, medians over the seeds. Below 1 the pipeline's overlap of
generation and training beats a single process using the same cores;
``ratio_one_thread`` is the old, easier comparison. Also printed: where the
pipeline's seconds go (start-up, the trainer's update, waiting for rollouts,
publishing, evaluation), its staleness, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import uvloop

from pipeline import Config, run_pipeline, train_one_process
from pipeline.run import read_rows


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def _sum(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows if r.get(key) is not None) / 1000.0


def _ratio(pipeline_s: float, baseline_s: float) -> float | None:
    """pipeline ÷ baseline; None when either missed the target (a median of inf)."""
    if pipeline_s == float("inf") or baseline_s == float("inf"):
        return None
    return round(pipeline_s / baseline_s, 3)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _config(args: argparse.Namespace, seed: int, threads: int, baseline: bool = False) -> Config:
    return Config(
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
        lr=args.baseline_lr if baseline else args.lr,
        kl_coeff=args.baseline_kl_coeff if baseline else args.kl_coeff,
        loss=args.loss,
        max_staleness=args.max_staleness,
        max_inflight=args.max_inflight,
        threads=threads,
        trainer_ranks=1 if baseline else args.trainer_ranks,
        trainer_shard=args.trainer_shard,
    )


def _pipeline(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    config = _config(args, seed, args.threads)
    started = time.perf_counter()
    pipe = uvloop.run(run_pipeline(config, quiet=True))
    whole = time.perf_counter() - started
    rows = read_rows(config.run_dir)
    steady = rows[len(rows) // 4 :] or rows  # past the start-up transient
    evaluated = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return {
        "pipeline_s": pipe.startup_seconds + pipe.seconds if pipe.target_reached else float("inf"),
        "pipeline_steps": pipe.steps,
        "pipeline_whole_run_s": whole,
        "startup_s": pipe.startup_seconds,
        "training_s": pipe.seconds,
        # Where the trainer's seconds went, summed over the run: its update, waiting for rollouts, publishing.
        "train_s": _sum(rows, "timing/train_ms"),
        "wait_s": _sum(rows, "timing/wait_batch_ms"),
        "publish_s": _sum(rows, "timing/publish_ms"),
        "evaluations": len(evaluated),
        "tokens_generated_per_s": _median(steady, "perf/tokens_generated_per_s"),
        "tokens_trained_per_s": _median(steady, "perf/tokens_trained_per_s"),
        "trainer_idle": _median(steady, "perf/trainer_idle_ratio"),
        "generator_idle": _median(steady, "perf/generator_idle_ratio"),
        "staleness_mean": statistics.mean(r["staleness/lag"] for r in rows),
        "staleness_max": max(r["staleness/lag"] for r in rows),
        "dropped": pipe.dropped,
        "train_ms": _median(rows, "timing/train_ms"),
        "generate_ms": _median(rows, "timing/generate_ms"),
        "publish_ms": _median(rows, "timing/publish_ms"),
        "install_ms": _median(rows, "timing/install_ms"),
        "delivery_ms": _median(rows, "timing/delivery_ms"),
    }


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
    # Each side's best of one search (docs/benchmarks.md): lr 1e-3, 2e-3, 3e-3 x loss dapo, grpo x beta 0.02, 0.
    parser.add_argument("--lr", type=float, default=2e-3, help="the pipeline's (default 2e-3, its best)")
    parser.add_argument("--kl-coeff", type=float, default=0.0, help="the pipeline's (default 0, its best)")
    parser.add_argument("--baseline-lr", type=float, default=1e-3, help="the one process's (default 1e-3, its best)")
    parser.add_argument("--baseline-kl-coeff", type=float, default=0.0, help="the one process's (default 0, its best)")
    parser.add_argument("--loss", default="dapo", choices=["grpo", "dr_grpo", "dapo"], help="both sides")
    parser.add_argument("--max-staleness", type=int, default=Config().max_staleness, help="the pipeline's bound")
    parser.add_argument("--max-inflight", type=int, default=Config().max_inflight)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per pipeline role (default 1)")
    parser.add_argument("--trainer-ranks", type=int, default=1, help="the pipeline's trainer processes (default 1)")
    parser.add_argument("--trainer-shard", choices=["fsdp", "ddp"], default="fsdp", help="with several ranks")
    parser.add_argument(
        "--baseline-threads",
        type=int,
        nargs="+",
        default=sorted({1, _cores()}),
        help="the one-process runs' torch threads (default: 1 and this machine's cores)",
    )
    parser.add_argument("--no-pipeline", action="store_true", help="only the one-process runs (a search)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    show = print if not args.json else (lambda *_: None)
    cores = max(args.baseline_threads)
    results = []
    for seed in args.seeds:
        seed_result: dict[str, Any] = {"seed": seed}
        for threads in args.baseline_threads:
            one = train_one_process(_config(args, seed, threads, baseline=True))
            seed_result[f"one_process_{threads}t_s"] = one.seconds_to_target or float("inf")
            seed_result[f"one_process_{threads}t_steps"] = one.steps
        torch.set_num_threads(1)  # the controller's own torch: as in python -m pipeline.grpo
        if not args.no_pipeline:
            seed_result.update(_pipeline(args, seed))
        results.append(seed_result)
        baseline = "  ".join(
            f"one process {t} thread{'s' if t > 1 else ''} {seed_result[f'one_process_{t}t_s']:5.1f} s "
            f"({seed_result[f'one_process_{t}t_steps']} steps)"
            for t in args.baseline_threads
        )
        if args.no_pipeline:
            show(f"seed {seed}: {baseline}")
            continue
        r = seed_result
        show(
            f"seed {seed}: pipeline {r['pipeline_s']:5.1f} s to {args.target} ({r['pipeline_steps']} steps, "
            f"start-up {r['startup_s']:.2f} s) | {baseline}"
        )
        show(
            f"         trainer: update {r['train_s']:.1f} s ({r['train_ms']:.0f} ms/step), waiting for rollouts "
            f"{r['wait_s']:.1f} s, publishing {r['publish_s']:.2f} s, the rest (evaluations x{r['evaluations']}, "
            f"reports) {r['training_s'] - r['train_s'] - r['wait_s'] - r['publish_s']:.1f} s; generate "
            f"{r['generate_ms']:.0f} ms/rollout, idle generators {r['generator_idle']:.2f}; staleness mean "
            f"{r['staleness_mean']:.2f} max {r['staleness_max']}; weight sync {r['publish_ms']:.2f} + "
            f"{r['install_ms']:.2f} ms, delivery {r['delivery_ms']:.1f} ms"
        )
    one_s = {t: statistics.median(r[f"one_process_{t}t_s"] for r in results) for t in args.baseline_threads}
    summary: dict[str, Any] = {
        "bench": "grpo",
        "task": f"{args.task}-{args.digits}",
        "model": args.model,
        "device": args.device,
        "transport": args.transport,
        "generators": args.generators,
        "trainer_ranks": args.trainer_ranks,
        "trainer_shard": args.trainer_shard,
        "mode": args.mode,
        "lr": args.lr,
        "kl_coeff": args.kl_coeff,
        "baseline_lr": args.baseline_lr,
        "baseline_kl_coeff": args.baseline_kl_coeff,
        "loss": args.loss,
        "max_staleness": args.max_staleness,
        "target": args.target,
        "seeds": args.seeds,
        "cores": cores,
        **{f"one_process_{t}t_s_to_target": round(s, 2) for t, s in one_s.items()},
    }
    if not args.no_pipeline:
        pipe_s = statistics.median(r["pipeline_s"] for r in results)
        summary["pipeline_s_to_target"] = round(pipe_s, 2)
        summary["ratio_same_cores"] = _ratio(pipe_s, one_s[cores])
        summary["ratio_one_thread"] = _ratio(pipe_s, one_s[min(args.baseline_threads)])
        summary["goal_ratio_same_cores"] = "<= 0.8"
        show(
            f"median over seeds {args.seeds}: pipeline {pipe_s:.1f} s; one process {cores} threads "
            f"{one_s[cores]:.1f} s -> ratio_same_cores {summary['ratio_same_cores']} (goal <= 0.8); "
            f"one thread {one_s[min(args.baseline_threads)]:.1f} s -> {summary['ratio_one_thread']}"
        )
    summary["per_seed"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in results]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
