"""Attaching worker loops in the background: each host agent's ``start``, then its free addresses, by a deadline.

``attach_to_workers`` returns at once, as Monarch's does. The answers it
needs arrive on the runtime's thread, each asking the next question; the
host mesh's ``initialized`` (and anything that needs its hosts) waits for
the last one. A worker that does not answer by the deadline fails them all,
every time they are asked, with Monarch's ``attach failed`` text naming
its address.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from .._runtime._call_sender import encode_arguments, send_call
from .._runtime._core import Runtime, runtime
from .._runtime._pending_calls import PendingCall
from .._shared._errors import CallTimeout
from .._shared._session import CURVE_PUBLIC_ENV
from ._actor_mesh import ActorMesh
from ._remote_host_mesh import ADDRESS_POOL, RemoteNode

__all__ = ["Attaching", "ask_agent"]

#: How long past the deadline a waiter gives the runtime's thread to declare it before doing so itself (s).
DEADLINE_GRACE = 1.0


def ask_agent(
    rt: Runtime,
    agent: ActorMesh[Any],
    op: str,
    args: tuple[Any, ...],
    then: Callable[[PendingCall], None] | None = None,
    *,
    despite_loss: bool = False,
) -> PendingCall:
    """Send request ``op`` to a host agent, from any thread; its pending call.

    ``then`` gets the call once it is done, on the runtime's thread; it is
    attached there as the call is sent, so no answer can come before it.
    ``despite_loss`` sends it to an agent whose mesh counts it lost (a
    request to it failed) all the same: its worker loop may still serve.
    """
    targets = agent._targets_list if despite_loss else agent._targets()

    def send() -> PendingCall | None:
        pending = send_call(rt, targets, agent._name, op, encode_arguments(rt, args, {}), want_reply=True)
        assert pending is not None
        if then is not None:
            if pending.done:
                then(pending)
            else:
                pending.callbacks.append(then)
        return pending

    return rt.driver.on_thread(send)  # type: ignore[no-any-return]


class Attaching:
    """The questions attaching asks each worker's agent, and the host mesh's nodes once all are answered.

    ``install`` gets the nodes on the runtime's thread before anyone waiting
    sees them ready; :attr:`ready` then holds None, or why attaching failed.
    A failure leaves the questions open: an agent that starts late is still
    counted in :attr:`started`, so that shutting the mesh down stops it.
    """

    __slots__ = (
        "_agents",
        "_infos",
        "_install",
        "_lost",
        "_open",
        "_pools",
        "_rt",
        "addresses",
        "deadline",
        "ready",
        "started",
        "timeout",
    )

    def __init__(
        self,
        rt: Runtime,
        addresses: list[str],
        agents: list[ActorMesh[Any]],
        timeout: float,
        install: Callable[[list[RemoteNode]], None],
    ) -> None:
        self._rt = rt
        self.addresses = addresses
        self._agents = agents
        self.timeout = timeout
        self._install = install
        self.deadline = time.monotonic() + timeout
        #: Done when every worker answered (None) or attaching failed (its error), for every thread.
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: The workers whose agent started its forkserver (those a shutdown must ask to stop).
        self.started: set[int] = set()
        self._infos: dict[int, dict[str, Any]] = {}
        self._pools: dict[int, list[str]] = {}
        self._open: dict[int, PendingCall] = {}
        self._lost: set[int] = set()  # (workers whose lifeline ended: never asked to stop)
        # The deadline on a thread of its own: the loop serving the runtime may change before it comes.
        timer = threading.Timer(timeout, self._expire_from_timer)
        timer.daemon = True
        self.ready.add_done_callback(lambda _ready: timer.cancel())
        rt.driver.on_thread(self._begin)
        timer.start()

    def _begin(self) -> None:
        for index in range(len(self._agents)):
            self._ask(index, "start", ())

    def _ask(self, index: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            self._open[index] = ask_agent(
                self._rt, self._agents[index], op, args, lambda call: self._answered(index, op, call)
            )
        except Exception as exc:  # (the agent's mesh is stopping, its link is full)
            self._fail(self._failure(index, op, exc))

    def _failure(self, index: int, op: str, error: BaseException) -> RuntimeError:
        failed = RuntimeError(f"attach failed: {op} on the worker loop at {self.addresses[index]}: {error}")
        failed.__cause__ = error
        return failed

    def _answered(self, index: int, op: str, call: PendingCall) -> None:
        self._open.pop(index, None)
        if op == "start" and call.error is None and index not in self._lost:
            self.started.add(index)  # (even after a failure: its forkserver runs until it is stopped)
        if self.ready.done():
            return
        if call.error is not None:
            self._fail(self._failure(index, op, call.error))
        elif op == "start":
            self._infos[index] = call.results[0]
            self._ask(index, "addresses", (ADDRESS_POOL,))
        else:
            self._pools[index] = call.results[0]
            if len(self._pools) == len(self._agents):
                self._finish()

    def _finish(self) -> None:
        nodes = []
        try:
            for index, (handle, address) in enumerate(zip(self._agents, self.addresses, strict=True)):
                info, label = self._infos[index], f"worker {address}"
                gpus = list(info["gpus"])
                nodes.append(
                    RemoteNode(index, handle, info["ip"], info["pid"], address, label, gpus, self._pools[index])
                )
            self._install(nodes)
        except Exception as exc:  # (a malformed answer; the mesh stopping as it was installed)
            self._fail(RuntimeError(f"attach failed: {type(exc).__name__}: {exc}"))
            return
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # (cancelled from another thread)
            self.ready.set_result(None)

    def _fail(self, error: BaseException) -> None:
        """Fail :attr:`ready`, once (the questions still open stay open: see the class)."""
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.ready.set_exception(error)

    def _expire_from_timer(self) -> None:
        with contextlib.suppress(Exception):  # (a runtime already closed: nobody waits)
            self._rt.driver.on_thread(self.expire)

    def expire(self) -> None:
        """The deadline passed (runtime's thread): fail with the first worker that did not answer."""
        if self.ready.done():
            return
        index = min((i for i in range(len(self._agents)) if i not in self._pools), default=0)
        self._fail(
            CallTimeout(
                f"attach failed: config push failed during attach: the worker loop at {self.addresses[index]} did "
                f"not answer within {self.timeout:g}s: is it running, reachable from here, and does it hold this "
                f"session's CURVE key ({CURVE_PUBLIC_ENV})?"
            )
        )

    def lost(self, index: int, why: str) -> None:
        """The lifeline of worker ``index`` ended before attaching finished (runtime's thread): it failed, and
        that worker is not asked to stop (nothing would answer)."""
        self._lost.add(index)
        self.started.discard(index)
        self._fail(RuntimeError(f"attach failed: lost the worker loop at {self.addresses[index]}: {why}"))

    def unanswered(self) -> list[int]:
        """The workers whose agent has not answered ``start`` and whose lifeline did not end: the request may
        still be on its way, and a stop sent now comes after it (runtime's thread)."""
        return [i for i in range(len(self._agents)) if i not in self.started and i not in self._lost]

    def cancel(self, why: str) -> None:
        """Stop attaching (its host mesh was shut down; any thread): readiness fails saying ``why``, and the
        questions still open are given up (a late answer is dropped)."""

        def give_up() -> None:
            self._fail(RuntimeError(f"attach failed: {why}"))
            for pending in list(self._open.values()):
                pending.fail(CallTimeout(f"{pending.actor}.{pending.method}(): attaching was given up ({why})"))

        self._rt.driver.on_thread(give_up)

    def _outcome(self) -> None:
        error = self.ready.exception(0)
        if error is not None:
            raise error.with_traceback(None)  # (raised afresh to each observer, its traceback not piling up)

    def wait(self, timeout: float | None) -> None:
        """Block this thread (never an event loop's) until attached; raises why not, or CallTimeout at ``timeout``."""
        runtime()  # (a runtime whose program's loop ended is served in the background meanwhile)
        left = self.deadline - time.monotonic() + DEADLINE_GRACE
        limit = left if timeout is None else min(timeout, left)
        try:
            self.ready.exception(max(0.0, limit))  # (waits; the outcome is raised afresh below)
        except concurrent.futures.TimeoutError:
            if timeout is not None and timeout < left:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for the workers to attach") from None
            self._rt.driver.on_thread(self.expire)
        self._outcome()

    async def wait_async(self) -> None:
        """Wait on the running loop until attached; raises why not."""
        runtime()
        if not self.ready.done():
            waiting = asyncio.wrap_future(self.ready)
            left = self.deadline - time.monotonic() + DEADLINE_GRACE
            await asyncio.wait([waiting], timeout=max(0.0, left))  # (never cancels what it waits for)
            if not self.ready.done():
                self._rt.driver.on_thread(self.expire)
        self._outcome()
