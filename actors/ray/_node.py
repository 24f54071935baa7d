"""One actors host on one Ray node: a forkserver there, spawning actor processes for the controller.

Ray starts this class as an actor in the placement group's bundle for its
node. It runs the node's forkserver (the same one ``this_host()`` runs), with
tcp on the node's cluster address and the session's CURVE keys in its
environment: the keys arrive as this actor's constructor arguments, through
Ray, never on a command line or in a file. Ray carries only the placement
traffic (spawn a worker, which worker exited); every actor message goes over
the workers' own ZeroMQ sockets. When this actor dies, its forkserver's
request pipe closes and the forkserver ends every worker it started.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from .._processes._forkserver import _ServerProcess
from .._processes._forkserver_protocol import Exited, Report, SpawnFailed, SpawnRequest, frame, read_reports
from .._shared._session import (
    CURVE_PUBLIC_ENV,
    CURVE_SECRET_ENV,
    HOST_ID_ENV,
    SESSION_ENV,
    TCP_HOST_ENV,
    TRANSPORT_ENV,
    make_runtime_dir,
)
from ._lifeline import hold

__all__ = ["NodeHost"]

log = logging.getLogger("actors.ray")

#: How long ``spawn`` waits for the forkserver to report a new worker's pid.
SPAWN_REPORT_TIMEOUT = 60.0


class NodeHost:
    """A forkserver on this node, driven through Ray: ``spawn`` workers, hear when they exit."""

    def __init__(
        self, public_key: str, secret_key: str, bind_host: str | None = None, lifeline: list[Any] | None = None
    ) -> None:
        import ray

        self.ip = bind_host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        os.environ[TRANSPORT_ENV] = "tcp"
        os.environ[TCP_HOST_ENV] = self.ip
        os.environ[HOST_ID_ENV] = f"ray-node-{ray.get_runtime_context().get_node_id()}"
        os.environ[CURVE_PUBLIC_ENV], os.environ[CURVE_SECRET_ENV] = public_key, secret_key
        self.dir = make_runtime_dir()
        os.environ[SESSION_ENV] = self.dir
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self._process = _ServerProcess.start(self.dir, os.path.basename(self.dir), True, fork=False)
        os.set_blocking(self._process.requests, True)
        self._lock = threading.Condition()
        self._reports: dict[int, Report] = {}  # index -> Spawned or SpawnFailed
        self._exits: list[Exited] = []  # not yet collected
        self._pids: dict[int, int] = {}  # index -> pid of each worker not yet reaped
        self._lost = False
        threading.Thread(target=self._read_reports, name="actors-node-reports", daemon=True).start()
        self._cut_lifeline: Callable[[], None] | None = None
        if lifeline is not None:  # [controller host, port, key hex, this host's index]
            host, port, key, index = lifeline
            self._cut_lifeline = hold((host, int(port)), bytes.fromhex(key), int(index), self._controller_lost)

    def _controller_lost(self, why: str) -> None:
        """The controller is gone (or cut off): end this node's workers rather than leave them orphaned."""
        log.error("ending this node's actors processes: %s", why)
        self.stop()

    def info(self) -> dict[str, Any]:
        """Where this host is: its cluster address, pid, Ray node and the GPUs Ray gave it."""
        import ray

        return {"ip": self.ip, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "gpus": self.gpus}

    def addresses(self, count: int) -> list[str]:
        """``count`` tcp inbox addresses free on this node's cluster address now."""
        out = []
        for _ in range(count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((self.ip, 0))
                out.append(f"tcp://{self.ip}:{probe.getsockname()[1]}")
        return out

    def spawn(self, index: int, config: dict[str, Any]) -> int:
        """Fork one worker from ``config`` (a ``WorkerConfig`` on the wire); its pid."""
        with self._lock:
            if self._lost:
                raise RuntimeError("this node's forkserver has exited")
        os.write(self._process.requests, frame(SpawnRequest(index, config)))
        with self._lock:
            if not self._lock.wait_for(lambda: index in self._reports or self._lost, SPAWN_REPORT_TIMEOUT):
                raise TimeoutError(f"the forkserver did not start worker {index} within {SPAWN_REPORT_TIMEOUT:g}s")
            report = self._reports.pop(index, None)
        if report is None:
            raise RuntimeError("this node's forkserver exited before starting the worker")
        if isinstance(report, SpawnFailed):
            raise RuntimeError(f"could not start the worker: {report.why}")
        pid = int(report.pid)
        with self._lock:
            self._pids[index] = pid
        return pid

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
        that every worker of this node is.
        """
        with self._lock:
            self._lock.wait_for(lambda: self._exits or self._lost, timeout)
            exits, self._exits = self._exits, []
            if not exits and self._lost:
                raise RuntimeError("this node's forkserver has exited")
            return exits

    def stop(self) -> None:
        """End every worker on this node and the forkserver (it tears them down when its pipe closes)."""
        cut, self._cut_lifeline = self._cut_lifeline, None
        if cut is not None and threading.current_thread().name != "actors-ray-lifeline":
            cut()
        try:
            os.close(self._process.requests)
        except OSError:
            return
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
                    else:
                        self._reports[report.worker] = report
                self._lock.notify_all()
        with self._lock:
            self._lost = True
            self._lock.notify_all()
