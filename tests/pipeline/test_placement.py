"""Placing pipeline roles on devices: per-role flags, and one clear line when CUDA is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness import actor_pids
from test_pipeline import cli

from actors._processes._devices import visible_gpus
from pipeline import Config, run_pipeline
from pipeline.grpo import parse_args
from pipeline.run import PlacementError, check_alias_across_hosts, check_placement, read_rows

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
def test_under_ray_gpu_placements_are_left_to_the_hosts_the_roles_run_on(monkeypatch):
    """A run launched from a machine without GPUs (a login node) onto a Ray cluster's GPU nodes: the devices are
    checked by each role's host as it starts, not against the launching machine's (none, here). A device that is
    no device is still refused at once."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(PlacementError, match="needs CUDA"):
        check_placement(Config(device="cuda"))
    devices = check_placement(Config(device="cuda:1", ray="auto", transport="cuda-ipc", trainer_ranks=2))
    assert devices["trainer"] == torch.device("cuda", 1)
    with pytest.raises(PlacementError, match="not a device"):
        check_placement(Config(device="gpu0", ray="auto"))
    # a generator on another host than the trainer's gets its weights over tcp, in host memory, which a GPU's
    # parameters cannot view (before: accepted, and each aliasing install there failed, the generator with it);
    # the generators of one host alias its cuda-ipc slots
    aliasing = Config(device="cuda", ray="auto", transport="cuda-ipc", install="alias")
    check_placement(aliasing)
    check_alias_across_hosts(aliasing, 1)
    with pytest.raises(PlacementError, match="--weights-install alias with --ray over 2 hosts"):
        check_alias_across_hosts(aliasing, 2)
    check_alias_across_hosts(Config(device="cpu", ray="auto", install="alias"), 2)  # (tcp's host memory: viewable)


def test_alias_installs_need_the_generators_where_the_weights_live():
    assert check_placement(Config(install="alias"))["generator"] == torch.device("cpu"), "shm slots are host memory"


async def test_generators_can_alias_the_shared_slots(tmp_path, sockets_dir):
    config = Config(steps=60, install="alias", run_dir=str(tmp_path))
    result = await run_pipeline(config, quiet=True)
    rows = read_rows(str(tmp_path))
    assert result.steps == 60 and len(rows) == 60
    assert max(r["staleness/lag"] for r in rows) <= config.max_staleness


def test_a_gpu_placement_is_checked_without_loading_the_cuda_driver(monkeypatch):
    """GPUs are counted (NVML, in torch) and never asked of the driver: a process that loaded it cannot fork its roles.

    Here torch "has" two GPUs it counts, and every call that would start the driver fails the test.
    """

    def loads_the_driver(*_args: object) -> None:
        pytest.fail("the placement check started the CUDA driver")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", loads_the_driver)
    monkeypatch.setattr(torch.cuda, "_lazy_init", loads_the_driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = check_placement(Config(device="cuda:1", transport="cuda-ipc"))
    assert set(devices.values()) == {torch.device("cuda", 1)}
    with pytest.raises(PlacementError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        check_placement(Config(device="cuda:2"))
    assert visible_gpus() == ["0", "1"], "a mesh's 'gpus' dimension counts them the same way"


FORKABLE = """
import asyncio, torch
from actors import Actor, endpoint, this_host
from actors._processes._forkserver import fork_refusal
from pipeline import Config
from pipeline.run import check_placement

class OnTheGpu(Actor):
    @endpoint
    async def total(self) -> float:
        return torch.ones(4, device="cuda").sum().item()

async def main():
    check_placement(Config(device="cuda", transport="cuda-ipc"))
    print("REFUSAL", fork_refusal(), flush=True)
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    print("TOTAL", await procs.spawn("gpu", OnTheGpu).total.call_one(), flush=True)
    await procs.stop()

asyncio.run(main())
"""


@pytest.mark.gpu
def test_after_a_gpu_placement_the_launcher_still_forks_roles_that_use_cuda():
    out = subprocess.run([sys.executable, "-c", FORKABLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSAL None" in out.stdout, out.stdout
    assert "TOTAL 4.0" in out.stdout, out.stdout
