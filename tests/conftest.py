from __future__ import annotations

import glob
import os

import pytest
from support import actor_pids, wait_for


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
    from actors._runtime import runtime

    rt = runtime()
    yield rt.dir
    own = os.path.basename(rt.address.removeprefix("ipc://"))
    leftovers = set(os.listdir(rt.dir)) - {own}
    assert not leftovers, f"socket files left behind: {leftovers}"
