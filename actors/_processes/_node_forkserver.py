"""A forkserver serving a controller on another host: spawn workers on request, report their exits.

Used by a node host that a placer started (``actors.ray``'s ``NodeHost``)
and by a worker loop a scheduler started (``run_worker_loop_forever``): the
same forkserver ``this_host()`` runs, driven by blocking calls from the
controller's side instead of a pipe the controller reads itself. Its workers
bind tcp addresses on this host's address; a lifeline to the controller
(``_lifeline.hold``) ends them all when the controller goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable

from ._forkserver import _ServerProcess
from ._forkserver_protocol import Exited, Report, Spawned, SpawnFailed, SpawnRequest, frame, read_reports
from ._lifeline import LIFELINE_THREAD, LifelineTicket, hold

__all__ = ["SPAWN_REPORT_TIMEOUT", "NodeForkserver", "free_addresses"]

log = logging.getLogger("actors")

#: How long ``spawn`` waits for the forkserver to report a new worker's pid.
SPAWN_REPORT_TIMEOUT = 60.0


class NodeForkserver:
    """This host's forkserver for a remote controller: ``spawn`` workers, ``kill`` them, hear when they exit.

    Every method blocks (briefly, or up to its timeout): callers run them
    on a thread of their own, never on an event loop.
    """

    def __init__(self, ip: str, session_dir: str) -> None:
        self.ip = ip
        self.dir = session_dir
        self._process = _ServerProcess.start(session_dir, os.path.basename(session_dir), True, fork=False)
        os.set_blocking(self._process.requests, True)
        self._lock = threading.Condition()
        #: Held while a request is written or the request pipe closed: whole frames, never a closed fd.
        self._writing = threading.Lock()
        self._requests_closed = False
        self._reports: dict[int, Report] = {}  # worker -> Spawned or SpawnFailed
        self._exits: list[Exited] = []  # not yet collected
        self._pids: dict[int, int] = {}  # worker -> pid of each worker not yet reaped
        #: Workers whose spawn gave up waiting for their report: killed when it comes (nobody would track them).
        self._abandoned: set[int] = set()
        self._lost = False
        self.stopped = False
        threading.Thread(target=self._read_reports, name="actors-node-reports", daemon=True).start()
        self._cut_lifeline: Callable[[], None] | None = None

    @classmethod
    def tied_to(cls, ip: str, session_dir: str, ticket: LifelineTicket | None) -> NodeForkserver:
        """A forkserver holding the controller's lifeline (``ticket``); stopped again if the line cannot be held."""
        node = cls(ip, session_dir)
        if ticket is not None:
            try:
                node.hold_lifeline(ticket)
            except BaseException:
                node.stop()
                raise
        return node

    def hold_lifeline(self, ticket: LifelineTicket) -> None:
        """Hold a lifeline to the controller: when it ends, every worker here is ended."""
        self._cut_lifeline = hold(ticket, self._controller_lost)

    def _controller_lost(self, why: str) -> None:
        """The controller is gone (or cut off): end this host's workers rather than leave them orphaned."""
        log.error("ending this host's actors processes: %s", why)
        self.stop()

    def addresses(self, count: int) -> list[str]:
        """``count`` distinct tcp inbox addresses free on this host's address now."""
        return free_addresses(self.ip, count)

    def spawn(self, index: int, config: dict[str, object]) -> int:
        """Fork one worker from ``config`` (a ``WorkerConfig`` on the wire); its pid."""
        with self._lock:
            if self._lost:
                raise RuntimeError("this host's forkserver has exited")
        with self._writing:
            if self.stopped:
                raise RuntimeError("this host's forkserver was stopped")
            os.write(self._process.requests, frame(SpawnRequest(index, dict(config))))
        with self._lock:
            if not self._lock.wait_for(lambda: index in self._reports or self._lost, SPAWN_REPORT_TIMEOUT):
                self._abandoned.add(index)
                raise TimeoutError(f"the forkserver did not start worker {index} within {SPAWN_REPORT_TIMEOUT:g}s")
            report = self._reports.pop(index, None)
        if report is None:
            raise RuntimeError("this host's forkserver exited before starting the worker")
        if isinstance(report, SpawnFailed):
            raise RuntimeError(f"could not start the worker: {report.why}")
        assert not isinstance(report, Exited)
        return report.pid  # (its pid was recorded as the report came: an exit read with it has removed it)

    def kill(self, index: int) -> bool:
        """SIGKILL worker ``index`` (one that did not stop when asked); False if it is already gone."""
        with self._lock:
            pid = self._pids.get(index)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def exits(self, timeout: float = 10.0) -> list[Exited]:
        """Workers reaped since the last call (waits up to ``timeout`` s for one).

        Raises once the forkserver itself is gone, so the controller learns
        that every worker of this host is.
        """
        with self._lock:
            self._lock.wait_for(lambda: self._exits or self._lost, timeout)
            exits, self._exits = self._exits, []
            if not exits and self._lost:
                raise RuntimeError("this host's forkserver has exited")
            return exits

    def stop(self) -> None:
        """End every worker on this host and the forkserver (it tears them down when its pipe closes)."""
        self.stopped = True
        cut, self._cut_lifeline = self._cut_lifeline, None
        if cut is not None and threading.current_thread().name != LIFELINE_THREAD:
            cut()
        if not self._writing.acquire(timeout=5.0):  # a spawn stuck writing to a forkserver that reads no more
            self._process.kill()  # its write then fails (broken pipe) and lets go
            self._writing.acquire()
        try:
            if self._requests_closed:
                return  # (closing the fd again could close whatever reused its number)
            self._requests_closed = True
            os.close(self._process.requests)
        finally:
            self._writing.release()
        if not self._process.wait(5.0):
            self._process.kill()
            self._process.wait(5.0)

    def _read_reports(self) -> None:
        buffer = bytearray()
        fd = self._process.status
        os.set_blocking(fd, True)
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            with self._lock:
                for report in read_reports(buffer):
                    if isinstance(report, Exited):
                        self._exits.append(report)
                        self._pids.pop(report.worker, None)
                    elif report.worker in self._abandoned:
                        self._abandoned.discard(report.worker)
                        if isinstance(report, Spawned):
                            log.warning("killing worker %d (pid %d): it started after its spawn gave up", *report)
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(report.pid, signal.SIGKILL)
                    else:
                        if isinstance(report, Spawned):
                            self._pids[report.worker] = report.pid
                        self._reports[report.worker] = report
                self._lock.notify_all()
        with contextlib.suppress(OSError):
            os.close(fd)  # only this thread reads it, and it has ended
        with self._lock:
            self._lost = True
            self._lock.notify_all()


def free_addresses(ip: str, count: int) -> list[str]:
    """``count`` distinct tcp addresses free on ``ip`` now.

    Every probe stays bound until all are chosen: a port probed and closed
    at once is free for the kernel's next pick, and picks from its ~14 k
    ephemeral ports repeat within a batch of 64 about one time in eight
    (measured), which gave two ranks one address.
    """
    probes: list[socket.socket] = []
    try:
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probes.append(probe)
            probe.bind((ip, 0))
        return [f"tcp://{ip}:{probe.getsockname()[1]}" for probe in probes]
    finally:
        for probe in probes:
            probe.close()
