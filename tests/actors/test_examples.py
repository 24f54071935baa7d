"""Every example runs as a real program, exits 0 and prints what it promises."""

from __future__ import annotations

import os

import pytest
from harness import ROOT, last_json, run_python


@pytest.mark.parametrize(
    "script, expected",
    [
        ("ping_pong.py", ["pong (pid", "1000 actor-to-actor round trips"]),
        ("fan_in_pipeline.py", ["producer 2: total 39600", "expected per producer: 39600"]),
        (
            "custom_actor.py",
            ["plain: [3, 3]", "skip: [115, 115]", "skip after reset: [5, 5]", "SkipCounter stopping at 5"],
        ),
        ("embed_tcp_service.py", ["serving on 127.0.0.1:", "scored 'request 4'"]),
        ("grpo_ports.py", ["step  60", "drained generators [0, 1, 2, 3]", "training finished at step 60"]),
        (
            "supervised_workers.py",
            [
                "restarted (restart 1 of rank 0)",
                "in-flight call: ActorDied",
                "restarts per rank: [1, 0]",
                "within 0.5s",
            ],
        ),
    ],
)
def test_example_runs(script, expected):
    proc = run_python(os.path.join(ROOT, "examples", script), timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in expected:
        assert text in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "transport, mode", [("shm", "copy"), ("shm", "alias"), ("local", "copy"), ("cuda-ipc", "copy")]
)
def test_weights_benchmark_prints_its_json_line(transport, mode):

    device = "cuda" if transport == "cuda-ipc" else "cpu"
    flags = ["--transport", transport, "--device", device, "--mb", "8", "--updates", "2", "--install", mode]
    proc = run_python(os.path.join(ROOT, "benchmarks", "bench_weights.py"), *flags, "--json", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = last_json(proc.stdout)
    assert result["transport"] == transport and result["status"] in ("pass", "blocked")
    if result["status"] == "blocked":
        assert transport == "cuda-ipc" and "CUDA" in result["reason"]
        return
    (row,) = result["rows"]
    assert row["tensor_count"] > 8, "a model-shaped state_dict, not one blob"
    assert 7 < row["mib"] < 9 and row["install"] == mode
    for key in ("trainer_stall_ms", "import_ms", "install_ms", "publish_to_installed_ms", "copy_ms", "ratio"):
        assert row[key] > 0, key
    assert 0 <= row["call_ms"] < row["publish_to_installed_ms"]


def test_weights_benchmark_profiles_where_the_publishers_and_the_consumers_time_goes():
    flags = ["--transport", "shm", "--mb", "8", "--updates", "2", "--install", "alias", "--profile", "--json"]
    proc = run_python(os.path.join(ROOT, "benchmarks", "bench_weights.py"), *flags, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = last_json(proc.stdout)["rows"]
    found = row["profile"]
    assert found["updates"] == 5 and len(found["python"]) == 10 and isinstance(found["torch_host"], list)
    assert all(entry["ms"] >= 0 and entry["function"] for entry in found["python"])
    consumer = [entry["function"] for entry in found["consumer"]]  # the installs, profiled in the consumer's process
    assert len(consumer) == 10 and any("_install" in function for function in consumer), consumer
    assert row["ack_ms"] >= 0
