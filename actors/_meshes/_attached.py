"""``attach_to_workers``: hosts whose worker loops a scheduler started, as one host mesh (Monarch's bootstrap).

Each worker runs ``run_worker_loop_forever(address=...)``. Attaching spawns
a :class:`~actors._meshes._worker_loop.HostAgent` on each (an ordinary spawn
call, over tcp with the session's CURVE key: a controller without the key
is never heard) and returns an :class:`AttachedHostMesh` at once, as
Monarch's does: its ``initialized`` (and spawning) waits for every agent to
answer (:mod:`._attaching`). Its requests to the hosts are actor calls to
the agents; everything else (spawning, exits, lost hosts, restarts
elsewhere) is :class:`~actors._meshes._remote_host_mesh.RemoteHostMesh`,
shared with ``actors.ray``. The agents hold lifelines to this controller:
when it goes, each host ends the workers it started and waits for the next
controller.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

from .._processes._forkserver_protocol import PR_SET_PDEATHSIG
from .._processes._lifeline import Lifelines, silence_bound
from .._processes._node_forkserver import SPAWN_REPORT_TIMEOUT
from .._runtime._call_sender import pending_future
from .._runtime._core import Runtime, at_runtime_exit, current_runtime, runtime
from .._runtime._future import Future
from .._runtime._pending_calls import PendingCall
from .._runtime._value_mesh import Extent
from .._shared._loops import loop_running
from .._shared._restart import RestartPolicy
from .._shared._session import (
    CURVE_PUBLIC_ENV,
    CURVE_SECRET_ENV,
    HOST_ID_ENV,
    SESSION_ENV,
    make_runtime_dir,
    new_session_keys,
    session_keys,
    tcp_host,
)
from ._actor_mesh import ActorMesh
from ._attaching import Attaching, ask_agent
from ._proc_mesh import ProcMesh
from ._remote_host_mesh import RemoteHostMesh, RemoteNode, Requested, use_tcp
from ._request_deadlines import RequestDeadlines
from ._worker_addresses import attach_address
from ._worker_loop import HostAgent, check_worker_loop_args

__all__ = ["AttachedHostMesh", "attach_to_workers", "hosts_from_config"]

log = logging.getLogger("actors")

#: The only ``ca`` Monarch's bootstrap takes here: the session's CURVE key does the authenticating.
_CA = "trust_all_connections"
#: How long attaching waits for every worker loop to answer.
ATTACH_TIMEOUT = 30.0
#: How long a request to an agent may take before the host counts as unreachable (``exits`` waits 10 s itself).
REQUEST_TIMEOUT = 60.0
#: How long a spawn may take: longer than the agent's own wait for its worker's start (past which the agent
#: kills it), so a worker this controller gave up on is never one the agent still lets run.
SPAWN_TIMEOUT = SPAWN_REPORT_TIMEOUT + 30.0
#: How long shutting down waits for the agents to end their workers.
STOP_TIMEOUT = 15.0
#: How long it waits for an agent that never answered ``start`` (its worker may be unreachable): it is asked all
#: the same, and the request stays queued for it after the wait.
UNANSWERED_STOP_TIMEOUT = 3.0


class AttachedHostMesh(RemoteHostMesh):
    """Hosts running worker loops, attached by this controller: ``spawn_procs(per_host)`` starts processes on each.

    Returned while its agents are still being asked to start: ``initialized``
    waits for them, and so does anything that needs the hosts (``spawn_procs``,
    ``hosts``, ``slice``), except on an event loop, which it never blocks.
    """

    def __init__(
        self,
        rt: Runtime,
        addresses: list[str],
        handles: list[ActorMesh[HostAgent]],
        lifelines: Lifelines,
        agents: list[ProcMesh],
        timeout: float,
    ) -> None:
        super().__init__(rt, [], lifelines)
        self._agents = agents  # the worker loops' processes, as handles (ended by shutdown(), not at our exit)
        self._handles = handles
        self._attaching = Attaching(rt, addresses, list(handles), timeout, self._install)
        self._deadlines = RequestDeadlines(rt)
        #: Hosts whose lifeline ended (runtime's thread): one lost otherwise (a request failed) may still serve.
        self._lines_ended: set[int] = set()
        #: Hosts lost otherwise, whose line this side then ended (their workers end; their loops may still serve).
        self._lines_cut: set[int] = set()
        at_runtime_exit(lambda: self._release(end_hosts=False))

    def _install(self, nodes: list[RemoteNode]) -> None:
        """Every agent answered (runtime's thread): the hosts are these, watched from now on."""
        self._nodes = nodes
        for node in nodes:
            self._watch(node)

    def __repr__(self) -> str:
        return f"<AttachedHostMesh {[node.node for node in self._nodes] or self._attaching.addresses}>"

    def _lifeline_lost(self, index: int, why: str) -> None:
        """A host's lifeline ended (lifeline thread): that host is lost, or, before every host answered,
        attaching failed (decided on the runtime's thread, where the hosts are installed)."""

        def lose() -> None:
            self._lines_ended.add(index)
            if self.closed:  # (a host ends its lifeline as it stops: no loss)
                return
            if self._nodes:
                if 0 <= index < len(self._nodes):
                    self._lose(self._nodes[index], why)
            elif 0 <= index < len(self._attaching.addresses):
                self._attaching.lost(index, why)
                agent_ref = self._agents[index]._procs[0]
                self._rt.registry.mark_dead(agent_ref, f"its host was lost ({why})")  # its open questions fail

        self._relay.call_soon(lose)

    @property
    def initialized(self) -> Future[Literal[True]]:
        """Monarch's readiness future: ``True`` once every worker answered; raises why attaching failed."""
        attaching = self._attaching

        async def make() -> Literal[True]:
            await attaching.wait_async()
            return True

        def wait_sync(timeout: float | None) -> Literal[True]:
            attaching.wait(timeout)
            return True

        return Future(make, wait_sync, any_thread=True)

    def _attached(self) -> None:
        """Wait until attached (raising why not); on an event loop, refuse instead of blocking it."""
        ready = self._attaching.ready
        if not ready.done() and loop_running():
            raise RuntimeError(
                f"{self!r} is still attaching its workers: await its `initialized` first (waiting for them here "
                "would block the event loop)"
            )
        self._attaching.wait(None)

    @property
    def extent(self) -> Extent:
        return Extent(["hosts"], [len(self._nodes) if self._nodes else len(self._attaching.addresses)])

    @property
    def hosts(self) -> list[dict[str, Any]]:
        self._attached()
        return super().hosts

    def slice(self, hosts: int | slice) -> RemoteHostMesh:
        self._attached()
        return super().slice(hosts)

    def _spawn(
        self, per: dict[str, int], boot: str | None, name: str | None, threads: int, policy: RestartPolicy
    ) -> ProcMesh:
        if not self.closed:
            self._attached()
        return super()._spawn(per, boot, name, threads, policy)

    def _request(self, node: RemoteNode, op: str, args: tuple[Any, ...], done: Requested) -> None:
        agent: ActorMesh[HostAgent] = node.handle

        def answered(call: PendingCall) -> None:
            if call.error is not None:
                done(None, call.error)
            else:
                done(call.results[0], None)

        pending = ask_agent(self._rt, agent, op, args, answered)  # (answered is attached as the request leaves)
        if not pending.done:
            timeout = SPAWN_TIMEOUT if op == "spawn" else REQUEST_TIMEOUT
            self._rt.driver.on_thread(lambda: self._deadlines.add(pending, timeout))

    def _fetch_addresses(self, nodes: list[RemoteNode], count: int) -> list[list[str]]:
        calls = [ask_agent(self._rt, node.handle, "addresses", (count,)) for node in nodes]
        deadline = time.monotonic() + REQUEST_TIMEOUT  # (asked at once: one bound for all the answers)
        return [_wait(self._rt, call, max(0.0, deadline - time.monotonic()), "free addresses") for call in calls]

    def _lose(self, node: RemoteNode, why: str) -> None:
        if node.lost or self.closed:
            return
        if node.index not in self._lines_ended:
            self._lines_cut.add(node.index)  # (lost by a request: the base ends its line)
        super()._lose(node, why)
        agent_ref = self._agents[node.index]._procs[0]  # (the handle's targets raise once its mesh is stopping)
        self._rt.registry.mark_dead(agent_ref, f"its host was lost ({why})")  # its pending requests fail now

    def _release(self, end_hosts: bool) -> None:
        """End every process this mesh started on every host, then the worker loops (``shutdown()``, as in
        Monarch) or, at this program's exit, only the agents (the loops serve the next controller).

        A mesh still attaching stops attaching, and asks the agents that started their forkserver; a
        ``shutdown()`` also asks those that have not answered ``start`` yet (a stop queued behind the start
        ends the forkserver it starts, and the loop), waiting for them only briefly (their worker may never have
        been reachable). At exit the lifelines' end stops those. Every wait runs to one deadline per agent.
        """
        if self.closed:
            return
        self.closed = True
        self._attaching.cancel("its host mesh was shut down before it attached")
        revived: set[int] = set()
        if self._nodes:
            waits = {node.index: STOP_TIMEOUT for node in self._nodes if not node.lost}
            if end_hosts:  # a host lost by a failed request, its lifeline holding, may serve still: asked briefly
                revived = set(self._rt.driver.on_thread(self._revive_reachable_agents))
                waits.update((index, UNANSWERED_STOP_TIMEOUT) for index in revived)
        else:
            started = set(self._attaching.started)
            unanswered = self._rt.driver.on_thread(self._attaching.unanswered) if end_hosts else []
            waits = {i: STOP_TIMEOUT if i in started else UNANSWERED_STOP_TIMEOUT for i in [*started, *unanswered]}
        now = time.monotonic()
        deadlines = {index: now + wait for index, wait in waits.items()}

        def left(index: int) -> float:
            return max(0.0, deadlines[index] - time.monotonic())

        calls = {
            index: ask_agent(self._rt, self._handles[index], "shut_down", (end_hosts,), despite_loss=index in revived)
            for index in waits
        }
        if end_hosts:
            for index in waits:
                self._agents[index]._expect_exit()  # the loop's process ends after answering
        for index, call in calls.items():
            with contextlib.suppress(Exception):
                _wait(self._rt, call, left(index), "the hosts to stop their workers")
        if not end_hosts:  # the agent actors only: their process is the worker loop
            stops = {index: self._handles[index].stop() for index in waits}
            for index, stop in stops.items():
                with contextlib.suppress(Exception):
                    stop.get(timeout=left(index))
        self._relay.close()
        self._lifelines.close()
        self._forget_workers("its host mesh was shut down")
        self._deadlines.close()

    def _revive_reachable_agents(self) -> list[int]:
        """The hosts lost while their lifeline held (runtime's thread), their agents callable again: a request to
        one failed (it timed out), and this side ended its line, but its worker loop may still serve, and
        ``shutdown()`` ends it."""
        revived = []
        for node in self._nodes:
            if node.lost and (node.index not in self._lines_ended or node.index in self._lines_cut):
                agent_ref = self._agents[node.index]._procs[0]
                self._rt.registry.revive(agent_ref, agent_ref.pid)  # (a pid gone by now is seen dead at once)
                revived.append(node.index)
        return revived


def _wait(rt: Runtime, pending: PendingCall, timeout: float, what: str) -> Any:
    """The answer of ``pending``, waited for by a caller that is not on a running event loop."""
    return pending_future(rt, pending, lambda results: results[0], what).get(timeout=timeout)


def _use_tcp() -> Runtime:
    """This process's runtime, on tcp with the session's CURVE key (started that way if it did not exist yet)."""
    use_tcp("attach_to_workers()", "127.0.0.1", "the address the workers reach this machine at")
    if not os.environ.get(CURVE_PUBLIC_ENV) or not os.environ.get(CURVE_SECRET_ENV):
        raise RuntimeError(
            f"attach_to_workers() needs the session's CURVE key that the workers hold ({CURVE_PUBLIC_ENV} and "
            f"{CURVE_SECRET_ENV} in this environment; actors.new_session_keys() makes a pair for both sides)"
        )
    rt = runtime()
    if session_keys() is None:
        raise RuntimeError("workers are attached over CURVE-authenticated tcp only; unset ACTORS_CURVE=0")
    return rt


def attach_to_workers(
    *,
    private_key: bytes | None = None,
    ca: str = "trust_all_connections",
    workers: Sequence[str | Future[str]],
    name: str | None = None,
    timeout: float = ATTACH_TIMEOUT,
) -> AttachedHostMesh:
    """A host mesh over worker loops already running at ``workers``, Monarch's way.

    Each worker was started with ``run_worker_loop_forever(address=...)``, by a
    scheduler, a script or a person, with the same session CURVE key as this
    process (``ACTORS_CURVE_PUBLIC`` / ``ACTORS_CURVE_SECRET``); each address is
    ``tcp://host:port`` or ``ipc:///absolute/path`` (a worker on this machine),
    optionally as ``<proc-id>@<url>``. Returns at once, on an event loop too:
    ``initialized`` (and ``spawn_procs``) waits until every worker answered,
    and fails with ``attach failed`` naming a worker that did not within
    ``timeout`` s (a worker that does not hold the key never does).
    ``shutdown()`` ends the worker loops too; at this program's exit they keep
    serving the next controller.
    """
    check_worker_loop_args(private_key, ca)
    if isinstance(workers, str) or not workers:
        raise TypeError(f"workers must be a non-empty list of worker addresses, not {workers!r}")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    lost_after = silence_bound()  # a bad setting refused before anything starts
    given_by = time.monotonic() + timeout  # (addresses given as futures: resolved first, in synchronous code)
    addresses = [
        attach_address(w.get(timeout=max(0.0, given_by - time.monotonic())) if isinstance(w, Future) else w)
        for w in workers
    ]
    rt = _use_tcp()
    lifelines = Lifelines(tcp_host(rt.address) or "127.0.0.1", lost_after)
    agents: list[ProcMesh] = []
    handles: list[ActorMesh[HostAgent]] = []  # (actor meshes, typed as the class, as spawn returns them)
    try:
        for index, address in enumerate(addresses):
            ref = rt.registry.placed(address)
            if ref.dead:  # lost by an earlier host mesh of this process, and serving again
                rt.registry.revive(ref, None)
            procs = ProcMesh(f"{name or 'workers'}-{index}", {"procs": 1}, [ref], owned=False)
            agents.append(procs)
            handles.append(procs.spawn("host_agent", HostAgent, lifelines.ticket(index)))  # type: ignore[arg-type]
        return AttachedHostMesh(rt, addresses, handles, lifelines, agents, timeout)
    except BaseException:
        lifelines.close()
        raise


def hosts_from_config(name: str, hosts: int = 2) -> AttachedHostMesh:
    """Monarch's stand-in for a scheduler's config: ``hosts`` worker loops started here, attached as one mesh.

    Each worker loop is a process of this machine serving a unix socket in a
    private folder (no tcp port to race for), holding this session's CURVE
    key (made now if the environment has none, before the runtime starts);
    they end with this process. A real deployment starts
    ``run_worker_loop_forever`` on each machine and calls
    :func:`attach_to_workers` with their addresses.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a host mesh's name must be a non-empty string, not {name!r}")
    if type(hosts) is not int or hosts < 1:
        raise ValueError(f"hosts must be a positive int, not {hosts!r}")
    if not os.environ.get(CURVE_PUBLIC_ENV) or not os.environ.get(CURVE_SECRET_ENV):
        if current_runtime() is not None:
            raise RuntimeError(
                "hosts_from_config() must make this session's CURVE key before the actors runtime starts: call it "
                f"first, or set {CURVE_PUBLIC_ENV} / {CURVE_SECRET_ENV} (actors.new_session_keys())"
            )
        os.environ.update(new_session_keys())
    _use_tcp()
    folder = make_runtime_dir()
    loops: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for i in range(hosts):  # (one that cannot start ends those started before it)
            loops.append(_start_worker_loop(f"ipc://{folder}/loop{i}"))
        mesh = attach_to_workers(workers=[address for address, _ in loops], name=name)
    except BaseException:
        _end_worker_loops(loops, folder)
        raise
    at_runtime_exit(lambda: _end_worker_loops(loops, folder))  # after the mesh's own shutdown, which needs them
    return mesh


def _start_worker_loop(address: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A worker loop at ``address``, a child of this process that ends when this process does."""
    boot = f"from actors import run_worker_loop_forever; run_worker_loop_forever(address={address!r}, ca={_CA!r})"
    env = {key: value for key, value in os.environ.items() if key not in (SESSION_ENV, HOST_ID_ENV)}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    child = subprocess.Popen([sys.executable, "-c", boot], env=env, preexec_fn=_die_with_parent)
    return address, child


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _end_worker_loops(loops: list[tuple[str, subprocess.Popen[bytes]]], folder: str) -> None:
    for _, child in loops:
        if child.poll() is None:
            child.terminate()
    for _, child in loops:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
    shutil.rmtree(folder, ignore_errors=True)
