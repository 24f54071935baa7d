"""A ``gpus`` dimension gives each process its own GPU through CUDA_VISIBLE_DEVICES, as Monarch does."""

from __future__ import annotations

import pytest
from support import Echo

from actors._meshes import _host_mesh as _host
from actors._processes._devices import gpu_env, visible_gpus


async def test_each_process_of_a_gpus_mesh_sees_its_own_device(monkeypatch, spawn):
    monkeypatch.setattr(_host, "visible_gpus", lambda: ["3", "5"])
    mesh = spawn(gpus=2)
    seen = await mesh.spawn("echo", Echo).getenv.call("CUDA_VISIBLE_DEVICES")
    assert list(seen.values()) == ["3", "5"], "rank i along 'gpus' gets the i-th visible GPU"


async def test_more_processes_than_gpus_share_them_round_robin(monkeypatch, spawn):
    monkeypatch.setattr(_host, "visible_gpus", lambda: ["0", "1"])
    mesh = spawn(hosts=1, gpus=3)
    seen = await mesh.spawn("echo", Echo).getenv.call("CUDA_VISIBLE_DEVICES")
    assert list(seen.values()) == ["0", "1", "0"]


async def test_a_procs_mesh_gets_no_device_assignment(monkeypatch, spawn):
    monkeypatch.setattr(_host, "visible_gpus", lambda: pytest.fail("a mesh without 'gpus' asks for none"))
    mesh = spawn(procs=1)
    assert await mesh.spawn("echo", Echo).getenv.call_one("ACTORS_NO_SUCH_VARIABLE") is None


def test_the_gpus_to_hand_out_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 7")
    assert visible_gpus() == ["2", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_without_gpus_the_dimension_is_only_a_name():
    assert gpu_env({"gpus": 4}, 2, []) == {}
    assert gpu_env({"procs": 4}, 2, ["0"]) == {}
    assert gpu_env({"hosts": 2, "gpus": 2}, 3, ["a", "b"]) == {"CUDA_VISIBLE_DEVICES": "b"}
