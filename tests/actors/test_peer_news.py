"""News of peers on other hosts: deaths and restarts told by their owner, and handles that follow a move.

The whole path (a node lost, a worker's call failing, a rank restarted on a
live node) runs on a Ray cluster in ``test_ray.py``; these pin each piece.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from actors import DecodeError
from actors._runtime._core import runtime
from actors._shared._liveness import ProcRef
from actors._shared._session import write_incarnation
from actors._transport._peer_news import PeerNews
from actors._transport._registry import Registry
from actors._wire._records import Header, Kind, ProcessLost, ProcessRestarted, decode_record

FAR = "tcp://10.255.0.7:41000"  # another machine's address: no pid of it is watched here
ELSEWHERE = "tcp://10.255.0.8:42000"
OWNER = Header("tcp://10.255.0.1:40000", 4242)


class FakeRuntime:
    """A Newsroom (what PeerNews uses of a runtime) whose send records instead of sending."""

    def __init__(self, registry: Registry, address: str = "ipc:///nowhere/c1.sock") -> None:
        self.registry = registry
        self.address = address
        self.closed = False
        self.routes: dict[Any, Any] = {}  # record type -> handler, as the runtime's inbox routes them
        self.sent: list[tuple[str, Any]] = []
        self.children: list[str] = []  # the processes this one spawned, by address, in order
        self.owner_ref: ProcRef | None = None  # a worker's: the process that spawned it

    def send(self, ref: Any, record: Any, *, urgent: bool) -> None:
        self.sent.append((ref.address, record))

    def relocate(self, ref: Any, address: str, remote: bool | None = None) -> None:
        self.registry.relocate(ref, address, remote)

    def owns(self, address: str) -> bool:
        return address in self.children

    def spawned(self) -> list[str]:
        return list(self.children)

    def owner(self) -> ProcRef | None:
        return self.owner_ref


@pytest.fixture
def news(tmp_path):
    registry = Registry(str(tmp_path), os.getpid(), authenticated=True)  # a session over tcp: CURVE-keyed links
    rt = FakeRuntime(registry)
    peer_news = PeerNews(rt)
    rt.routes = {ProcessLost: peer_news.on_lost, ProcessRestarted: peer_news.on_restarted}  # as Runtime wires it
    registry.seen_deaths.connect(peer_news.seen_dying)
    yield SimpleNamespace(news=peer_news, rt=rt, registry=registry)
    registry.close()


def test_the_records_round_trip_and_malformed_ones_are_refused():
    for record in (ProcessLost(FAR, "killed by SIGKILL", 0), ProcessRestarted(FAR, ELSEWHERE, 1)):
        assert decode_record(record.to_wire()) == record
    for fields in (
        [Kind.LOST, FAR, "x"],
        [Kind.LOST, FAR, 3, 0],
        [Kind.LOST, FAR, "x", -1],
        [Kind.LOST, FAR, "x", True],
        [Kind.LOST, FAR, "x", 1.0],
        [Kind.RESTARTED, FAR, None, 1],
        [Kind.RESTARTED, 1, ELSEWHERE, 1],
        [Kind.RESTARTED, FAR, ELSEWHERE, 0],
        [Kind.RESTARTED, FAR, ELSEWHERE, 1, "extra"],
    ):
        with pytest.raises(DecodeError):
            decode_record(fields)


def test_news_of_a_remote_death_marks_it_dead_once(news):
    rt, registry = news.rt, news.registry
    deaths: list[Any] = []
    registry.deaths.connect(deaths.append)
    far = registry.proc(FAR, 77)
    assert far.remote, "a tcp host that is not this machine's"
    rt.routes[ProcessLost](ProcessLost(FAR, "killed by SIGKILL", 0), [], OWNER, 0)
    assert far.dead and deaths == [far]
    assert "killed by SIGKILL" in far.exit_reason and OWNER.address in far.exit_reason
    rt.routes[ProcessLost](ProcessLost(FAR, "again", 0), [], OWNER, 0)
    assert deaths == [far], "a death is announced to the listeners once"


def test_news_of_a_death_on_this_host_or_of_a_stranger_changes_nothing(news, tmp_path):
    rt, registry = news.rt, news.registry
    local = registry.proc(f"ipc://{tmp_path}/w1-0.sock", os.getpid())  # watched here, by its pidfd
    rt.routes[ProcessLost](ProcessLost(local.address, "rumour", 0), [], OWNER, 0)
    rt.routes[ProcessLost](ProcessLost(ELSEWHERE, "never met", 0), [], OWNER, 0)
    assert not local.dead and ELSEWHERE not in registry.procs


def test_a_restart_elsewhere_moves_every_handle_to_the_new_address(news):
    rt, registry = news.rt, news.registry
    far = registry.proc(FAR, 77)
    rt.routes[ProcessLost](ProcessLost(FAR, "its node was lost", 0), [], OWNER, 0)
    rt.routes[ProcessRestarted](ProcessRestarted(FAR, ELSEWHERE, 1), [], OWNER, 0)
    assert far.address == ELSEWHERE and not far.dead and far.pid is None
    assert registry.procs[ELSEWHERE] is far and FAR not in registry.procs
    assert registry.proc(FAR, 77) is far, "a handle sent before the move still means the replacement"
    assert registry.find(FAR) is far
    assert registry.proc(ELSEWHERE, 91) is far and far.pid == 91, "the replacement's first message gives its pid"


def test_a_restart_news_without_the_death_first_still_fails_what_waited_on_the_old_process(news):
    rt, registry = news.rt, news.registry
    deaths: list[Any] = []
    registry.deaths.connect(deaths.append)
    far = registry.proc(FAR, 77)
    rt.routes[ProcessRestarted](ProcessRestarted(FAR, FAR, 1), [], OWNER, 0)  # same address, same host
    assert deaths == [far], "calls in flight to the old process fail"
    assert not far.dead and far.address == FAR


def test_a_replacement_that_spoke_before_its_restart_news_is_not_failed_again(news):
    rt, registry = news.rt, news.registry
    deaths: list[Any] = []
    registry.deaths.connect(deaths.append)
    far = registry.proc(FAR, 77)
    rt.routes[ProcessLost](ProcessLost(FAR, "its node was lost", 0), [], OWNER, 0)
    assert registry.proc(FAR, 91) is far and not far.dead, "its first message, from a new pid, revives the handle"
    rt.routes[ProcessRestarted](ProcessRestarted(FAR, FAR, 1), [], OWNER, 0)  # the owner's news, by another link
    assert deaths == [far] and not far.dead and far.pid == 91, "calls already on their way to it must not fail"


def test_moves_chain_and_a_fresh_process_at_an_old_address_is_not_a_moved_one(news):
    registry = news.registry
    far = registry.proc(FAR, 77)
    third = "tcp://10.255.0.9:43000"
    registry.relocate(far, ELSEWHERE)
    registry.relocate(far, third)
    assert registry.find(FAR) is far and registry.find(ELSEWHERE) is far and far.address == third
    fresh = registry.placed(FAR)
    assert fresh is not far and registry.find(FAR) is fresh


def test_a_process_moved_onto_this_host_is_no_longer_remote(news, tmp_path):
    registry = news.registry
    far = registry.proc(FAR, 77)
    registry.relocate(far, "tcp://127.0.0.1:45000")
    assert not far.remote, "its pid is a process of this machine now"
    assert registry.relocate(far, "tcp://127.0.0.1:45000") == "tcp://127.0.0.1:45000", "a move to itself: no-op"


def test_deaths_on_one_host_are_told_to_nobody(news, tmp_path):
    peer_news, rt, registry = news.news, news.rt, news.registry
    dead = registry.proc(f"ipc://{tmp_path}/w1-1.sock", None)
    registry.proc(f"ipc://{tmp_path}/w1-2.sock", None)
    dead.exit_reason = "killed by SIGKILL"
    peer_news.lost(dead)
    assert rt.sent == [], "every peer here sees the death through its own pidfd"


def test_a_death_is_told_to_every_live_peer_that_may_be_elsewhere(news, tmp_path):
    peer_news, rt, registry = news.news, news.rt, news.registry
    local = registry.proc(f"ipc://{tmp_path}/w1-3.sock", None)
    far = registry.proc(FAR, 77)
    gone = registry.proc(ELSEWHERE, 78)
    gone.dead = True
    local.exit_reason = "exited with code 1"
    peer_news.lost(local)
    assert rt.sent == [(FAR, ProcessLost(local.address, "exited with code 1", 0))], "not itself, not the dead"
    rt.sent.clear()
    far.incarnation = 1  # its owner stamps the replacement before telling of it
    peer_news.restarted(FAR, far)  # a remote process: everyone may hold a handle that cannot see it
    assert [address for address, _ in rt.sent] == [local.address]


SPAWNED = "tcp://10.255.0.20:44000"  # a process this one spawned, on another host than the news' subject
SPAWNED_HERE = "ipc:///nowhere/w9-0.sock"  # one it spawned on this host
SENDER = Header("tcp://10.255.0.21:40000", 4343)


def spawned(news: Any, *addresses: str) -> None:
    for address in addresses:
        news.registry.proc(address, None)
        news.rt.children.append(address)


def told(news: Any) -> list[tuple[str, Any]]:
    sent, news.rt.sent = news.rt.sent, []
    return sent


def test_news_heard_is_passed_down_to_the_processes_spawned_here_on_other_hosts(news, tmp_path):
    rt = news.rt
    spawned(news, SPAWNED, SPAWNED_HERE, SENDER.address)
    news.registry.proc(ELSEWHERE, 5)  # a peer this process knows but did not spawn: its owner tells it
    lost = ProcessLost(FAR, "its node was lost", 0)
    rt.routes[ProcessLost](lost, [], SENDER, 0)
    assert told(news) == [(SPAWNED, lost), (SPAWNED_HERE, lost)], "not the sender; the subject is on another host"
    restarted = ProcessRestarted(FAR, "tcp://10.255.0.9:43000", 1)
    rt.routes[ProcessRestarted](restarted, [], SENDER, 0)
    assert told(news) == [(SPAWNED, restarted), (SPAWNED_HERE, restarted)]
    local = f"ipc://{tmp_path}/w1-5.sock"
    rt.routes[ProcessLost](ProcessLost(local, "exited", 0), [], SENDER, 0)
    assert [address for address, _ in told(news)] == [SPAWNED], "one on this host sees a death here by itself"


def test_news_of_a_process_this_one_never_met_still_goes_down(news):
    spawned(news, SPAWNED)
    news.rt.routes[ProcessLost](ProcessLost(ELSEWHERE, "never met", 0), [], SENDER, 0)
    assert ELSEWHERE not in news.registry.procs, "no handle is made for it"
    assert told(news) == [(SPAWNED, ProcessLost(ELSEWHERE, "never met", 0))], "a process spawned here may hold one"


def test_news_of_this_process_itself_is_not_passed_down(news):
    spawned(news, SPAWNED)
    news.rt.routes[ProcessLost](ProcessLost(news.rt.address, "its node was lost", 0), [], OWNER, 0)
    news.rt.routes[ProcessRestarted](ProcessRestarted(FAR, news.rt.address, 1), [], OWNER, 0)
    assert told(news) == [], "its own children would take a live parent for dead"


def test_news_arriving_twice_is_applied_and_passed_down_once(news):
    rt, registry = news.rt, news.registry
    deaths: list[Any] = []
    registry.deaths.connect(deaths.append)
    far = registry.proc(FAR, 77)
    spawned(news, SPAWNED)
    lost = ProcessLost(FAR, "its node was lost", 0)
    rt.routes[ProcessLost](lost, [], OWNER, 0)
    rt.routes[ProcessLost](lost, [], SENDER, 0)  # the same news, by another path
    assert deaths == [far] and told(news) == [(SPAWNED, lost)]
    restarted = ProcessRestarted(FAR, FAR, 1)
    rt.routes[ProcessRestarted](restarted, [], OWNER, 0)
    rt.routes[ProcessRestarted](restarted, [], SENDER, 0)
    assert deaths == [far] and told(news) == [(SPAWNED, restarted)]


@pytest.mark.parametrize("new_address", [FAR, ELSEWHERE], ids=["same-address", "moved"])
def test_news_of_a_death_arriving_after_the_restart_cannot_undo_it(news, new_address):
    rt, registry = news.rt, news.registry
    far = registry.proc(FAR, 77)
    spawned(news, SPAWNED)
    rt.routes[ProcessLost](ProcessLost(FAR, "its node was lost", 0), [], OWNER, 0)
    rt.routes[ProcessRestarted](ProcessRestarted(FAR, new_address, 1), [], OWNER, 0)
    told(news)
    rt.routes[ProcessLost](ProcessLost(FAR, "its node was lost", 0), [], SENDER, 0)  # late, by a longer path
    assert not far.dead and far.address == new_address and far.incarnation == 1
    assert told(news) == [], "stale news goes no further"
    rt.routes[ProcessLost](ProcessLost(new_address, "lost again", 1), [], OWNER, 0)
    assert far.dead and "lost again" in far.exit_reason, "the replacement's own death is news"


def test_a_handle_made_after_a_restart_takes_the_next_death(news):
    rt, registry = news.rt, news.registry
    far = registry.proc(ELSEWHERE, 80)  # learned only after its owner restarted it once
    rt.routes[ProcessLost](ProcessLost(ELSEWHERE, "lost", 1), [], OWNER, 0)
    assert far.dead and far.incarnation == 1


def test_news_this_process_gave_comes_back_as_old(news, tmp_path):
    peer_news, rt, registry = news.news, news.rt, news.registry
    mine = registry.proc(FAR, 77)  # one this process owns, on another host
    spawned(news, SPAWNED)
    mine.exit_reason = "its node was lost"
    peer_news.lost(mine)
    assert told(news) == [(SPAWNED, ProcessLost(FAR, "its node was lost", 0))]
    rt.routes[ProcessLost](ProcessLost(FAR, "its node was lost", 0), [], SENDER, 0)
    assert told(news) == [], "a peer passing it back starts no second round"


HERE_TCP = "tcp://127.0.0.1:45001"  # a peer on this host that speaks tcp (it may have spawned elsewhere)


@pytest.fixture
def sleepers():
    """Real processes to watch and kill: their deaths reach the registry through pidfds."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen(["sleep", "600"]))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def handle_exits(registry: Registry) -> None:
    """What the event loop does with every pidfd that turned readable: report that process's death."""
    ready, _, _ = select.select(registry.watcher.fds(), [], [], 0)
    for fd in ready:
        registry.watcher.check(fd)


def kill_unseen(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` but leave its pidfd's event unhandled: the event loop has not got to it yet."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def see_die(registry: Registry, proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and let the registry see it go through its pidfd."""
    kill_unseen(proc)
    handle_exits(registry)


def test_a_death_seen_here_is_passed_down_to_the_processes_spawned_elsewhere(news, sleepers):
    rt, registry = news.rt, news.registry
    spawned(news, SPAWNED, SPAWNED_HERE)
    peer = sleepers()
    here = registry.proc(HERE_TCP, peer.pid)
    see_die(registry, peer)
    assert here.dead and "process exited" in here.exit_reason
    lost = ProcessLost(HERE_TCP, "process exited", 0)
    assert told(news) == [(SPAWNED, lost)], "one spawned on this host watches the pid itself"
    rt.routes[ProcessLost](lost, [], OWNER, 0)  # the owner's copy, if it knows that process too
    assert told(news) == [], "seen and passed on once"


def test_a_death_seen_here_of_a_process_this_one_owns_is_told_once(news, sleepers):
    rt, registry = news.rt, news.registry
    spawned(news, SPAWNED)
    peer = sleepers()
    mine = registry.proc(HERE_TCP, peer.pid)
    rt.children.append(HERE_TCP)  # one of ours: the owner's death listener tells everyone (``lost``)
    see_die(registry, peer)
    assert mine.dead and told(news) == []


@pytest.mark.parametrize("kind", ["death", "restart"])
def test_news_of_a_process_here_is_told_to_the_peers_here_on_tcp(news, tmp_path, kind):
    peer_news, registry = news.news, news.registry
    here = registry.proc("tcp://127.0.0.1:45002", None)
    ipc_peer = registry.proc(f"ipc://{tmp_path}/w1-6.sock", None)
    registry.proc(FAR, 77)
    tcp_peer = registry.proc(HERE_TCP, None)
    if kind == "death":
        here.exit_reason = "exited with code 1"
        peer_news.lost(here)
    else:
        here.incarnation = 1
        peer_news.restarted(here.address, here)
    assert [address for address, _ in told(news)] == [FAR, HERE_TCP], "not the ipc peer: it has none elsewhere"
    assert not ipc_peer.dead and not tcp_peer.dead


def test_a_restart_follows_a_death_seen_here_down_the_tree(news, sleepers, tmp_path):
    rt, registry = news.rt, news.registry
    spawned(news, SPAWNED, SPAWNED_HERE, HERE_TCP)
    old, new = sleepers(), sleepers()
    subject = "tcp://127.0.0.1:45003"
    here = registry.proc(subject, old.pid)
    see_die(registry, old)
    assert [address for address, _ in told(news)] == [SPAWNED, HERE_TCP], "not the one on ipc"
    write_incarnation(str(tmp_path), subject, new.pid)  # its owner restarted it at the same address
    restarted = ProcessRestarted(subject, subject, 1)
    rt.routes[ProcessRestarted](restarted, [], OWNER, 0)
    assert not here.dead and here.pid == new.pid and here.incarnation == 1, "the handle follows the new process"
    assert told(news) == [(SPAWNED, restarted), (HERE_TCP, restarted)], "who may have passed the death on hears"
    see_die(registry, new)
    lost = ProcessLost(subject, "process exited", 1)
    assert here.dead and told(news) == [(SPAWNED, lost), (HERE_TCP, lost)], "a new incarnation"


def test_a_restart_heard_before_the_old_process_exit_was_handled_here(news, sleepers, tmp_path):
    rt, registry = news.rt, news.registry
    spawned(news, SPAWNED)
    old, new = sleepers(), sleepers()
    subject = "tcp://127.0.0.1:45004"
    here = registry.proc(subject, old.pid)
    kill_unseen(old)
    lost = ProcessLost(subject, "process exited", 5)
    rt.routes[ProcessLost](lost, [], OWNER, 0)  # the owner's news outran this process's own pidfd event
    assert not here.dead, "a peer on this host is declared dead by its pidfd only"
    write_incarnation(str(tmp_path), subject, new.pid)
    restarted = ProcessRestarted(subject, subject, 9)
    rt.routes[ProcessRestarted](restarted, [], OWNER, 0)
    handle_exits(registry)  # the loop gets to the old exit at last
    assert not here.dead and here.pid == new.pid, "the old exit was taken first; it cannot fail the replacement"
    assert told(news) == [(SPAWNED, lost), (SPAWNED, restarted)], "no death of the replacement is made up"


def test_a_restart_does_not_take_the_old_pid_back_from_a_stale_record(news, sleepers, tmp_path):
    rt, registry = news.rt, news.registry
    old, new = sleepers(), sleepers()
    subject = "tcp://127.0.0.1:45005"
    write_incarnation(str(tmp_path), subject, old.pid)  # not yet rewritten by the replacement's fork
    here = registry.proc(subject, None)
    assert here.pid == old.pid
    kill_unseen(old)
    rt.routes[ProcessRestarted](ProcessRestarted(subject, subject, 9), [], OWNER, 0)
    assert not here.dead and here.pid is None and here in registry.unresolved, "waits for the replacement's pid"
    write_incarnation(str(tmp_path), subject, new.pid)
    registry.retry_unresolved()
    assert here.pid == new.pid and not here.dead


def test_a_peer_here_restarted_elsewhere_lets_go_of_its_old_pid(news, sleepers):
    rt, registry = news.rt, news.registry
    deaths: list[Any] = []
    registry.deaths.connect(deaths.append)
    old = sleepers()  # still running: its host was lost to its owner, not to this process
    subject = "tcp://127.0.0.1:45006"
    here = registry.proc(subject, old.pid)
    rt.routes[ProcessLost](ProcessLost(subject, "its host was lost", 5), [], OWNER, 0)
    rt.routes[ProcessRestarted](ProcessRestarted(subject, FAR, 9), [], OWNER, 0)
    assert deaths == [here], "calls in flight to the old process fail"
    assert here.address == FAR and here.remote and not here.dead and here.pid is None
    see_die(registry, old)
    assert deaths == [here] and not here.dead, "the old process ending later is not the replacement's death"


def test_news_of_a_new_process_at_a_dead_one_s_address_is_not_stale(news):
    rt, registry = news.rt, news.registry
    spawned(news, SPAWNED)
    far = registry.proc(FAR, 77)
    first = ProcessLost(FAR, "killed", 100)
    rt.routes[ProcessLost](first, [], OWNER, 0)
    assert far.dead
    assert registry.proc(FAR, 88) is far and not far.dead, "another process took the address"
    second = ProcessLost(FAR, "killed too", 200)  # stamped later by whoever started it
    rt.routes[ProcessLost](second, [], OWNER, 0)
    assert far.dead and "killed too" in far.exit_reason
    stranger = [ProcessLost(ELSEWHERE, "gone", 100), ProcessLost(ELSEWHERE, "gone", 200)]
    for record in stranger:
        rt.routes[ProcessLost](record, [], OWNER, 0)
    assert told(news) == [(SPAWNED, first), (SPAWNED, second), *[(SPAWNED, r) for r in stranger]]


def test_news_goes_up_to_this_process_owner_too_but_not_back_to_whoever_told_it(news):
    rt, registry = news.rt, news.registry
    owner = registry.proc(ELSEWHERE, 66)
    rt.owner_ref = owner  # a worker: the process that spawned it is a neighbour too
    spawned(news, SPAWNED)
    lost = ProcessLost(FAR, "its node was lost", 0)
    rt.routes[ProcessLost](lost, [], SENDER, 0)  # from a process this one spawned... or any other
    assert told(news) == [(SPAWNED, lost), (ELSEWHERE, lost)], "a cousin elsewhere is reached through the owner"
    restarted = ProcessRestarted(FAR, FAR, 1)
    rt.routes[ProcessRestarted](restarted, [], Header(ELSEWHERE, 66), 0)  # from the owner: only down
    assert told(news) == [(SPAWNED, restarted)]


def test_news_of_a_stranger_is_passed_on_once(news):
    spawned(news, SPAWNED)
    lost = ProcessLost(ELSEWHERE, "never met", 0)
    for sender in (OWNER, SENDER, OWNER):  # copies by several paths: the tree with the owner's shortcuts
        news.rt.routes[ProcessLost](lost, [], sender, 0)
    assert told(news) == [(SPAWNED, lost)] and ELSEWHERE not in news.registry.procs
    restarted = ProcessRestarted(ELSEWHERE, ELSEWHERE, 1)
    news.rt.routes[ProcessRestarted](restarted, [], SENDER, 0)
    news.rt.routes[ProcessLost](lost, [], SENDER, 0)  # late
    assert told(news) == [(SPAWNED, restarted)]


def test_peers_news_of_a_process_this_one_owns_changes_nothing(news):
    rt, registry = news.rt, news.registry
    mine = registry.proc(FAR, 77)
    spawned(news, FAR, SPAWNED)
    rt.routes[ProcessLost](ProcessLost(FAR, "seen by a neighbour", 0), [], SENDER, 0)
    assert not mine.dead, "its placer (or pidfd) says when it died, and the restart follows that"
    assert told(news) == [], "the owner tells the others itself"


def test_the_runtime_moves_its_meshes_and_links_with_the_process():
    rt = runtime()
    ref = rt.registry.proc(FAR, 77)

    class Mesh:
        pass

    mesh, actors = Mesh(), Mesh()
    routes = rt.mesh_routes
    routes.own(FAR, mesh)  # type: ignore[arg-type]
    routes.supervise(FAR, "gen", actors)  # type: ignore[arg-type]
    try:
        rt.relocate(ref, ELSEWHERE)
        assert rt.owns(ELSEWHERE) and not rt.owns(FAR)
        assert routes._by_process.get(ELSEWHERE) is mesh
        assert routes._by_actor.get((ELSEWHERE, "gen")) is actors and (FAR, "gen") not in routes._by_actor
        assert FAR not in rt.outbox.links
    finally:
        routes._by_process.pop(ELSEWHERE, None)
        routes._by_actor.pop((ELSEWHERE, "gen"), None)
        rt.registry.procs.pop(ELSEWHERE, None)
        rt.registry.moved.pop(FAR, None)
    del mesh, actors
    assert not rt.owns(ELSEWHERE), "the routes are weak: a mesh nobody holds hears nothing"
