"""Wall time to a held-out target for each staleness bound K: what ``--max-staleness`` costs and buys.

    python benchmarks/bench_staleness.py [--bounds 0 1 2 4] [--seeds 0 1 2] [--plot docs/staleness.png]

For each K and seed, runs the pipeline as ``python -m pipeline.grpo
--max-staleness K`` runs it (start-up included) until ``--target``
held-out exact match, and prints the wall time, the steps, the mean lag of
the trained rollouts and the trainer's idle share. K = 0 is on-policy (each
rollout is drawn with the weights of the step just trained, so generation
and training take turns); a larger K lets them overlap. The raw baseline,
measured in the same run, is K = 0: each K's median is also given as a
ratio to it. Ends with one JSON line; ``--plot`` draws the held-out curves
against wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

import uvloop

from pipeline import Config, run_pipeline
from pipeline.run import read_rows


def _run(args: argparse.Namespace, bound: int, seed: int) -> dict[str, Any]:
    config = Config(
        steps=args.steps,
        target_score=args.target,
        seed=seed,
        max_staleness=bound,
        lr=args.lr,
        kl_coeff=args.kl_coeff,
        run_dir=tempfile.mkdtemp(prefix=f"bench-staleness-{bound}-"),
    )
    result = uvloop.run(run_pipeline(config, quiet=True))
    rows = read_rows(config.run_dir)
    curve = [(result.startup_seconds + r["time"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {
        "bound": bound,
        "seed": seed,
        "seconds": result.startup_seconds + result.seconds if result.target_reached else float("inf"),
        "steps": result.steps,
        "lag_mean": statistics.mean(r["staleness/lag"] for r in rows),
        "lag_max": max(r["staleness/lag"] for r in rows),
        "trainer_idle": statistics.median(r["perf/trainer_idle_ratio"] for r in rows[len(rows) // 4 :]),
        "dropped": result.dropped,
        "curve": curve,
    }


def _plot(path: str, runs: list[dict[str, Any]], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bounds = sorted({run["bound"] for run in runs})
    for colour, bound in zip(colours, bounds, strict=False):
        for i, run in enumerate(r for r in runs if r["bound"] == bound):
            label = f"K = {bound}" if i == 0 else None
            ax.plot(*zip(*run["curve"], strict=True), color=colour, marker=".", linewidth=1, label=label)
    ax.axhline(target, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("wall time since the run started (s)")
    ax.set_ylabel("held-out exact match")
    ax.set_title("reverse-6: held-out accuracy by staleness bound (one line per seed)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--target", type=float, default=0.99)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, help="default: the task's")
    parser.add_argument("--kl-coeff", type=float, help="default: the task's")
    parser.add_argument("--plot", help="write the held-out curves to this PNG")
    args = parser.parse_args()
    runs = [_run(args, bound, seed) for bound in args.bounds for seed in args.seeds]
    print("  K  seed  seconds  steps  lag mean/max  trainer idle")
    for run in runs:
        print(
            f"{run['bound']:>3}  {run['seed']:>4}  {run['seconds']:7.2f}  {run['steps']:>5}  "
            f"{run['lag_mean']:5.2f}/{run['lag_max']:<3}  {run['trainer_idle']:.2f}"
        )
    medians = {bound: statistics.median(r["seconds"] for r in runs if r["bound"] == bound) for bound in args.bounds}
    raw = medians[args.bounds[0]]
    ratios = {bound: seconds / raw if raw != float("inf") else None for bound, seconds in medians.items()}
    for bound, seconds in medians.items():
        steps = statistics.median(r["steps"] for r in runs if r["bound"] == bound)
        ratio = f"{ratios[bound]:.2f}x" if ratios[bound] is not None else "n/a (the first bound missed the target)"
        print(f"K = {bound}: median {seconds:.2f} s, {steps:.0f} steps; {ratio} K = {args.bounds[0]}")
    if args.plot:
        _plot(args.plot, runs, args.target)
    print(
        json.dumps(
            {
                "bench": "staleness",
                "target": args.target,
                "seeds": args.seeds,
                "lr": args.lr,
                "kl_coeff": args.kl_coeff,
                "median_seconds": {str(k): round(v, 2) for k, v in medians.items()},
                "ratio_to_first": {str(k): None if v is None else round(v, 3) for k, v in ratios.items()},
                "runs": [{k: v for k, v in r.items() if k != "curve"} for r in runs],
            }
        )
    )


if __name__ == "__main__":
    main()
