"""The process registry: a peer whose pid is not known yet is looked up until it is, then watched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from harness import descriptors_below_1024_taken

from actors._shared._liveness import ProcRef, Watcher, new_incarnation
from actors._shared._session import forget_incarnation, read_incarnation, write_incarnation
from actors._transport._registry import Registry


def test_a_peer_whose_pid_appears_later_is_watched_and_its_death_seen(tmp_path):
    registry = Registry(str(tmp_path), os.getpid())
    deaths = []
    registry.deaths.connect(deaths.append)
    address = f"ipc://{tmp_path}/w1-0.sock"
    ref = registry.proc(address, None)
    assert ref.pid is None and ref in registry.unresolved
    assert registry.retry_unresolved(), "still nobody recorded it"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # exited and reaped before its pid is written: the first look finds it dead
    write_incarnation(str(tmp_path), address, gone.pid)
    assert not registry.retry_unresolved()
    assert ref.pid == gone.pid and ref.dead and deaths == [ref]
    registry.close()


def test_a_live_peer_found_later_is_alive_until_it_exits(tmp_path):
    registry = Registry(str(tmp_path), os.getpid())
    address = f"ipc://{tmp_path}/w1-1.sock"
    ref = registry.proc(address, None)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        write_incarnation(str(tmp_path), address, child.pid)
        registry.retry_unresolved()
        assert ref.pid == child.pid and not ref.dead
        (fd,) = registry.watcher.fds()
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(10)
        registry.watcher.check(fd)
        assert ref.dead and ref.exit_reason == "process exited"
    finally:
        child.kill()
        registry.close()


def test_a_pid_that_cannot_be_opened_counts_as_dead(tmp_path, monkeypatch):
    """A forged or foreign pid (pidfd_open fails with any OSError) is reported dead, never raised."""
    registry = Registry(str(tmp_path), os.getpid())
    deaths = []
    registry.deaths.connect(deaths.append)

    def refuse(pid: int) -> int:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "pidfd_open", refuse)
    ref = registry.proc(f"ipc://{tmp_path}/w1-2.sock", 4_000_000)
    assert ref.dead and deaths == [ref]
    registry.close()


def test_a_reaped_process_record_is_forgotten_only_if_it_still_names_it(tmp_path):
    address = "tcp://127.0.0.1:45100"
    write_incarnation(str(tmp_path), address, 1234)
    forget_incarnation(str(tmp_path), address, 999)  # a replacement already wrote its pid: kept
    assert read_incarnation(str(tmp_path), address) == 1234
    forget_incarnation(str(tmp_path), address, 1234)
    assert read_incarnation(str(tmp_path), address) is None
    forget_incarnation(str(tmp_path), address, 1234)  # nothing left: no error


def test_each_incarnation_is_stamped_later_than_the_last(monkeypatch):
    ref = ProcRef("tcp://127.0.0.1:45101", None)
    first = new_incarnation(ref)
    assert first > 0
    ref.incarnation = first
    monkeypatch.setattr(time, "time_ns", lambda: first - 10**9)  # the clock stepped back
    assert new_incarnation(ref) == first + 1


def test_an_address_outside_the_session_is_refused_before_anything_connects_to_it(tmp_path):
    """A peer's address arrives in records (reply addresses, ports, meshes): one no process of this session could
    own is refused (DecodeError), so nothing is ever sent there and zmq never meets an address it cannot parse."""
    from actors import DecodeError

    registry = Registry(str(tmp_path), os.getpid())
    try:
        for address in (
            "ipc:///etc/elsewhere.sock",
            f"ipc://{tmp_path}/../escape.sock",
            "tcp://[::bad",
            "inproc://x",
            "",
        ):
            with pytest.raises(DecodeError, match="not a peer"):
                registry.proc(address, 7)
        assert registry.procs == {}
        assert registry.proc(f"ipc://{tmp_path}/w1-0.sock", None).address == f"ipc://{tmp_path}/w1-0.sock"
    finally:
        registry.close()
    keyed = Registry(str(tmp_path), os.getpid(), authenticated=True)  # CURVE: a worker loop's socket is anywhere
    try:
        assert keyed.proc("ipc:///var/run/w.sock", None).address == "ipc:///var/run/w.sock"
        with pytest.raises(DecodeError):
            keyed.proc("ipc://relative.sock", None)
    finally:
        keyed.close()


LATE_PEER = """
import asyncio, subprocess, sys, time
from actors._runtime._core import runtime
from actors._shared._session import write_incarnation

rt = runtime()
address = f"ipc://{rt.dir}/w9-late.sock"

async def first():
    rt.driver.ensure_loop()
    return rt.registry.proc(address, None)  # its pid not recorded yet: looked up again on this loop's timer

ref = asyncio.run(first())  # ends with that timer still pending
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
write_incarnation(rt.dir, address, child.pid)

async def second():
    rt.driver.ensure_loop()
    deadline = time.monotonic() + 10  # a guard against a hang only
    while ref.pid is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return ref.pid

found = asyncio.run(second())
child.kill()
child.wait()
print("found" if found == child.pid else f"not found: {found}")
"""


def test_a_second_asyncio_run_still_looks_up_a_peers_pid():
    """A program's first ``asyncio.run`` ends while a peer's pid is still being looked up: the next one looks it up
    (before, the first loop's timer stayed marked as pending, so the lookup stopped for good and the peer's death
    would never be seen)."""
    from harness import run_python

    proc = run_python("-c", LATE_PEER, timeout=60)
    assert proc.stdout.strip().endswith("found") and "not found" not in proc.stdout, proc.stdout + proc.stderr


def test_a_death_is_taken_in_early_whatever_its_pidfds_number():
    """``take_pending`` (news of a restart, read before this process's loop got to the old process's exit) on a
    pidfd numbered 1024 or more: ``select.select`` refused it with ``ValueError`` and the news was lost."""
    died: list[int] = []
    watcher = Watcher(died.append)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        with descriptors_below_1024_taken():
            assert watcher.watch(child.pid)
            assert watcher._fds[child.pid] >= 1024
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(30)
        watcher.take_pending(child.pid)
        assert died == [child.pid]
    finally:
        child.kill()
        child.wait(30)
        watcher.close()


def test_a_death_learned_while_another_is_handled_leaves_the_first_one_marked_exiting(tmp_path):
    """While process A's death is handled, a listener learns peer B's pid, already gone: B's death is handled
    inside A's. A's listeners that run after that still see A as the process exiting, so its calls wait for the
    inbox to be read (before: the nested death reset ``exiting`` to None, and A's calls failed at once, a reply
    of A's still unread)."""
    registry = Registry(str(tmp_path), os.getpid())
    a, b = (registry.proc(f"ipc://{tmp_path}/w1-{n}.sock", None) for n in (3, 4))
    gone = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for child in gone:
        child.wait(30)
    a.pid = gone[0].pid
    registry._by_pid[a.pid] = a  # (known, not watched: its death is reported below)
    seen: list[tuple[ProcRef, int | None]] = []

    def learn_b(ref: ProcRef) -> None:
        if ref is a:
            registry.set_pid(b, gone[1].pid)  # a pid already gone: its death is handled right here

    registry.deaths.connect(learn_b)
    registry.deaths.connect(lambda ref: seen.append((ref, registry.exiting)))
    registry._pid_died(a.pid)
    assert seen == [(b, gone[1].pid), (a, gone[0].pid)]
    assert registry.exiting is None
    registry.close()


def test_a_ctrl_c_in_a_deaths_listener_still_announces_the_pids_exit(tmp_path):
    """A death's listeners leave the calls waiting on it to ``pid_exits`` (after the inbox is read): a Ctrl-C in
    one of them skipped ``pid_exits``, and those calls waited for good. The interrupt goes on, after it."""
    registry = Registry(str(tmp_path), os.getpid())
    a = registry.proc(f"ipc://{tmp_path}/w1-5.sock", None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    a.pid = gone.pid
    registry._by_pid[a.pid] = a
    exits: list[tuple[int, int | None]] = []

    def interrupted(ref: ProcRef) -> None:
        raise KeyboardInterrupt

    registry.deaths.connect(interrupted)
    registry.pid_exits.connect(lambda pid: exits.append((pid, registry.exiting)))
    with pytest.raises(KeyboardInterrupt):
        registry._pid_died(gone.pid)
    assert a.dead and exits == [(gone.pid, gone.pid)] and registry.exiting is None
    registry.close()


def test_an_answer_to_a_caller_restarted_at_its_address_since_is_not_sent_to_the_new_process(tmp_path):
    """A worker of a restartable mesh calls X (call 5, rank 0), is killed and restarted at its address; the new
    process makes its own call 5 to X's rank 0. X's answer to the old call went to the live process at that
    address, the new one, which took it for the answer to its own call 5 (call ids start at 1 in every process).
    It is dropped now: the caller it was for has gone. The new process's own calls are answered."""
    import types

    from actors._hosting._invocation import Invocation
    from actors._wire._records import Call

    registry = Registry(str(tmp_path), os.getpid())
    address = f"ipc://{tmp_path}/w1-6.sock"
    caller = registry.proc(address, None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    caller.pid = gone.pid
    registry._by_pid[gone.pid] = caller
    registry._pid_died(gone.pid)
    assert caller.dead
    assert registry.proc(address, os.getpid()) is caller and not caller.dead, "restarted at its address"
    sent: list[int] = []
    rt = types.SimpleNamespace(registry=registry, send=lambda ref, record, urgent, owed: sent.append(record.call_id))
    Invocation(Call(5, "x", "m", address, gone.pid, 0, b"", None), []).reply(rt, True, 1)  # type: ignore[arg-type]
    assert sent == [], "the old caller's answer goes nowhere"
    Invocation(Call(5, "x", "m", address, os.getpid(), 0, b"", None), []).reply(rt, True, 2)  # type: ignore[arg-type]
    assert sent == [5], "the new process's own call is answered"
    registry.close()
