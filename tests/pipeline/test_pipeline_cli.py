"""The pipeline as a user runs it: the custom-task example, a quiet normal run, and on a GPU (``-m gpu``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import pytest
import torch
from harness import ROOT, last_json, run_python

# The folders the subprocesses import from, before whatever PYTHONPATH already holds (a pip --target folder, say).
ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(p for p in [os.path.dirname(__file__), ROOT, os.environ.get("PYTHONPATH", "")] if p),
)


SECOND_CTRL_C = """
import asyncio, os, signal
import uvloop
from pipeline.run import _launcher

async def run():
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C
        await asyncio.wait_for(asyncio.Event().wait(), 30)
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # a second one, while the run cleans up
        await _launcher._to_the_end(asyncio.sleep(0.2))  # a step of the clean-up (the processes' stop)
        print("cleaned up", flush=True)

try:
    uvloop.run(_launcher._until_terminated(run()))
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_second_ctrl_c_cancels_the_clean_up_it_lands_in_instead_of_raising_there():
    """asyncio's own handler made a second Ctrl-C a ``KeyboardInterrupt`` raised wherever the thread was: in the
    middle of the clean-up (the processes' stop, the metrics log's close), cutting it short. Each Ctrl-C is a
    cancel now, which the clean-up's steps take back; the run still ends as interrupted (exit 130)."""
    proc = run_python("-c", SECOND_CTRL_C, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["cleaned", "up", "interrupted"], proc.stdout + proc.stderr


def test_the_custom_task_example_trains_and_prints_its_score():
    proc = run_python(os.path.join(ROOT, "examples", "custom_task.py"), timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "custom task: 1500 steps, normalized score" in proc.stdout, proc.stdout + proc.stderr


def test_a_normal_run_prints_no_warning_even_with_warnings_as_errors(tmp_path):
    flags = ["--steps", "50", "--quiet", "--run-dir", str(tmp_path / "run")]
    out = run_python("-W", "error", "-m", "pipeline.grpo", *flags, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", f"stderr of a normal run: {out.stderr}"


@pytest.mark.gpu
def test_the_pipeline_trains_on_the_gpu_over_cuda_ipc(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--device", "cuda", "--transport", "cuda-ipc", "--steps", "400", "--quiet", "--run-dir", str(run_dir)]
    out = run_python("-m", "pipeline.grpo", *flags, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "target 0.99 reached" in out.stdout, out.stdout
    assert (run_dir / "metrics.jsonl").exists()


@pytest.mark.gpu
def test_the_300m_preset_runs_on_the_gpu_and_reports_its_pace(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--model", "gpu-300m", "--device", "cuda", "--transport", "cuda-ipc", "--steps", "5"]
    out = run_python(
        "-m", "pipeline.grpo", *flags, "--target-score", "none", "--quiet", "--run-dir", str(run_dir), timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(r["perf/tokens_trained_per_s"] > 0 for r in rows)
    assert all(r["timing/publish_ms"] > 0 for r in rows)


def test_the_train_step_benchmark_times_the_update_against_its_body_and_lists_operators():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    flags = ["--prompts", "2", "--group", "2", "--new-tokens", "3", "--repeat", "1", "--profile", "--top", "3"]
    proc = run_python(os.path.join(ROOT, "benchmarks", "bench_train_step.py"), *flags, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = last_json(proc.stdout)
    assert record["bench"] == "train_step" and record["rows"] == 4 and record["tokens"] % 4 == 0
    assert record["step_ms"] > 0 and record["raw_body_ms"] > 0 and record["ratio"] > 0
    assert len(record["top_ops"]) == 3 and all(op["op"] and op["ms"] >= 0 for op in record["top_ops"])


def test_the_decode_benchmark_profiles_the_last_path_by_device_and_by_host_time():
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    flags = ["--shape", "tiny", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--repeat", "1"]
    proc = run_python(
        os.path.join(ROOT, "benchmarks", "bench_decode.py"), *flags, "--profile", "--top", "3", timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = last_json(proc.stdout)
    assert record["static_same_tokens"] and record["profile"]["path"] == "static"
    for column in ("by_device", "by_host"):
        assert len(record["profile"][column]) == 3 and all(op["ms"] >= 0 for op in record["profile"][column])


@pytest.mark.parametrize("bench", ["bench_decode.py", "bench_train_step.py"])
def test_a_profile_of_no_operators_is_refused_in_one_line(bench):
    proc = run_python(os.path.join(ROOT, "benchmarks", bench), "--profile", "--top", "0", timeout=60)
    assert proc.returncode == 2 and "--top 0: list at least one operator" in proc.stderr.splitlines()[-1]


def gpu_round_module() -> Any:
    """benchmarks/gpu_round.py as a module (a script, not a package's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_round", os.path.join(ROOT, "benchmarks", "gpu_round.py"))
    assert spec is not None and spec.loader is not None
    gpu_round = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_round)
    return gpu_round


def test_the_gpu_rounds_pipeline_figures_leave_the_start_out_of_the_steady_pace(tmp_path):
    """Steps/s over the whole run counts the processes' start; the steady figure is one over the median gap."""
    gpu_round = gpu_round_module()
    times = [18.0, 19.0, 20.0, 21.0, 24.0]  # the first step after an 18 s start; an evaluation in the last
    rows = [{"step": i + 1, "time": t, "tokens/step": 100} for i, t in enumerate(times)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"cut')
    figures = gpu_round.pipeline_figures(str(tmp_path))
    assert figures["steps"] == 5 and figures["steps_per_s"] == round(5 / 24, 3)
    assert figures["steady_steps_per_s"] == 1.0


def test_the_gpu_rounds_model_runs_say_whether_they_compile_and_refuse_a_malformed_one():
    gpu_round = gpu_round_module()
    plain = gpu_round.hf_run("bfloat16:64:12")
    assert plain == ("bfloat16", 64, 12, False) and plain.name == "hf_bfloat16_64" and plain.flags == []
    compiled = gpu_round.hf_run("bfloat16:64:12:compiled")
    assert compiled.name == "hf_bfloat16_64_compiled" and compiled.flags == ["--compile", "--decode", "compiled"]
    for wrong in ("bfloat16:64", "float16:64:12", "bfloat16:64:12:fast", "bfloat16:x:12", "bfloat16:64:12:compiled:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected dtype:tokens:steps"):
            gpu_round.hf_run(wrong)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU round runs whole on a GPU machine")
def test_the_gpu_round_ends_at_once_with_one_line_without_cuda():
    out = run_python(os.path.join(ROOT, "benchmarks", "gpu_round.py"), timeout=60, env=ENV)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.splitlines() == [
        "gpu_round: no CUDA device here (torch.cuda.is_available() is False): nothing to run"
    ]


@pytest.mark.gpu
@pytest.mark.parametrize(("engine", "dtype"), [("builtin", "bfloat16"), ("hf", "float32")])
def test_a_hugging_face_model_trains_on_the_gpu_with_each_engine_and_dtype(tmp_path, engine, dtype):
    """The user's path on a GPU: a Hugging Face model, the CUDA generators' engines, the run's dtype end to end."""
    folder = tmp_path / "tiny"
    built = run_python(
        os.path.join(ROOT, "examples", "tiny_hf_model.py"), str(folder), "--rows", "200", timeout=120, env=ENV
    )
    assert built.returncode == 0, built.stderr
    run_dir = tmp_path / "run"
    flags = [
        *("--model", str(folder / "model"), "--dataset", str(folder / "train.jsonl")),
        *("--reward", f"{folder / 'rewards.py'}:reversed_digits", "--max-new-tokens", "5", "--steps", "12"),
        *("--engine", engine, "--dtype", dtype, "--kl-coeff", "0.02", "--eval-every", "6", "--eval-size", "16"),
        *("--device", "cuda", "--transport", "cuda-ipc", "--quiet", "--report-to", "none", "--run-dir", str(run_dir)),
    ]
    out = run_python("-m", "pipeline.grpo", *flags, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(r["actor/loss"] == r["actor/loss"] for r in rows)
    sizes = {r["weights/update_mb"] for r in rows}
    assert len(sizes) == 1 and sizes.pop() > 0
    assert all(r["memory/trainer_peak_gpu_gb"] > 0 and r["memory/generator_peak_gpu_gb"] > 0 for r in rows)
    # the generators' allocator grows segments in place: what it reserves stays near what it holds
    reserved = [(r["memory/generator_peak_gpu_gb"], r["memory/generator_reserved_gpu_gb"]) for r in rows]
    assert all(peak <= held <= 2 * peak + 1 for peak, held in reserved), reserved
