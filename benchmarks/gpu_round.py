"""The whole GPU round in one command: the gpu tests, weight sync, the digit pipeline, a 0.5 B-shaped model.

    python benchmarks/gpu_round.py [--wheels .whl] [--out DIR] [--steps 20]

For a GPU machine lent for a few minutes (budget: under 8 minutes). In
order, each step a subprocess with a deadline, a failure recorded and the
round going on:

1. the wheels the bare GPU image lacks (pyzmq, setproctitle, pytest-asyncio,
   datasets, dill, multiprocess, ...) installed from ``--wheels`` into a
   folder of their own, put on ``PYTHONPATH`` for every later step;
2. ``pytest -m gpu``;
3. ``bench_weights.py`` over ``cuda-ipc``: 64 / 1024 / 4096 MiB, float32 and
   bfloat16, alias and copy installs;
4. the digit pipeline on the GPU (``--device cuda --transport cuda-ipc``);
5. a random Qwen2 of Qwen2.5-0.5B's shape (494 M parameters, a
   151,936-token vocabulary; built from a config by
   ``examples/tiny_hf_model.py --shape qwen2.5-0.5b``, nothing downloaded)
   trained for ``--steps`` steps of 256 x 64 tokens with the default
   flags, in float32 and with ``--dtype bfloat16``: steps/s, completion
   tokens/s, generate / train / weight-sync milliseconds (medians), the
   update's size, and each role's peak GPU memory (sampled from
   ``nvidia-smi`` every 0.25 s, by process title).

Prints each step's outcome as it ends and one JSON summary line last (also
written to ``<out>/gpu_round.json``). On a machine without CUDA it prints
one line saying so and exits 0 at once. Staging the wheels is described in
docs/benchmarks.md ("The GPU round").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(tempfile.gettempdir(), "gpu-round-site")


def cuda_device() -> str | None:
    """The first GPU's name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def environment(extra_path: list[str]) -> dict[str, str]:
    paths = [*extra_path, ROOT, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1")


def run(command: list[str], env: dict[str, str], timeout: float, log: str) -> tuple[int, str]:
    """``command`` with a deadline; its exit code (124 past the deadline) and output, also written to ``log``."""
    started = time.perf_counter()
    try:
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        text = f"{exc.stdout or ''}{exc.stderr or ''}\n[gpu_round: stopped after {timeout:g} s]"
        text = text if isinstance(text, str) else text.decode(errors="replace")
    with open(log, "w") as f:
        f.write(text)
    print(f"[{time.perf_counter() - started:6.1f} s] rc={code} {' '.join(command[1:4])}", flush=True)
    return code, text


class GpuMemory:
    """Peak GPU memory of each process, by its title (``actors[trainer] trainer``), from ``nvidia-smi``."""

    def __init__(self, every: float = 0.25) -> None:
        self.every = every
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.every):
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=5, check=False).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in lines.strip().splitlines():
                pid, _, used = (part.strip() for part in line.partition(","))
                if not (pid.isdigit() and used.isdigit()):
                    continue
                title = self._title(int(pid))
                self.peaks[title] = max(self.peaks.get(title, 0.0), int(used) / 1024)

    @staticmethod
    def _title(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().replace(b"\0", b" ").decode(errors="replace").split()
        except OSError:
            return f"pid {pid}"
        title = " ".join(words[:2]) if words and words[0].startswith("actors[") else " ".join(words[:3])
        return title or f"pid {pid}"


def pipeline_figures(run_dir: str) -> dict[str, Any]:
    """Throughput and timings of a finished run, from its metrics.jsonl."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {"steps": 0}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return {"steps": 0}
    seconds = rows[-1]["time"]

    def median(name: str) -> float | None:
        values = [r[name] for r in rows if r.get(name) is not None]
        return float(f"{statistics.median(values):.4g}") if values else None  # 4 significant digits

    return {
        "steps": len(rows),
        "seconds": round(seconds, 2),
        "steps_per_s": round(len(rows) / seconds, 3) if seconds else None,
        "tokens_per_s": round(sum(r["tokens/step"] for r in rows) / seconds, 1) if seconds else None,
        "generate_ms": median("timing/generate_ms"),
        "train_ms": median("timing/train_ms"),
        "sync_ms": median("timing/weight_sync_ms"),
        "update_mb": median("weights/update_mb"),
        "logp_mismatch": median("mismatch/logp_abs"),
        "score": rows[-1].get("score"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="folder of wheels to install first")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-round-"))
    parser.add_argument("--steps", type=int, default=20, help="steps of the 0.5 B-shaped model per dtype")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "weights", "digits", "hf"])
    args = parser.parse_args()
    device = cuda_device()
    if device is None:
        print("gpu_round: no CUDA device here (torch.cuda.is_available() is False): nothing to run")
        return 0
    os.makedirs(args.out, exist_ok=True)
    summary: dict[str, Any] = {"bench": "gpu_round", "device": device}
    extra: list[str] = []
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if wheels:
        code, text = run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--upgrade",
                "--target",
                SITE,
                *wheels,
            ],
            dict(os.environ),
            180,
            os.path.join(args.out, "wheels.log"),
        )
        summary["wheels"] = {"installed": len(wheels), "rc": code}
        extra.append(SITE)
    env = environment(extra)
    python = sys.executable

    if "tests" not in args.skip:
        code, text = run(
            [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
            env,
            200,
            os.path.join(args.out, "pytest_gpu.log"),
        )
        tail = [line for line in text.strip().splitlines() if " passed" in line or " failed" in line]
        failed = [line.split()[1] for line in text.splitlines() if line.startswith("FAILED ")]
        summary["pytest_gpu"] = {"rc": code, "result": tail[-1] if tail else text[-300:], "failed": failed}

    if "weights" not in args.skip:
        code, text = run(
            [
                python,
                "benchmarks/bench_weights.py",
                "--transport",
                "cuda-ipc",
                "--device",
                "cuda",
                "--mb",
                "64",
                "1024",
                "4096",
                "--dtype",
                "float32",
                "bfloat16",
                "--install",
                "alias",
                "copy",
                "--json",
            ],
            env,
            150,
            os.path.join(args.out, "bench_weights.log"),
        )
        lines = [line for line in text.splitlines() if line.startswith("{")]
        summary["bench_weights"] = json.loads(lines[-1]) if code == 0 and lines else {"rc": code}

    def train(name: str, flags: list[str], timeout: float) -> dict[str, Any]:
        """``python -m pipeline.grpo`` on the GPU over cuda-ipc with ``flags``: its figures and peak GPU memory."""
        run_dir = os.path.join(args.out, name)
        command = [python, "-m", "pipeline.grpo", "--device", "cuda", "--transport", "cuda-ipc", "--quiet"]
        with GpuMemory() as memory:
            code, _ = run(
                [*command, "--report-to", "none", "--run-dir", run_dir, *flags],
                env,
                timeout,
                os.path.join(args.out, f"{name}.log"),
            )
        return {"rc": code, **pipeline_figures(run_dir), "peak_gpu_gb": memory.peaks}

    if "digits" not in args.skip:
        summary["digits"] = train("digits", [], 120)

    if "hf" not in args.skip:
        folder = os.path.join(args.out, "qwen-shape")
        code, _ = run(
            [python, "examples/tiny_hf_model.py", folder, "--shape", "qwen2.5-0.5b", "--rows", "2000"],
            env,
            180,
            os.path.join(args.out, "build_model.log"),
        )
        task = [
            *("--model", os.path.join(folder, "model"), "--dataset", os.path.join(folder, "train.jsonl")),
            *("--reward", os.path.join(folder, "rewards.py") + ":reversed_digits", "--max-new-tokens", "64"),
            *("--steps", str(args.steps), "--target-score", "none", "--eval-every", str(args.steps)),
            *("--eval-size", "64", "--lr", "1e-6"),
        ]
        for dtype in ("float32", "bfloat16"):
            if code != 0:
                summary[f"hf_{dtype}"] = {"rc": code, "why": "the model could not be built"}
            else:
                summary[f"hf_{dtype}"] = train(f"hf-{dtype}", [*task, "--dtype", dtype], 200)

    line = json.dumps(summary)
    with open(os.path.join(args.out, "gpu_round.json"), "w") as f:
        f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
