"""The whole GPU round in one command: the gpu tests, decoding, weight sync, the digit pipeline, a 0.5 B model.

    python benchmarks/gpu_round.py [--wheels .whl] [--out DIR] [--budget 540]
        [--skip tests decode weights digits train hf] [--hf-runs bfloat16:64:12 float32:256:4 ...]

For a GPU machine lent for a few minutes: the whole round keeps within
``--budget`` seconds (540), each step a subprocess whose deadline is the
smaller of its own and what the round has left; a step that fails or runs
out of time is recorded and the round goes on. In order:

1. the wheels the bare GPU image lacks (pyzmq, setproctitle, pytest-asyncio,
   datasets, dill, multiprocess) installed from ``--wheels`` into a folder
   of their own, put on ``PYTHONPATH`` for every later step;
2. ``pytest -m gpu`` (the decode and trainer-rank tests first);
3. ``bench_decode.py``: the built-in engine's completion tokens/s for the
   0.5 B shape below in bfloat16, 256 x 64 tokens, over the dynamic KV cache
   against replayed CUDA graphs, plain and of the step compiled by
   torch.compile, with the compiled batch's busiest operators (issue 40);
4. ``bench_weights.py`` over ``cuda-ipc``: 64 / 1024 / 4096 MiB, float32 and
   bfloat16, alias and copy installs, each row with ``--profile`` (where the
   trainer's stall goes: Python functions, torch operators, CUDA calls);
5. the digit pipeline on the GPU (``--device cuda --transport cuda-ipc``),
   and on a machine with two GPUs again with two sharded trainer ranks
   (``--trainer-ranks 2``: NCCL, one GPU a rank);
6. a random Qwen2 of Qwen2.5-0.5B's shape (494 M parameters, a
   151,936-token vocabulary; built from a config by
   ``examples/tiny_hf_model.py --shape qwen2.5-0.5b``, nothing downloaded)
   trained with the default flags (two generators) for each ``--hf-runs``
   entry ``dtype:completion tokens:steps``: 12 steps of 256 x 64 tokens in
   bfloat16 (the speed figures), and 4 of 256 x 256 in float32 (the
   largest default: does it fit one GPU?); an entry ending ``:compiled``
   runs with ``--compile --decode compiled``. Per run: steps/s, completion
   tokens/s, generate / train / weight-sync milliseconds (medians), the
   update's size, the log-prob mismatch, the trainer's and the generators'
   peak and reserved GPU memory as torch's allocator saw it (``memory/*``
   metrics), and every process's as the driver saw it (``nvidia-smi`` every
   0.25 s, by process title);
7. ``bench_train_step.py`` on the same model, with what the round has left:
   the trainer's update alone (bfloat16, 256 x 64 tokens after the prompts),
   against its body's forward and backward, and the operators that took the
   most device time (issue 40's pipeline target: where the step's time goes);
   beside it the same update with ``--compile`` (blocks and head compiled).

Every step's output is appended to ``<out>/round.log`` and each run's
metrics go to ``<out>/<name>.metrics.jsonl`` (few files: a lent machine
returns at most eight); the summary is rewritten to
``<out>/gpu_round.json`` after every step and printed as one JSON line at
the end. The model and the runs' checkpoints (gigabytes) stay in a scratch
folder that is removed. On a machine without CUDA it prints one line
saying so and exits 0 at once. Staging the wheels: docs/benchmarks.md
("The GPU round").
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_device() -> str | None:
    """The first GPU's name, or None where torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def gpu_count() -> int:
    """How many GPUs torch sees."""
    import torch

    return torch.cuda.device_count()


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


class Round:
    """The round's steps, each a subprocess whose deadline is the smaller of its own and the time the round has left.

    Each step's output is appended to ``<out>/round.log``; the summary is rewritten
    to ``<out>/gpu_round.json`` after every step, so a round cut short still
    leaves what it measured. Large files (the model, checkpoints) go to a
    scratch folder that is removed at the end, not to ``out``.
    """

    def __init__(self, out: str, budget: float, device: str) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget
        self.scratch = tempfile.mkdtemp(prefix="gpu-round-scratch-")
        self.env = dict(os.environ)
        self.summary: dict[str, Any] = {"bench": "gpu_round", "device": device, "budget_s": budget}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], limit: float) -> tuple[int, str]:
        """``command`` for at most ``limit`` s (or what is left); its exit code (124 when stopped) and output."""
        timeout = min(limit, self.left())
        if timeout < 5:
            print(f"[  skip  ] {name}: the round's budget is spent", flush=True)
            return 125, "not run: the round's budget was spent"
        started = time.perf_counter()
        # a session of its own: a step stopped at its deadline takes its children (a test's
        # pipeline, a run's actors) with it instead of leaving them on the GPU for the next step
        child = subprocess.Popen(
            command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            output, _ = child.communicate(timeout=timeout)
            code, text = child.returncode, _text(output)
        except subprocess.TimeoutExpired:
            code = 124
            output = _stop_group(child)
            text = f"{_text(output)}\n[gpu_round: stopped after {timeout:.0f} s]"
        with open(os.path.join(self.out, "round.log"), "a") as f:
            f.write(f"===== {name} (rc={code}) =====\n{text}\n")
        print(f"[{time.perf_counter() - started:6.1f} s] rc={code} {name}", flush=True)
        return code, text

    def record(self, name: str, value: Any) -> None:
        self.summary[name] = value
        with open(os.path.join(self.out, "gpu_round.json"), "w") as f:
            f.write(json.dumps(self.summary) + "\n")

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _stop_group(child: subprocess.Popen[bytes]) -> bytes:
    """SIGTERM to ``child``'s whole process group, SIGKILL 10 s later if it is still there; what it printed."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            output, _ = child.communicate(timeout=grace)
            return output
        except subprocess.TimeoutExpired:
            continue
    return b""


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
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a last line cut short by a stopped run
                break
    if not rows:
        return {"steps": 0}
    seconds = rows[-1]["time"]

    def median(name: str) -> float | None:
        values = [r[name] for r in rows if r.get(name) is not None]
        return float(f"{statistics.median(values):.4g}") if values else None  # 4 significant digits

    def highest(name: str) -> float | None:
        values = [r[name] for r in rows if r.get(name) is not None]
        return round(max(values), 3) if values else None

    # steady state: the median time between steps (steps/s over the whole run counts the start: processes, the
    # model's load, the first graph capture — 18 s of a 32 s run of 12 steps on an H100)
    gaps = [later["time"] - earlier["time"] for earlier, later in itertools.pairwise(rows)]
    step_s = statistics.median(gaps) if gaps else None
    return {
        "steps": len(rows),
        "seconds": round(seconds, 2),
        "steps_per_s": round(len(rows) / seconds, 3) if seconds else None,
        "steady_steps_per_s": round(1 / step_s, 3) if step_s else None,
        "tokens_per_s": round(sum(r["tokens/step"] for r in rows) / seconds, 1) if seconds else None,
        "generate_ms": median("timing/generate_ms"),
        "train_ms": median("timing/train_ms"),
        "sync_ms": median("timing/weight_sync_ms"),
        "update_mb": median("weights/update_mb"),
        "logp_mismatch": median("mismatch/logp_abs"),
        "score": rows[-1].get("score"),
        "trainer_peak_gpu_gb": highest("memory/trainer_peak_gpu_gb"),
        "generator_peak_gpu_gb": highest("memory/generator_peak_gpu_gb"),
        "trainer_reserved_gpu_gb": highest("memory/trainer_reserved_gpu_gb"),
        "generator_reserved_gpu_gb": highest("memory/generator_reserved_gpu_gb"),
    }


class HfRun(NamedTuple):
    """One ``--hf-runs`` entry: the run's dtype, completion tokens and steps, and whether it compiles (``--compile``
    for the trainer and the reference, ``--decode compiled`` for the generators)."""

    dtype: str
    tokens: int
    steps: int
    compiled: bool = False

    @property
    def name(self) -> str:
        return f"hf_{self.dtype}_{self.tokens}" + ("_compiled" if self.compiled else "")

    @property
    def flags(self) -> list[str]:
        return ["--compile", "--decode", "compiled"] if self.compiled else []


def hf_run(text: str) -> HfRun:
    """``dtype:tokens:steps[:compiled]`` (``bfloat16:64:20``, ``bfloat16:64:12:compiled``); argparse's error else."""
    parts = text.split(":")
    if (
        len(parts) not in (3, 4)
        or parts[0] not in ("bfloat16", "float32")
        or not all(p.isdigit() for p in parts[1:3])
        or parts[3:] not in ([], ["compiled"])
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: expected dtype:tokens:steps[:compiled], dtype bfloat16 or float32")
    return HfRun(parts[0], int(parts[1]), int(parts[2]), len(parts) == 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="folder of wheels to install first")
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-round-"))
    parser.add_argument("--budget", type=float, default=540, help="seconds the whole round may take (default 540)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["tests", "decode", "weights", "digits", "train", "hf"]
    )
    parser.add_argument(
        "--hf-runs",
        nargs="+",
        type=hf_run,
        default=[hf_run("bfloat16:64:12"), hf_run("float32:256:4")],
        help="the 0.5 B-shaped model's runs, each dtype:completion tokens:steps[:compiled] (default "
        "bfloat16:64:12 float32:256:4; bfloat16:64:12:compiled runs with --compile --decode compiled)",
    )
    args = parser.parse_args()
    device = cuda_device()
    if device is None:
        print("gpu_round: no CUDA device here (torch.cuda.is_available() is False): nothing to run")
        return 0
    os.makedirs(args.out, exist_ok=True)
    round_ = Round(args.out, args.budget, device)
    try:
        play(round_, args)
    finally:
        round_.close()
    print(json.dumps(round_.summary))
    return 0


def play(round_: Round, args: argparse.Namespace) -> None:
    """The round's steps, in order; each one's outcome recorded as it ends."""
    python = sys.executable
    site = os.path.join(round_.scratch, "site")
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if wheels:
        pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        code, _ = round_.run("wheels", [*pip, "--target", site, *wheels], 120)
        round_.record("wheels", {"installed": len(wheels), "rc": code})
    paths = [site if wheels else "", ROOT, os.environ.get("PYTHONPATH", "")]
    round_.env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1")

    if "tests" not in args.skip:
        # the newest GPU tests first (the decode graphs, the NCCL ranks): a step stopped at its limit keeps them
        first = ["tests/pipeline/test_decoding.py", "tests/pipeline/test_data_parallel.py", "tests"]
        pytest = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--durations=8", *first]
        code, text = round_.run("pytest_gpu", pytest, 260)
        lines = text.strip().splitlines()
        tail = [line for line in lines if " passed" in line or " failed" in line or " error" in line]
        failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR ")) and " " in line]
        slowest = [line for line in lines if re.match(r"\d+\.\d+s (call|setup|teardown) ", line)]
        summary = {"rc": code, "result": tail[-1] if tail else text[-300:], "failed": failed, "slowest": slowest[:8]}
        round_.record("pytest_gpu", summary)

    if "decode" not in args.skip:  # issue 40: the built-in engine's decode, dynamic cache against CUDA graphs
        shape = ["--shape", "qwen2.5-0.5b", "--dtype", "bfloat16", "--prompts", "32", "--group", "8"]
        bench = [
            python,
            "benchmarks/bench_decode.py",
            "--device",
            "cuda",
            *shape,
            "--new-tokens",
            "64",
            "--repeat",
            "3",
            "--paths",
            "dynamic",
            "graphs",
            "compiled",
            "--profile",
        ]
        code, text = round_.run("bench_decode", bench, 200)
        lines = [line for line in text.splitlines() if line.startswith("{")]
        round_.record("bench_decode", json.loads(lines[-1]) if code == 0 and lines else {"rc": code})

    if "weights" not in args.skip:
        sizes = ["--mb", "64", "1024", "4096", "--dtype", "float32", "bfloat16", "--install", "alias", "copy"]
        bench = [python, "benchmarks/bench_weights.py", "--transport", "cuda-ipc", "--device", "cuda", *sizes]
        code, text = round_.run("bench_weights", [*bench, "--json", "--profile"], 120)
        lines = [line for line in text.splitlines() if line.startswith("{")]
        round_.record("bench_weights", json.loads(lines[-1]) if code == 0 and lines else {"rc": code})

    def train(name: str, flags: list[str], limit: float) -> dict[str, Any]:
        """``python -m pipeline.grpo`` on the GPU over cuda-ipc with ``flags``: its figures and peak GPU memory."""
        run_dir = os.path.join(round_.scratch, name)
        # not --quiet: the progress lines go to round.log
        command = [python, "-m", "pipeline.grpo", "--device", "cuda", "--transport", "cuda-ipc"]
        with GpuMemory() as memory:
            code, _ = round_.run(name, [*command, "--report-to", "none", "--run-dir", run_dir, *flags], limit)
        figures = pipeline_figures(run_dir)
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(round_.out, f"{name}.metrics.jsonl"))
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint is gigabytes for a 0.5 B model
        return {"rc": code, **figures, "peak_gpu_gb": memory.peaks}

    if "digits" not in args.skip:
        round_.record("digits", train("digits", [], 90))
        if gpu_count() >= 2:  # issue 39: the trainer as two NCCL ranks, one GPU each, sharded (FSDP2)
            ranks = ["--trainer-ranks", "2", "--trainer-shard", "fsdp"]
            round_.record("digits_2_ranks", train("digits-2-ranks", ranks, 90))
        else:
            round_.record("digits_2_ranks", {"rc": None, "why": "one GPU: two trainer ranks need a GPU each"})

    if "hf" not in args.skip or "train" not in args.skip:
        folder = os.path.join(round_.scratch, "qwen-shape")
        build = [python, "examples/tiny_hf_model.py", folder, "--shape", "qwen2.5-0.5b", "--rows", "2000"]
        code, _ = round_.run("build_model", build, 150)
    if "hf" not in args.skip:
        task = [
            *("--model", os.path.join(folder, "model"), "--dataset", os.path.join(folder, "train.jsonl")),
            *("--reward", os.path.join(folder, "rewards.py") + ":reversed_digits", "--target-score", "none"),
            *("--eval-size", "64", "--lr", "1e-6", "--save-every", "0"),
        ]
        for run in args.hf_runs:
            if code != 0:
                round_.record(run.name, {"rc": code, "why": "the model could not be built"})
                continue
            length = ["--max-new-tokens", str(run.tokens), "--steps", str(run.steps), "--eval-every", str(run.steps)]
            flags = [*task, *length, "--dtype", run.dtype, *run.flags]
            figures = train(run.name.replace("_", "-"), flags, 200)
            round_.record(run.name, {"completion_tokens": run.tokens, "compiled": run.compiled, **figures})

    if "train" not in args.skip:  # issue 40: where a trainer step's time goes, without generators beside it
        shape = ["--dtype", "bfloat16", "--prompts", "32", "--group", "8", "--new-tokens", "64"]
        bench = [python, "benchmarks/bench_train_step.py", "--model", folder, "--device", "cuda", *shape]
        bench += ["--profile", "--compile"]  # beside the eager update, one with --compile
        train_code, text = round_.run("bench_train_step", bench, 150) if code == 0 else (code, "")
        lines = [line for line in text.splitlines() if line.startswith("{")]
        round_.record("bench_train_step", json.loads(lines[-1]) if train_code == 0 and lines else {"rc": train_code})


if __name__ == "__main__":
    raise SystemExit(main())
