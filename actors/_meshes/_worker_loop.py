"""A worker host that a scheduler (Slurm, Kubernetes, ssh) started: Monarch's ``run_worker_loop_forever``.

``run_worker_loop_forever(address=...)`` makes this process an actors
worker listening on ``address`` (tcp, an inherited tcp socket, or a unix
socket: :mod:`._worker_addresses`), authenticated with the session's CURVE
key on every transport (``ACTORS_CURVE_PUBLIC`` / ``ACTORS_CURVE_SECRET``,
which the controller holds too: a controller without them cannot complete
the handshake, so nothing it sends is ever read).

A controller joins it with ``attach_to_workers`` by spawning a
:class:`HostAgent` here: the agent starts this host's forkserver and forks
the controller's workers on request, each on a tcp address of this host,
and holds a lifeline to the controller. When the controller goes (its
lifeline ends), the agent ends every worker it started and the worker loop
waits for the next controller; when the controller shuts its host mesh
down, the loop ends too (``run_worker_loop_forever`` exits the process,
``run_worker_loop_until_shutdown`` returns), as Monarch's do.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from .._hosting._actor import Actor, endpoint
from .._hosting._output import ProcessOutput
from .._hosting._server import ActorServer
from .._processes._lifeline import LifelineTicket
from .._processes._node_forkserver import NodeForkserver
from .._runtime._core import Runtime, install_runtime, runtime
from .._shared._config import WorkerConfig
from .._shared._session import (
    CURVE_ENV,
    CURVE_PUBLIC_ENV,
    CURVE_SECRET_ENV,
    HOST_ID_ENV,
    TCP_HOST_ENV,
    TRANSPORT_ENV,
    bind_host,
    make_runtime_dir,
    write_incarnation,
)
from ._worker_addresses import ServingAddress, serving_address

__all__ = [
    "HostAgent",
    "check_worker_loop_args",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "start_worker_loop_forever",
]

#: How long one ``exits`` request waits for a worker to exit before answering with none.
EXITS_POLL = 10.0


class HostAgent(Actor):
    """The controller's agent on an attached worker host: this host's forkserver, driven by calls.

    ``start`` (the controller's first call) starts the forkserver and holds
    the ``lifeline`` the agent was handed, off the worker loop's event loop;
    when the lifeline ends every worker the agent started is ended.
    """

    def __init__(self, lifeline: LifelineTicket) -> None:
        self._lifeline = lifeline
        #: The forkserver's start, shared by every ``start`` call and awaited by a stop that comes meanwhile.
        self._starting: asyncio.Future[NodeForkserver] | None = None
        self._started: NodeForkserver | None = None

    @endpoint
    async def start(self) -> dict[str, Any]:
        """Start this host's forkserver, tied to the controller's lifeline (once); then :meth:`info`."""
        if self._starting is None:
            # (blocking: a process started, a tcp handshake with the controller; a failure stops the forkserver)
            lifeline = self._lifeline
            self._starting = asyncio.ensure_future(
                asyncio.to_thread(lambda: NodeForkserver.tied_to(bind_host(), make_runtime_dir(), lifeline))
            )
        self._started = await asyncio.shield(self._starting)  # (a cancelled call leaves the start running)
        return await self._where()

    @property
    def _node(self) -> NodeForkserver:
        if self._started is None:
            raise RuntimeError("this host agent was not started: call start() first")
        return self._started

    @endpoint
    async def info(self) -> dict[str, Any]:
        """Where this host is: its address, its pid, and the GPUs it may hand out."""
        return await self._where()

    async def _where(self) -> dict[str, Any]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible is not None else await asyncio.to_thread(_gpu_ids)
        return {"ip": self._node.ip, "pid": os.getpid(), "gpus": gpus}

    @endpoint
    async def addresses(self, count: int) -> list[str]:
        return self._node.addresses(count)

    @endpoint
    async def spawn(self, index: int, config: dict[str, Any]) -> int:
        return await asyncio.to_thread(self._node.spawn, index, config)

    @endpoint
    async def kill(self, index: int) -> bool:
        return self._node.kill(index)

    @endpoint
    async def exits(self) -> list[list[int]]:
        """Workers reaped since the last call, as ``[worker, pid, exit code]`` (waits a while for one)."""
        reaped = await asyncio.to_thread(self._node.exits, EXITS_POLL)
        return [[e.worker, e.pid, e.code] for e in reaped]

    @endpoint
    async def shut_down(self, end_loop: bool = False) -> None:
        """End every worker this agent started, and the forkserver; with ``end_loop``, the worker loop too.

        The loop ends after this answer has left (its host mesh was shut down, Monarch's ``shutdown()``).
        """
        await self._stop_forkserver()
        if end_loop:
            server = runtime().server
            assert server is not None  # an agent lives in a worker loop's process, which serves actors
            asyncio.get_running_loop().call_soon(server.shutdown, "its host mesh was shut down")

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await self._stop_forkserver()

    async def _stop_forkserver(self) -> None:
        """Stop the forkserver, once one still starting has started (its lifeline would end it only later)."""
        if self._starting is None:
            return
        try:
            node = await asyncio.shield(self._starting)
        except Exception:  # (it could not start: nothing runs)
            return
        if not node.stopped:
            await asyncio.to_thread(node.stop)


def _gpu_ids() -> list[str]:
    """This host's CUDA devices, by index (none without torch's CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return []
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def check_worker_loop_args(private_key: bytes | None, ca: str) -> None:
    """Monarch's TLS arguments: this project authenticates with the session's CURVE key instead."""
    if private_key is not None or ca != "trust_all_connections":
        raise NotImplementedError(
            "actors authenticates workers and controllers with the session's CURVE key "
            f"({CURVE_PUBLIC_ENV} / {CURVE_SECRET_ENV} in both environments), not TLS certificates: "
            'pass ca="trust_all_connections" and no private_key'
        )


def _serving_address(address: object) -> ServingAddress:
    serving = serving_address(address)
    if os.environ.get(CURVE_ENV, "1") == "0":
        raise RuntimeError(f"a worker loop never runs unauthenticated; unset {CURVE_ENV}=0")
    if not os.environ.get(CURVE_PUBLIC_ENV) or not os.environ.get(CURVE_SECRET_ENV):
        raise RuntimeError(
            f"a worker loop needs the session's CURVE key in its environment ({CURVE_PUBLIC_ENV} and "
            f"{CURVE_SECRET_ENV}, the same as the controller's; actors.new_session_keys() makes a pair)"
        )
    return serving


async def _serve(serving: ServingAddress) -> None:
    address = serving.address
    rt = Runtime(address=address, fd=serving.fd)
    install_runtime(rt)
    loop = rt.driver.ensure_loop()
    write_incarnation(rt.dir, rt.address, rt.pid)
    # The loop's own process is its owner: it ends only when it is killed, never with a controller.
    config = WorkerConfig(
        name=f"worker-loop {address}", address=address, owner_address=address, owner_pid=rt.pid, rank=0
    )
    server = ActorServer(
        rt, config, lambda actors: None, ProcessOutput(config.name, 0, {"stdout": sys.stdout, "stderr": sys.stderr})
    )
    loop.add_signal_handler(signal.SIGTERM, server.shutdown, "terminated")
    loop.add_signal_handler(signal.SIGINT, server.shutdown, "interrupted")
    try:
        await server.finished.wait()
    finally:
        rt.close()


def run_worker_loop_forever(*, private_key: bytes | None = None, ca: str, address: str) -> None:
    """Serve as a worker host at ``address`` until its host mesh is shut down or this process is terminated.

    ``address`` is ``tcp://host:port``, ``tcp://host:fdN`` (a tcp socket this
    process inherited, bound) or ``ipc:///absolute/path``, optionally as
    Monarch's ``<proc-id>@<url>``. Controllers join it with
    ``attach_to_workers(workers=[address, ...])``. Both sides must hold the
    session's CURVE key (``ACTORS_CURVE_PUBLIC`` and ``ACTORS_CURVE_SECRET``),
    on ipc as on tcp; ``ca`` must be ``"trust_all_connections"`` and
    ``private_key`` None (Monarch's TLS arguments; the CURVE key replaces
    them). A controller that exits leaves the loop serving the next one; one
    that calls ``shutdown()`` on its host mesh ends it, and the process exits
    (``SystemExit(0)``): it never returns.
    """
    run_worker_loop_until_shutdown(private_key=private_key, ca=ca, address=address)
    raise SystemExit(0)


def run_worker_loop_until_shutdown(*, private_key: bytes | None = None, ca: str, address: str) -> None:
    """:func:`run_worker_loop_forever` that returns when its host mesh is shut down (or it is terminated)."""
    check_worker_loop_args(private_key, ca)
    serving = _serving_address(address)
    os.environ[TRANSPORT_ENV] = "tcp"  # the session's CURVE key on every link, and tcp for the workers it forks
    os.environ[TCP_HOST_ENV] = serving.host
    os.environ.setdefault(HOST_ID_ENV, f"worker-{serving.address}")
    import uvloop

    uvloop.run(_serve(serving))


def start_worker_loop_forever(*, private_key: bytes | None = None, ca: str, address: str) -> None:
    """Monarch's variant that returns a future of the server's lifetime: not offered (it needs Monarch's Rust runtime)."""
    check_worker_loop_args(private_key, ca)
    raise NotImplementedError(
        "start_worker_loop_forever() starts Monarch's worker server beside the calling program; in actors a "
        "worker loop is a process of its own: call run_worker_loop_forever(address=...) in it"
    )
