"""The bookkeeping every host mesh of remote forkservers shares (Ray's, attached workers'), fed answers by hand."""

from __future__ import annotations

import itertools
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from actors._meshes._remote_host_mesh import RemoteHostMesh, RemoteNode, exit_reason
from actors._transport._registry import Registry


class HandFed(RemoteHostMesh):
    """A remote host mesh whose requests wait here to be answered by the test (no hosts, no lifelines)."""

    def __init__(self, registry: Registry, nodes: list[RemoteNode]) -> None:  # (skips the base's start-up)
        counter = itertools.count()
        #: Whether the code runs as on the runtime's thread (inside ``driver.on_thread``), and what ran outside.
        self.on_thread = False
        self.off_thread: list[str] = []

        def on_thread(fn: Any, timeout: float | None = None) -> Any:
            self.on_thread = True
            try:
                return fn()
            finally:
                self.on_thread = False

        self._rt = SimpleNamespace(  # type: ignore[assignment]
            registry=registry, counter=lambda name: next(counter), driver=SimpleNamespace(on_thread=on_thread)
        )
        self._nodes = nodes
        self._root = None
        self.closed = False
        self.requests: list[tuple[str, Any]] = []
        #: The hosts whose lifeline this side ended.
        self.cut: list[int] = []
        self._lifelines = SimpleNamespace(cut=self.cut.append)  # type: ignore[assignment]

    def _request(self, node: RemoteNode, op: str, args: tuple[Any, ...], done: Any) -> None:
        if not self.on_thread:
            self.off_thread.append(op)
        self.requests.append((op, done))


def a_host_mesh(tmp_path: Any, nodes: int) -> HandFed:
    registry = Registry(str(tmp_path), os.getpid())
    return HandFed(
        registry, [RemoteNode(i, None, f"10.255.1.{i}", 100 + i, f"n{i}", f"node {i}", []) for i in range(nodes)]
    )


def test_a_late_exit_of_a_worker_whose_address_was_reused_fails_nothing(tmp_path):
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    ref = mesh._rt.registry.placed("tcp://10.255.1.0:5000")
    node.procs[7] = ref  # stopped; its exit not yet reported when its port went to the next worker
    node.procs[9] = ref
    mesh._watch(node)
    op, done = mesh.requests.pop()
    assert op == "exits"
    done([(7, 1111, 0)], None)
    assert not ref.dead, "the worker serving the address now is spawn 9"
    mesh.requests.pop()[1]([(9, 2222, -9)], None)
    assert ref.dead and "process 2222" in ref.exit_reason and "SIGKILL" in ref.exit_reason


def test_a_host_lost_by_a_failed_request_has_its_lifeline_ended_so_it_ends_its_workers(tmp_path):
    """A host whose ``exits`` request failed (Ray's node host briefly unreachable, an attached host past its
    deadline) was marked lost and its workers restarted elsewhere, but its lifeline held, so the host never ended
    them: each ran beside its replacement (an old trainer rank in the collective, an old generator producing)."""
    mesh = a_host_mesh(tmp_path, 2)
    worker = mesh._rt.registry.placed("tcp://10.255.1.1:5003")
    mesh._nodes[1].procs[3] = worker
    mesh._watch(mesh._nodes[1])
    op, done = mesh.requests.pop()
    assert op == "exits"
    done(None, TimeoutError("no answer within 60s"))
    assert worker.dead and mesh._nodes[1].lost and mesh.cut == [1]


def test_a_lost_hosts_rank_restarts_on_a_live_host_with_an_address_ready_and_pools_refill_once_at_a_time(tmp_path):
    """A lost host's rank restarted only on the live host running the fewest workers, from that host's pool alone:
    once that pool ran dry the restart failed ("no free address ready yet") though other live hosts had addresses;
    and each respawn below the pool's mark sent another request for addresses, one on top of the other."""
    mesh = a_host_mesh(tmp_path, 3)
    _idle, busy, lost = mesh._nodes
    busy.procs[1] = mesh._rt.registry.placed("tcp://10.255.1.1:6001")
    busy.pool(["tcp://10.255.1.1:6002"])
    mesh._lose(lost, "its lifeline closed")
    assert mesh._new_home() == (busy, "tcp://10.255.1.1:6002"), "the idle host's pool is dry: the next one serves"
    mesh._refill()  # (as the restart does once it started the rank)
    asked = [op for op, _ in mesh.requests]
    assert asked.count("addresses") == 2  # (the dry pools of both live hosts, asked once each)
    with pytest.raises(RuntimeError, match=r"no live host of .* has a free address ready yet"):
        mesh._new_home()
    assert [op for op, _ in mesh.requests].count("addresses") == 2, "no second request while one is on its way"
    for _, done in [request for request in mesh.requests if request[0] == "addresses"]:
        done(["tcp://10.255.1.0:6003"], None)
    assert mesh._new_home()[1] == "tcp://10.255.1.0:6003"


def test_a_lost_node_fails_only_the_workers_it_still_serves(tmp_path):
    mesh = a_host_mesh(tmp_path, 2)
    registry = mesh._rt.registry
    moved, stayed = registry.placed("tcp://10.255.1.0:5001"), registry.placed("tcp://10.255.1.0:5002")
    mesh._nodes[0].procs.update({3: moved, 4: stayed})
    mesh._nodes[1].procs[5] = moved  # restarted on node 1 (its exit on node 0 not yet reported)
    mesh._lose(mesh._nodes[0], "its lifeline closed")
    assert stayed.dead and not moved.dead
    mesh._lose(mesh._nodes[1], "its lifeline closed")
    assert moved.dead


def test_a_failed_exits_request_loses_the_host_and_a_failed_spawn_fails_its_worker(tmp_path):
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    ref = mesh._rt.registry.placed("tcp://10.255.1.0:5003")
    mesh._start(node, ref, {})
    op, spawned = mesh.requests.pop()
    assert op == "spawn"
    spawned(None, RuntimeError("fork: out of memory"))
    assert ref.dead and "could not start on host 0" in ref.exit_reason and "out of memory" in ref.exit_reason
    other = mesh._rt.registry.placed("tcp://10.255.1.0:5004")
    node.procs[11] = other
    mesh._watch(node)
    mesh.requests.pop()[1](None, ConnectionError("the agent is gone"))
    assert node.lost.startswith("ConnectionError") and other.dead


def test_exit_codes_in_words():
    assert exit_reason(0) == "exited with code 0" and exit_reason(3) == "exited with code 3"
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(-200) == "killed by signal 200"


def test_an_attached_host_lost_marks_its_agent_dead_once_and_never_after_shutdown(tmp_path):
    from actors._meshes._attached import AttachedHostMesh

    registry = Registry(str(tmp_path), os.getpid())
    agent_ref = registry.placed("tcp://10.255.1.9:4444")
    mesh = object.__new__(AttachedHostMesh)  # (no hosts: only the bookkeeping runs)
    mesh._rt = SimpleNamespace(registry=registry)  # type: ignore[assignment]
    mesh._nodes = [RemoteNode(0, None, "10.255.1.9", 1, "tcp://10.255.1.9:4444", "worker", [])]
    mesh._agents = [SimpleNamespace(_procs=[agent_ref])]  # type: ignore[list-item]
    mesh._lines_ended, mesh._lines_cut, cut = set(), set(), []
    mesh._lifelines = SimpleNamespace(cut=cut.append)  # type: ignore[assignment]
    mesh._root, mesh.closed = None, True
    mesh._lose(mesh._nodes[0], "its lifeline closed")  # after shutdown: nothing to do, nothing raised
    assert not agent_ref.dead and not mesh._nodes[0].lost
    mesh.closed = False
    mesh._lose(mesh._nodes[0], "its lifeline closed")
    assert agent_ref.dead and "its host was lost" in agent_ref.exit_reason
    assert mesh._lines_cut == {0} and cut == [0], "lost by a request (no line ended): its line is ended here"


def test_a_hosts_free_addresses_are_distinct_in_a_batch_and_its_pool_keeps_each_once(tmp_path):
    """Probes closed one by one let the kernel pick a port again: about one batch of 64 in eight held a repeat
    (measured), and two ranks got one address. A later batch may repeat a port the pool still holds: kept once."""
    from actors._processes._node_forkserver import free_addresses

    for _ in range(40):
        batch = free_addresses("127.0.0.1", 64)
        assert len(set(batch)) == 64, sorted(batch)
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    node.pool(["tcp://10.255.1.0:5001", "tcp://10.255.1.0:5002"])
    node.pool(["tcp://10.255.1.0:5002", "tcp://10.255.1.0:5003"])
    assert sorted(node.addresses) == ["tcp://10.255.1.0:5001", "tcp://10.255.1.0:5002", "tcp://10.255.1.0:5003"]


def test_a_port_handed_to_a_worker_still_starting_is_not_pooled_again(tmp_path):
    """The pool is refilled as soon as workers are sent to start, before they bind their ports: the host's next
    free batch may hold one of them. Pooled again, it went to a second rank, whose worker failed to bind, and that
    exit marked the live rank's process dead (they shared one address, so one ref)."""
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    starting = mesh._rt.registry.placed("tcp://10.255.1.0:5001")
    mesh._start(node, starting, {})
    node.pool(["tcp://10.255.1.0:5001", "tcp://10.255.1.0:5002"])
    assert node.addresses == ["tcp://10.255.1.0:5002"]


def test_a_late_answer_to_a_spawn_on_a_lost_host_leaves_the_ranks_replacement_alone(tmp_path):
    """A spawn on host 1 in flight when host 1 is lost: the rank restarts on host 0 at the same ref, and then Ray
    fails (or answers) the old spawn. Its error marked the live replacement dead (its callers got ActorDied, and
    its restart at the same address could not bind); a late success overwrote the replacement's pid."""
    mesh = a_host_mesh(tmp_path, 2)
    registry = mesh._rt.registry
    ref = registry.placed("tcp://10.255.1.0:5001")
    mesh._start(mesh._nodes[1], ref, {})
    _, old_spawn = mesh.requests.pop()
    mesh._lose(mesh._nodes[1], "its lifeline closed")
    assert ref.dead
    mesh._start(mesh._nodes[0], ref, {})  # (the supervisor's restart on the live host)
    registry.revive(ref, None)
    _, new_spawn = mesh.requests.pop()
    new_spawn(4242, None)
    old_spawn(None, RuntimeError("the node host's actor died"))
    assert not ref.dead and ref.pid == 4242
    old_spawn(1111, None)
    assert ref.pid == 4242, "a late answer of the old spawn is not the replacement's pid"


def test_a_shut_down_host_mesh_restarts_nothing(tmp_path, monkeypatch):
    """A restartable proc mesh on hosts that are shut down without stopping it first (at exit, or ``shutdown()``
    alone): forgetting its workers reported their deaths, and the supervisor restarted each on its host, whose
    node host was gone: the revived ref never heard, and every later call to it waited for good."""
    from actors._meshes import _remote_host_mesh
    from actors._shared._restart import RestartPolicy

    captured: dict[str, Any] = {}
    monkeypatch.setattr(_remote_host_mesh, "ProcMesh", lambda *args, **kwargs: captured.setdefault("respawn", args[4]))
    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    node.addresses = ["tcp://10.255.1.0:5001"]
    monkeypatch.setattr(mesh, "_ensure_addresses", lambda count: None)
    monkeypatch.setattr(mesh, "_refill", lambda: None)
    monkeypatch.setattr(_remote_host_mesh, "worker_config", lambda *args: SimpleNamespace(to_wire=lambda: {}))
    mesh._spawn({"procs": 1}, None, "m", 1, RestartPolicy("on-failure"))
    mesh.requests.clear()
    mesh.closed = True
    ref = mesh._rt.registry.placed("tcp://10.255.1.0:5001")
    with pytest.raises(RuntimeError, match="shut down"):
        captured["respawn"](0, ref)
    assert mesh.requests == [], "no spawn is sent to a host that was shut down"


def test_spawning_and_forgetting_workers_run_on_the_runtimes_thread(tmp_path, monkeypatch):
    """``spawn_procs`` from a synchronous program's main thread, and ``shutdown()`` from a worker thread, changed
    the hosts' worker tables while the runtime's thread read them (an exit report's handler raised "dictionary
    changed size during iteration", was swallowed, and that host's exits were never polled again), and ran the
    registry's death hooks off the loop. Both hop to the runtime's thread now (the address fetch, which may wait,
    stays on the caller's)."""
    from actors._meshes import _remote_host_mesh
    from actors._shared._restart import RestartPolicy

    mesh = a_host_mesh(tmp_path, 1)
    (node,) = mesh._nodes
    node.addresses = ["tcp://10.255.1.0:5001", "tcp://10.255.1.0:5002"]
    fetched_on: list[bool] = []
    monkeypatch.setattr(mesh, "_ensure_addresses", lambda count: fetched_on.append(mesh.on_thread))
    monkeypatch.setattr(_remote_host_mesh, "worker_config", lambda *args: SimpleNamespace(to_wire=lambda: {}))
    monkeypatch.setattr(_remote_host_mesh, "ProcMesh", lambda *args, **kwargs: args[2])
    died_on: list[bool] = []
    mesh._rt.registry.deaths.connect(lambda ref: died_on.append(mesh.on_thread))
    procs = mesh._spawn({"procs": 1}, None, "m", 1, RestartPolicy())
    assert fetched_on == [False] and mesh.off_thread == [] and len(procs) == 1
    mesh._forget_workers("its host mesh was shut down")
    assert procs[0].dead and died_on == [True]


def test_a_port_two_hosts_of_one_ip_both_pool_goes_to_one_rank_only(tmp_path):
    """Two worker loops on one machine pool ports of one address space: a port one holds unbound can be in the
    other's batch, or serve a live worker of the other by now. Both ranks got it (one ref: the worker that
    failed to bind marked the other rank's process dead, or the calls of one rank reached the other's)."""
    mesh = a_host_mesh(tmp_path, 2)
    first, second = mesh._nodes
    shared = "tcp://10.255.1.0:5001"
    first.pool(["tcp://10.255.1.0:5002", shared])
    second.pool(["tcp://10.255.1.0:5003", shared])
    chosen: set[str] = set()
    assert mesh._free_addresses(first, 1, chosen) == [shared]
    assert mesh._free_addresses(second, 1, chosen) == ["tcp://10.255.1.0:5003"], "chosen once in a placement"
    mesh._rt.registry.placed("tcp://10.255.1.0:5002")  # a live worker serves it now (placed by another mesh)
    assert mesh._free_addresses(first, 1, set()) is None and first.addresses == []
    gone = mesh._rt.registry.placed("tcp://10.255.1.0:5004")
    mesh._rt.registry.mark_dead(gone, "exited")  # a dead worker's: its ref is another mesh's dead rank still
    first.pool(["tcp://10.255.1.0:5004"])
    assert mesh._free_addresses(first, 1, set()) is None


def test_a_spawn_whose_addresses_another_spawn_took_starts_nothing_and_fetches_again(tmp_path):
    """The addresses are fetched on the caller's thread and used on the runtime's: a spawn from another thread
    in between may take them. Placing popped from an empty pool part-way (``IndexError``), leaving the workers
    it had started on the first hosts with no mesh to stop them; it now starts nothing and fetches again."""
    mesh = a_host_mesh(tmp_path, 2)
    mesh._nodes[0].pool(["tcp://10.255.1.0:5001", "tcp://10.255.1.0:5002"])
    mesh._nodes[1].pool(["tcp://10.255.1.1:5001"])  # one short
    assert mesh._place({"procs": 2}, 2, None, None, 1, None) is None  # type: ignore[arg-type]
    assert len(mesh._nodes[0].addresses) == 2, "nothing lost"
    assert [op for op, _ in mesh.requests] == ["addresses", "addresses"], "nothing started; the pools refill"

    stale = a_host_mesh(tmp_path, 1)  # a pool of 33, 26 of them served by workers since (their ports came back)
    (node,) = stale._nodes
    node.pool([f"tcp://10.255.1.0:{7000 + i}" for i in range(33)])
    for i in range(26):
        stale._rt.registry.placed(f"tcp://10.255.1.0:{7000 + i}")
    assert stale._place({"procs": 8}, 8, None, None, 1, None) is None  # type: ignore[arg-type]
    assert len(node.addresses) == 7
    ((op, answer),) = stale.requests  # (before: none, so a spawn on an event loop, which cannot fetch, failed for good)
    assert op == "addresses"
    answer([f"tcp://10.255.1.0:{8000 + i}" for i in range(64)], None)
    assert len(node.addresses) == 71

    fetched: list[int] = []
    placed = iter([None, None, "the mesh"])

    class Retrying(HandFed):
        def _fetch_addresses(self, nodes: list[RemoteNode], count: int) -> list[list[str]]:
            fetched.append(count)
            return [[f"tcp://{node.ip}:{6000 + i}" for i in range(count)] for node in nodes]

        def _place(self, *args: Any) -> Any:
            return next(placed)

    retrying = Retrying(mesh._rt.registry, [RemoteNode(0, None, "10.255.1.5", 1, "n", "node", [])])
    assert retrying._spawn({"procs": 2}, None, None, 1, None) == "the mesh"  # type: ignore[arg-type,comparison-overlap]
    assert len(fetched) == 1, "a pool that still holds enough is not fetched again"
    placed = iter([None] * 3)
    with pytest.raises(RuntimeError, match="could not keep 2 free addresses per host ready"):
        retrying._spawn({"procs": 2}, None, None, 1, None)  # type: ignore[arg-type]


def test_an_attached_meshs_address_fetch_waits_one_bound_for_all_its_hosts(monkeypatch):
    """The hosts are asked at once; their answers were then waited for one after another, each with the whole
    REQUEST_TIMEOUT, so a second slow host could double the wait. One bound covers them all."""
    from actors._meshes import _attached

    given: list[float] = []

    def slow_answer(rt: Any, call: Any, timeout: float, what: str) -> list[str]:
        given.append(timeout)
        time.sleep(0.4)  # (the first host's slow answer)
        return ["tcp://10.255.1.0:5000"]

    monkeypatch.setattr(_attached, "REQUEST_TIMEOUT", 1.0)
    monkeypatch.setattr(_attached, "ask_agent", lambda *args: object())
    monkeypatch.setattr(_attached, "_wait", slow_answer)
    nodes = [SimpleNamespace(handle=None), SimpleNamespace(handle=None)]
    _attached.AttachedHostMesh._fetch_addresses(SimpleNamespace(_rt=None), nodes, 1)  # type: ignore[arg-type]
    assert given[0] == pytest.approx(1.0, abs=0.1) and given[1] < 0.7


def test_a_request_deadline_outlives_the_loop_it_was_armed_on():
    """A request to a host's agent fails at its deadline, a timer on the runtime's loop: armed on a loop the
    program then left (a synchronous setup's background loop, then ``asyncio.run``), it never fired, and a request
    whose answer never came (a hung agent) left the host's exits unpolled for good. Re-armed on the next loop."""
    import asyncio

    from actors._meshes._request_deadlines import RequestDeadlines
    from actors._shared._hooks import Hook

    class Pending:
        done = False
        timeout: float | None = None

        def expire(self) -> None:
            self.done = True

    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    driver = SimpleNamespace(loop=first, moved=Hook("moved"))
    deadlines = RequestDeadlines(SimpleNamespace(driver=driver))  # type: ignore[arg-type]
    pending, answered = Pending(), Pending()

    async def ask() -> None:
        deadlines.add(pending, 0.05)  # type: ignore[arg-type]
        deadlines.add(answered, 0.05)  # type: ignore[arg-type]
        answered.done = True  # (its answer came)

    first.run_until_complete(ask())  # armed on the first loop, which then ends
    first.close()
    driver.loop = second

    async def moved() -> None:
        driver.moved()
        while not pending.done:
            await asyncio.sleep(0.005)

    second.run_until_complete(asyncio.wait_for(moved(), 5))
    second.close()
    assert pending.done and pending.timeout == 0.05 and deadlines.open == 0
    deadlines.close()
    assert not driver.moved
