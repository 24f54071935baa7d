"""Lifelines between the controller and node hosts (no Ray needed: both ends in this process)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import pytest
from harness import wait_for

from actors._processes._lifeline import (
    _ANSWER,
    _NONCE,
    LIFELINE_THREAD,
    SILENCE,
    SILENCE_ENV,
    Lifelines,
    LifelineTicket,
    _mac,
    hold,
    silence_bound,
)

GUARD = 10.0  # a guard against hangs, never a synchronisation


@pytest.fixture
def lifelines():
    lines = Lifelines("127.0.0.1")
    yield lines
    lines.close()


def reporter() -> tuple[list[tuple[int, str]], threading.Event, object]:
    lost: list[tuple[int, str]] = []
    seen = threading.Event()

    def on_lost(index: int, why: str) -> None:
        lost.append((index, why))
        seen.set()

    return lost, seen, on_lost


def test_a_node_whose_line_closes_is_reported_lost_with_its_index(lifelines):
    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    cut_0 = hold(lifelines.ticket(0), lambda why: None)
    cut_3 = hold(lifelines.ticket(3), lambda why: None)
    cut_3()  # as when the node host's process dies: the kernel closes its end
    assert seen.wait(GUARD)
    assert lost == [(3, "its lifeline to the controller closed")]
    cut_0()


def test_losses_before_anyone_watches_are_kept_and_reported(lifelines):
    cut = hold(lifelines.ticket(1), lambda why: None)
    cut()
    lost, _, on_lost = reporter()
    assert wait_for(lambda: lifelines._early, timeout=GUARD)  # type: ignore[attr-defined]
    lifelines.watch(on_lost)
    assert lost == [(1, "its lifeline to the controller closed")]


def test_a_line_without_the_key_counts_for_nothing(lifelines):
    """An impostor cannot pass as a node, and its leaving loses no node."""
    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    cut = hold(dataclasses.replace(lifelines.ticket(0), key=os.urandom(32)), lambda why: None)
    cut()
    real = hold(lifelines.ticket(2), lambda why: None)
    real()
    assert seen.wait(GUARD)
    assert lost == [(2, "its lifeline to the controller closed")]


def test_the_node_side_hears_when_the_controller_goes():
    lines = Lifelines("127.0.0.1")
    gone = threading.Event()
    why: list[str] = []

    def on_lost(reason: str) -> None:
        why.append(reason)
        gone.set()

    cut = hold(lines.ticket(0), on_lost)
    lines.close()  # as when the controller dies
    assert gone.wait(GUARD)
    assert why == ["the controller's lifeline closed"]
    cut()


def test_a_closer_called_first_means_no_report():
    lines = Lifelines("127.0.0.1")
    reported: list[str] = []
    cut = hold(lines.ticket(0), reported.append)
    cut()
    lines.close()
    assert reported == []


def test_an_unreachable_controller_fails_the_node_host_at_once():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        hold(LifelineTicket("127.0.0.1", port, os.urandom(32), 0, SILENCE), lambda why: None)


def test_the_silence_bound_is_the_controllers_setting_or_five_seconds(monkeypatch):
    monkeypatch.delenv(SILENCE_ENV, raising=False)
    assert silence_bound() == SILENCE == 5.0
    monkeypatch.setenv(SILENCE_ENV, "2.5")
    assert silence_bound() == 2.5
    lines = Lifelines("127.0.0.1")
    try:
        assert lines.ticket(4) == LifelineTicket(*lines.address, lines.key, 4, 2.5), "the node hosts get the bound"
    finally:
        lines.close()
    for bad in ("1", "0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv(SILENCE_ENV, bad)
        with pytest.raises(ValueError, match=rf"ACTORS_LIFELINE_SILENCE='{bad}': .* at least 2 \(four heartbeats\)"):
            silence_bound()


def test_hold_takes_a_ticket():
    with pytest.raises(TypeError, match="held by its LifelineTicket"):
        hold(("127.0.0.1", 9), lambda why: None)  # type: ignore[arg-type]


BOUND = 2.0  # the shortest bound allowed: the silence is the fault's length, not a synchronisation


def test_a_node_that_falls_silent_is_lost_after_the_bound():
    """A node host that proved the key and then says nothing (its machine gone without closing anything)."""
    lines = Lifelines("127.0.0.1", BOUND)
    lost, seen, on_lost = reporter()
    lines.watch(on_lost)
    mute = socket.create_connection(lines.address)
    try:
        nonce = b""
        while len(nonce) < _NONCE:
            nonce += mute.recv(_NONCE - len(nonce))
        mute.sendall(_ANSWER.pack(_mac(lines.key, nonce, 5), 5))
        proved = time.monotonic()
        assert seen.wait(BOUND + GUARD)
        assert time.monotonic() - proved >= BOUND
        assert lost == [(5, "its lifeline was silent for 2s")]
    finally:
        mute.close()
        lines.close()


def test_the_node_side_gives_up_on_a_silent_controller_after_its_tickets_bound():
    """A controller that sends its nonce, hears the proof and then says nothing (its machine gone without a word)."""
    done = threading.Event()

    def mute_controller(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(os.urandom(_NONCE))
            done.wait(BOUND + GUARD)  # reads nothing more, sends nothing more

    why: list[str] = []
    gone = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        controller = threading.Thread(target=mute_controller, args=(server,), daemon=True)
        controller.start()
        ticket = LifelineTicket(*server.getsockname()[:2], os.urandom(32), 0, BOUND)
        started = time.monotonic()  # before the node's clock starts: it heard nothing since
        cut = hold(ticket, lambda reason: (why.append(reason), gone.set()))
        try:
            assert gone.wait(BOUND + GUARD)
            assert time.monotonic() - started >= BOUND
            assert why == ["the controller's lifeline was silent for 2s"]
        finally:
            cut()
            done.set()
            controller.join(GUARD)


def test_ray_hosts_refuse_a_bad_bound_before_anything_is_reserved(monkeypatch):
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    from actors.ray import host_mesh

    monkeypatch.setenv(SILENCE_ENV, "soon")
    with pytest.raises(ValueError, match=r"ACTORS_LIFELINE_SILENCE='soon': the lifeline's silence bound is a number"):
        host_mesh(hosts=2)
    assert not ray.is_initialized(), "nothing was started"


async def test_ray_hosts_made_on_an_event_loop_refuse_to_block_it():
    """``host_mesh()`` waits for Ray's reservation and the hosts' start (up to 120 s per wait): called on a running
    loop's thread it froze the loop that long. It refuses, naming ``host_mesh_async``, before anything starts."""
    ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    from actors.ray import host_mesh

    with pytest.raises(RuntimeError, match=r"will not block a running event loop: use `await .*host_mesh_async"):
        host_mesh(hosts=2)
    assert not ray.is_initialized(), "nothing was started"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_handshake_the_controller_never_answers_gives_up_after_the_bound_and_closes_its_socket():
    """A listener that never sends its nonce (or closes at once) fails ``hold`` quickly, leaving no socket."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        host, port = silent.getsockname()
        before = _open_fds()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            hold(LifelineTicket(host, port, os.urandom(32), 0, 0.3), lambda why: None)
        assert time.monotonic() - started < GUARD
        assert _open_fds() == before
    with socket.socket() as curt:
        curt.bind(("127.0.0.1", 0))
        curt.listen()
        host, port = curt.getsockname()
        before = _open_fds()
        closing = threading.Thread(target=lambda: curt.accept()[0].close(), daemon=True)
        closing.start()
        with pytest.raises(ConnectionError, match="during its handshake"):
            hold(LifelineTicket(host, port, os.urandom(32), 1, GUARD), lambda why: None)
        closing.join(GUARD)
        assert _open_fds() == before


def test_a_node_whose_lifeline_cannot_be_held_stops_its_forkserver(tmp_path):
    """A worker loop's agent or a Ray node host that cannot reach its controller leaves no forkserver behind."""
    from actors._processes._node_forkserver import NodeForkserver

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    before = _children()
    with pytest.raises(OSError):
        NodeForkserver.tied_to("127.0.0.1", str(tmp_path), LifelineTicket("127.0.0.1", port, os.urandom(32), 0, 1.0))
    assert _children() <= before  # the forkserver was started, then stopped and reaped


def _children() -> set[int]:
    """This process's live (not zombie) child processes."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != b"Z":
                found.add(int(entry))
    return found


def test_a_connection_the_listener_cannot_accept_costs_no_line_already_held(lifelines, monkeypatch):
    """accept() failing with EMFILE (a controller out of descriptors) ended the lifeline thread, which closed every
    line: each node host then ended its workers. Now it is logged and the next connection is taken."""
    import errno

    listener, real_accept, failed = lifelines._listener, socket.socket.accept, []

    def fails_once(self: socket.socket) -> tuple[socket.socket, object]:
        if self is listener and not failed:
            failed.append(True)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    held_lost: list[str] = []
    cut_0 = hold(lifelines.ticket(0), held_lost.append)
    monkeypatch.setattr(socket.socket, "accept", fails_once)
    cut_1 = hold(lifelines.ticket(1), lambda why: None)  # its first accept fails; the next takes it
    assert failed and lifelines._thread.is_alive()
    cut_1()
    assert seen.wait(GUARD)
    assert lost == [(1, "its lifeline to the controller closed")] and held_lost == []
    cut_0()


def test_a_line_the_controller_ended_closes_the_node_sides_socket():
    """When the controller's end goes, the node side's socket is closed with the line (a worker loop serving one
    controller after another kept one socket per controller it outlived)."""
    before = set(os.listdir("/proc/self/fd"))
    lines = Lifelines("127.0.0.1")
    ended = threading.Event()
    cut = hold(lines.ticket(0), lambda why: ended.set())  # kept, as a node host keeps it
    beats = [t for t in threading.enumerate() if t.name == LIFELINE_THREAD]
    lines.close()
    assert ended.wait(GUARD)
    for thread in beats:
        thread.join(GUARD)
    assert set(os.listdir("/proc/self/fd")) <= before
    cut()  # (a closer called after the line ended is harmless)


@pytest.fixture
def piped_node(monkeypatch, tmp_path):
    """A NodeForkserver whose forkserver is two pipes the test writes reports into and reads requests from."""
    import types

    from actors._processes import _node_forkserver

    requests_r, requests_w = os.pipe()
    status_r, status_w = os.pipe()
    process = types.SimpleNamespace(
        requests=requests_w, status=status_r, pid=-1, kill=lambda: None, wait=lambda timeout: True
    )
    monkeypatch.setattr(_node_forkserver._ServerProcess, "start", lambda *args, **kwargs: process)
    node = _node_forkserver.NodeForkserver("127.0.0.1", str(tmp_path))
    yield node, status_w
    node.stop()  # closes the request pipe's write end
    os.close(status_w)
    os.close(requests_r)


def test_a_worker_that_starts_after_its_spawn_gave_up_is_killed_not_left_untracked(piped_node, monkeypatch):
    """A cold host's forkserver answering after SPAWN_REPORT_TIMEOUT: the controller has counted the worker dead,
    so the process that starts late is killed (it ran on, with an address nobody would use, and kill() missed it)."""
    import subprocess
    import sys

    from actors._processes import _node_forkserver
    from actors._processes._forkserver_protocol import Exited, Spawned, frame

    node, status = piped_node
    monkeypatch.setattr(_node_forkserver, "SPAWN_REPORT_TIMEOUT", 0.0)
    with pytest.raises(TimeoutError, match="did not start worker 5"):
        node.spawn(5, {})
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.write(status, frame(Spawned(5, late.pid)))
        assert late.wait(GUARD) == -9
    finally:
        late.kill()
        late.wait()
    assert not node.kill(5)
    os.write(status, frame(Spawned(6, 424242)) + frame(Exited(6, 424242, 0)))  # read together: started and gone
    assert node.exits(GUARD) == [Exited(6, 424242, 0)]
    monkeypatch.setattr(_node_forkserver, "SPAWN_REPORT_TIMEOUT", GUARD)
    assert node.spawn(6, {}) == 424242 and 6 not in node._pids, "an exited worker's pid is not kept"


def test_a_line_the_controller_cuts_ends_on_the_node_side_and_is_reported_once(lifelines):
    """``cut(index)``: the controller ends a host's line (the host was lost otherwise); the host hears it at once
    (it ends its workers), and the loss is reported as any line's end."""
    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    node_heard: list[str] = []
    heard = threading.Event()
    cut_node = hold(lifelines.ticket(4), lambda why: (node_heard.append(why), heard.set()))
    other = hold(lifelines.ticket(5), lambda why: None)
    try:
        lifelines.cut(4)
        assert heard.wait(GUARD) and seen.wait(GUARD)
        assert lost == [(4, "this controller ended its lifeline: it was lost")]
        lifelines.cut(9)  # (no such line: nothing to end, nothing raised)
    finally:
        cut_node()
        other()


def _closed_by_the_controller(sock: socket.socket, within: float) -> bool:
    """Whether the controller ends ``sock`` (EOF or reset) within ``within`` s; a byte every 0.1 s meanwhile."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            sock.send(b"x")
            if sock.recv(64) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_connection_that_never_proves_the_key_is_ended_after_the_bound_however_it_trickles():
    """Any byte counted as a sign of life, before the key was proved too: anyone on the network holding a
    connection open with a byte every few seconds kept a descriptor of the controller for good. An unproven one
    has the silence bound, from its connection, to prove the key."""
    lines = Lifelines("127.0.0.1", 1.0)
    idle = socket.create_connection(lines.address)
    try:
        assert len(idle.recv(_NONCE)) == _NONCE
        started = time.monotonic()
        assert _closed_by_the_controller(idle, within=GUARD), "an unproven trickling connection was held"
        assert time.monotonic() - started < 3.0  # (by its bound: its 36th byte, a failed proof, comes at 3.6 s)
    finally:
        idle.close()
        lines.close()


def test_a_flood_of_unproven_connections_keeps_a_bounded_number_and_a_real_node_still_holds_its_line(monkeypatch):
    """Every connection was kept until its silence ran out: a flood of them ran the controller out of
    descriptors (its links, pipes and new node hosts' handshakes failed). At most ``UNPROVEN_LINES`` are kept,
    the oldest let go; a node host proving its key at once keeps its line."""
    from actors._processes import _lifeline

    monkeypatch.setattr(_lifeline, "UNPROVEN_LINES", 8)
    lines = Lifelines("127.0.0.1", 30.0)
    flood = [socket.create_connection(lines.address) for _ in range(24)]
    try:
        for sock in flood:
            assert len(sock.recv(_NONCE)) == _NONCE  # (each accepted, in order)
        assert all(_closed_by_the_controller(sock, within=GUARD) for sock in flood[:16]), "the oldest were held"
        lost, seen, on_lost = reporter()
        lines.watch(on_lost)
        cut = hold(lines.ticket(7), lambda why: None)
        cut()
        assert seen.wait(GUARD) and lost == [(7, "its lifeline to the controller closed")]
    finally:
        for sock in flood:
            sock.close()
        lines.close()
