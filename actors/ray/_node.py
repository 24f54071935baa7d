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
from typing import Any

from .._processes._forkserver_protocol import Exited
from .._processes._lifeline import LifelineTicket
from .._processes._node_forkserver import NodeForkserver
from .._shared._session import (
    CURVE_PUBLIC_ENV,
    CURVE_SECRET_ENV,
    HOST_ID_ENV,
    SESSION_ENV,
    TCP_HOST_ENV,
    TRANSPORT_ENV,
    make_runtime_dir,
)

__all__ = ["NodeHost"]

log = logging.getLogger("actors.ray")


class NodeHost:
    """A forkserver on this node, driven through Ray: ``spawn`` workers, hear when they exit."""

    def __init__(
        self, public_key: str, secret_key: str, bind_host: str | None = None, lifeline: LifelineTicket | None = None
    ) -> None:
        import ray

        ip = bind_host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        os.environ[TRANSPORT_ENV] = "tcp"
        os.environ[TCP_HOST_ENV] = ip
        os.environ[HOST_ID_ENV] = f"ray-node-{ray.get_runtime_context().get_node_id()}"
        os.environ[CURVE_PUBLIC_ENV], os.environ[CURVE_SECRET_ENV] = public_key, secret_key
        session_dir = make_runtime_dir()
        os.environ[SESSION_ENV] = session_dir
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self._node = NodeForkserver.tied_to(ip, session_dir, lifeline)

    def info(self) -> dict[str, Any]:
        """Where this host is: its cluster address, pid, Ray node and the GPUs Ray gave it."""
        import ray

        return {
            "ip": self._node.ip,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": self.gpus,
        }

    def addresses(self, count: int) -> list[str]:
        """``count`` tcp inbox addresses free on this node's cluster address now."""
        return self._node.addresses(count)

    def spawn(self, index: int, config: dict[str, Any]) -> int:
        """Fork one worker from ``config`` (a ``WorkerConfig`` on the wire); its pid."""
        return self._node.spawn(index, config)

    def kill(self, index: int) -> bool:
        """SIGKILL worker ``index`` (one that did not stop when asked); False if it is already gone."""
        return self._node.kill(index)

    def exits(self, timeout: float = 10.0) -> list[Exited]:
        """Workers reaped since the last call (waits up to ``timeout`` s for one); raises once the forkserver is gone."""
        return self._node.exits(timeout)

    def stop(self) -> None:
        """End every worker on this node and the forkserver."""
        self._node.stop()
