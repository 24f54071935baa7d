"""Placing pipeline roles on devices: per-role flags, and one clear line when CUDA is missing."""

from __future__ import annotations

import pytest
import torch
from harness import actor_pids
from test_pipeline import cli

from pipeline import Config, run_pipeline
from pipeline.grpo import parse_args
from pipeline.run import PlacementError, check_placement, read_rows

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA path")


@no_cuda
@pytest.mark.parametrize(
    "flags, named",
    [
        (["--device", "cuda"], "--device cuda needs CUDA"),
        (["--trainer-device", "cuda:0"], "--trainer-device cuda:0 needs CUDA"),
        (["--generator-device", "cuda:1"], "--generator-device cuda:1 needs CUDA"),
        (["--transport", "cuda-ipc"], "--transport cuda-ipc needs CUDA"),
    ],
)
def test_a_gpu_request_without_cuda_is_one_clear_line(tmp_path, flags, named):
    before = actor_pids()
    proc = cli(*flags, "--steps", "5", "--run-dir", str(tmp_path / "run"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "CUDA" in lines[0], err
    assert "Traceback" not in err
    assert actor_pids() == before, "nothing was started"


def test_flags_place_each_role():
    config, _ = parse_args(["--device", "cpu", "--generator-device", "cuda:1", "--ref-device", "cuda"])
    assert config.device_of("trainer") == "cpu" and config.device_of("scorer") == "cpu"
    assert config.device_of("generator") == "cuda:1" and config.device_of("ref") == "cuda"
    assert parse_args([])[0].device_of("generator") == "cpu", "the default is the CPU"


@pytest.mark.parametrize(
    "config, match",
    [
        (Config(device="mps"), "only cpu and cuda"),
        (Config(device="nonsense:x"), "not a device"),
        (Config(install="mirror"), "copy or alias"),
        (Config(transport="carrier-pigeon"), "unknown transport"),
    ],
)
def test_bad_placements_are_refused_before_anything_starts(config, match):
    with pytest.raises(PlacementError, match=match):
        check_placement(config)


@no_cuda
def test_alias_installs_need_the_generators_where_the_weights_live():
    assert check_placement(Config(install="alias"))["generator"] == torch.device("cpu"), "shm slots are host memory"


async def test_generators_can_alias_the_shared_slots(tmp_path, sockets_dir):
    config = Config(steps=60, install="alias", run_dir=str(tmp_path))
    result = await run_pipeline(config, quiet=True)
    rows = read_rows(str(tmp_path))
    assert result.steps == 60 and len(rows) == 60
    assert max(r["staleness/lag"] for r in rows) <= config.max_staleness
