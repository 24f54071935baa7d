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


def ask_agent(rt: Runtime, agent: ActorMesh[Any], op: str, args: tuple[Any, ...]) -> PendingCall:
    """Send request ``op`` to a host agent, from any thread; its pending call."""
    targets = agent._targets()

    def send() -> PendingCall | None:
        return send_call(rt, targets, agent._name, op, encode_arguments(rt, args, {}), want_reply=True)

    pending = rt.driver.on_thread(send)
    assert pending is not None
    return pending  # type: ignore[no-any-return]


class Attaching:
    """The questions attaching asks each worker's agent, and the host mesh's nodes once all are answered.

    ``install`` gets the nodes on the runtime's thread before anyone waiting
    sees them ready; :attr:`ready` then holds None, or why attaching failed.
    """

    __slots__ = (
        "_agents",
        "_infos",
        "_install",
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
        rt.driver.on_thread(self._begin)

    def _begin(self) -> None:
        loop = self._rt.driver.loop
        if loop is not None and loop.is_running():  # (a loop that ends first leaves the deadline to the waiters)
            loop.call_later(self.timeout, self.expire)
        for index in range(len(self._agents)):
            self._ask(index, "start", ())

    def _ask(self, index: int, op: str, args: tuple[Any, ...]) -> None:
        if self.ready.done():
            return
        pending = ask_agent(self._rt, self._agents[index], op, args)
        self._open[index] = pending
        if pending.done:
            self._answered(index, op, pending)
        else:
            pending.callbacks.append(lambda call: self._answered(index, op, call))

    def _answered(self, index: int, op: str, call: PendingCall) -> None:
        self._open.pop(index, None)
        if op == "start" and call.error is None:
            self.started.add(index)  # (even after a failure: its forkserver runs until it is stopped)
        if self.ready.done():
            return
        if call.error is not None:
            failed = RuntimeError(f"attach failed: {op} on the worker loop at {self.addresses[index]}: {call.error}")
            failed.__cause__ = call.error
            self._fail(failed)
        elif op == "start":
            self._infos[index] = call.results[0]
            self._ask(index, "addresses", (ADDRESS_POOL,))
        else:
            self._pools[index] = call.results[0]
            if len(self._pools) == len(self._agents):
                self._finish()

    def _finish(self) -> None:
        nodes = []
        for index, (handle, address) in enumerate(zip(self._agents, self.addresses, strict=True)):
            info = self._infos[index]
            label = f"worker {address}"
            nodes.append(RemoteNode(index, handle, info["ip"], info["pid"], address, label, list(info["gpus"])))
            nodes[-1].addresses = self._pools[index]
        self._install(nodes)
        self.ready.set_result(None)

    def _fail(self, error: BaseException) -> None:
        """Fail :attr:`ready` (once) and give up the questions still open (on the runtime's thread)."""
        if self.ready.done():
            return
        self.ready.set_exception(error)
        for pending in list(self._open.values()):  # (a late answer is dropped)
            pending.fail(CallTimeout(f"{pending.actor}.{pending.method}(): attaching gave up ({error})"))

    def expire(self) -> None:
        """The deadline passed (runtime's thread): fail with the first worker that did not answer."""
        if self.ready.done():
            return
        index = min(i for i in range(len(self._agents)) if i not in self._pools)
        self._fail(
            CallTimeout(
                f"attach failed: config push failed during attach: the worker loop at {self.addresses[index]} did "
                f"not answer within {self.timeout:g}s: is it running, reachable from here, and does it hold this "
                f"session's CURVE key ({CURVE_PUBLIC_ENV})?"
            )
        )

    def cancel(self, why: str) -> None:
        """Stop attaching (its host mesh was shut down): readiness fails saying ``why`` (any thread)."""
        self._rt.driver.on_thread(lambda: self._fail(RuntimeError(f"attach failed: {why}")))

    def wait(self, timeout: float | None) -> None:
        """Block this thread (never an event loop's) until attached; raises why not, or CallTimeout at ``timeout``."""
        runtime()  # (a runtime whose program's loop ended is served in the background meanwhile)
        left = self.deadline - time.monotonic() + DEADLINE_GRACE
        limit = left if timeout is None else min(timeout, left)
        try:
            self.ready.result(max(0.0, limit))
        except concurrent.futures.TimeoutError:
            if timeout is not None and timeout < left:
                raise CallTimeout(f"gave up after {timeout:.1f}s waiting for the workers to attach") from None
            self._rt.driver.on_thread(self.expire)
            self.ready.result(0)

    async def wait_async(self) -> None:
        """Wait on the running loop until attached; raises why not."""
        runtime()
        if not self.ready.done():
            waiting = asyncio.wrap_future(self.ready)
            left = self.deadline - time.monotonic() + DEADLINE_GRACE
            await asyncio.wait([waiting], timeout=max(0.0, left))  # (never cancels what it waits for)
            if not self.ready.done():
                self._rt.driver.on_thread(self.expire)
        self.ready.result(0)
