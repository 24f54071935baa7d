"""The actor pattern: a queue-backed ``update_weights`` endpoint and a loop that installs the newest."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

import torch

from .._hosting._actor import Actor, endpoint
from .._shared._errors import CallTimeout, PublisherDied, StaleUpdateError, WeightSyncError
from ._consumer import WeightConsumer
from ._manifest import WeightManifest

__all__ = ["ReceivesWeights", "WeightInbox"]


class WeightInbox:
    """Manifests waiting to be installed; newest wins (the newest still whole, where a newer one is stale), the rest
    are released.

    ``put`` is all an ``update_weights`` endpoint does; the actor's own loop
    calls :meth:`install_newest` between steps.
    """

    def __init__(self, consumer: WeightConsumer | None = None) -> None:
        self.consumer = consumer or WeightConsumer()
        self._queue: collections.deque[WeightManifest] = collections.deque()
        self.superseded = 0
        self._arrived: asyncio.Event | None = None
        #: Pid of the publisher of the newest update seen (the one whose death :meth:`wait` watches).
        self.publisher: int | None = None
        #: Whether that publisher is on this host (a pid elsewhere cannot be watched).
        self.publisher_here = True
        self._closed = False

    def put(self, manifest: WeightManifest) -> None:
        """Queue ``manifest``; one that is not a sound manifest is refused here, before it can reach the queue."""
        if not isinstance(manifest, WeightManifest):
            raise TypeError(f"expected a WeightManifest, got {type(manifest).__name__}")
        self._queue.append(manifest.checked())
        self.publisher = manifest.publisher_pid
        self.publisher_here = self.consumer.on_this_host(manifest)
        if self._arrived is not None:
            self._arrived.set()

    async def wait(self, timeout: float) -> None:
        """Wait until an update is waiting (at once if one is).

        Raises :class:`CallTimeout` after ``timeout`` s, and
        :class:`PublisherDied` as soon as the publisher of the updates seen
        so far exits (when it is on this host: one elsewhere is noticed when
        its next update cannot be fetched): no update can come from it any
        more, and the installed weights stay as they are. A :meth:`close`
        meanwhile ends it with :class:`WeightSyncError`.
        """
        if self._queue:
            return
        self._check_open()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        self._arrived.clear()
        publisher = self.publisher if self.publisher is not None else self.consumer.installed_from
        if not self.publisher_here:
            publisher = None
        arrived: asyncio.Future[object] = asyncio.ensure_future(self._arrived.wait())
        waiters: list[asyncio.Future[object]] = [arrived]
        if publisher is not None:
            waiters.append(asyncio.ensure_future(self.consumer.publishers.death(publisher)))
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()  # (a finished one ignores it)
            # Let them unwind. A cancel of this task that comes meanwhile (an actor's stop) propagates:
            # suppressing around an await would swallow it with theirs.
            await asyncio.wait(waiters)
        if self._queue:
            return
        self._check_open()
        died = [waiter for waiter in done if waiter is not arrived and not waiter.cancelled()]
        if not died:
            raise CallTimeout(f"no weight update arrived within {timeout:g}s")
        died[0].result()  # (what the watch raised, if it failed rather than saw a death)
        assert publisher is not None
        raise PublisherDied(
            f"the weight publisher (pid {publisher}) exited; the installed weights "
            f"(version {self.consumer.installed_version}) stay",
            pid=publisher,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise WeightSyncError("the weight inbox was closed: no update can be waited for")

    def __len__(self) -> int:
        return len(self._queue)

    def take_newest(self) -> WeightManifest | None:
        """The newest waiting manifest; every older one is rejected and released, and a repeat of an update this
        consumer already turned down or let go (a stale one delivered again) is dropped, not installed."""
        candidates, dropped = self._take_candidates()
        for manifest, reason in [*dropped, *_older(candidates, 0)]:
            self._drop(manifest, reason)
        return candidates[0] if candidates else None

    def _take_candidates(self) -> tuple[list[WeightManifest], list[tuple[WeightManifest, str]]]:
        """Every waiting update worth installing, newest first, taken off the queue, and those to drop, with why
        (not newer than the installed version); a repeat of one this consumer already turned down or let go is
        neither (it is counted, and nothing more)."""
        unique = {m.update_id: m for m in self._queue}  # the same update delivered twice is one update
        self._queue.clear()
        installed = self.consumer.installed_version
        candidates, dropped = [], []
        for manifest in sorted(unique.values(), key=lambda m: m.version, reverse=True):
            if installed is not None and manifest.version <= installed:
                dropped.append((manifest, f"not newer than installed version {installed}"))
            elif self.consumer.state(manifest.update_id) in ("rejected", "released"):  # (done with once: let go)
                self.superseded += 1
            else:
                candidates.append(manifest)
        return candidates, dropped

    def _drop(self, manifest: WeightManifest, reason: str) -> None:
        """Reject and release an update not to be installed, unless it is the one a module views (a repeat of it):
        that one stays held until the next install replaces it."""
        if self._reject(manifest, reason):
            self.consumer.release(manifest.update_id, manifest.transport)

    async def _drop_async(self, manifest: WeightManifest, reason: str) -> None:
        """:meth:`_drop` on an event loop: a ``cuda-ipc`` release's wait for the GPU's reads is awaited."""
        if self._reject(manifest, reason):
            await self.consumer.release_async(manifest.update_id, manifest.transport)

    def _reject(self, manifest: WeightManifest, reason: str) -> bool:
        """Count an update not to be installed, and reject it unless it was installed or decided already; whether
        it is to be released (not when a module views it)."""
        self.superseded += 1
        if self.consumer.state(manifest.update_id) is None:
            self.consumer.reject(manifest.update_id, reason)
        return not self.consumer.holds_alias(manifest.update_id)

    def install_newest(self, model: torch.nn.Module, *, alias: bool = False) -> WeightManifest | None:
        """Install the newest waiting update into ``model``; None if there was none usable.

        A stale update (its storage already reused for a newer version) is
        rejected and skipped; any other failure (a dead publisher, a manifest
        that does not fit) is raised after release, with the model unchanged.
        With ``alias=True`` see :meth:`WeightConsumer.install`. A ``tcp``
        update blocks while it is fetched: on an event loop use
        :meth:`install_newest_async`.
        """
        for waiting in self._queue:  # (on an event loop a tcp update is refused while it is still queued)
            self.consumer.check_blocking_allowed(waiting)
        candidates, dropped = self._take_candidates()
        for manifest, reason in dropped:
            self._drop(manifest, reason)
        for index, manifest in enumerate(candidates):  # newest first; an older one where a newer is stale
            stale = False
            try:
                self.consumer.install(manifest, model, alias=alias)
            except StaleUpdateError:
                stale = True
            finally:
                self._done_with(manifest)
                if not stale:  # (installed, or failed otherwise: the older ones go)
                    for older, reason in _older(candidates, index):
                        self._drop(older, reason)
            if not stale:
                return manifest
        return None

    async def install_newest_async(
        self, model: torch.nn.Module, *, alias: bool = False, timeout: float | None = None
    ) -> WeightManifest | None:
        """:meth:`install_newest` for an event loop: a ``tcp`` fetch is awaited (at most ``timeout`` s)."""
        return await self._install_first_fresh(
            lambda manifest: self.consumer.install_async(manifest, model, alias=alias, timeout=timeout)
        )

    async def load_newest_async(
        self, loader: Callable[[dict[str, torch.Tensor]], None], *, timeout: float | None = None
    ) -> WeightManifest | None:
        """:meth:`install_newest_async` for a destination that is not a module: ``loader`` takes the tensors.

        See :meth:`WeightConsumer.load_async`; the update is released after
        the loader returns (the loader must copy what it keeps).
        """
        return await self._install_first_fresh(
            lambda manifest: self.consumer.load_async(manifest, loader, timeout=timeout)
        )

    async def _install_first_fresh(self, install: Callable[[WeightManifest], Awaitable[None]]) -> WeightManifest | None:
        """Install the newest waiting update, or, where it is stale (its slot reused while another consumer held
        an older one's), the newest older one that is not: an update goes only where a newer one installed."""
        candidates, dropped = self._take_candidates()
        for manifest, reason in dropped:
            await self._drop_async(manifest, reason)
        for index, manifest in enumerate(candidates):
            stale = False
            try:
                await install(manifest)
            except StaleUpdateError:
                stale = True
            finally:
                await self._done_with_async(manifest)
                if not stale:  # (installed, or failed otherwise: the older ones go)
                    for older, reason in _older(candidates, index):
                        await self._drop_async(older, reason)
            if not stale:
                return manifest
        return None

    def _done_with(self, manifest: WeightManifest) -> None:
        """Release the update after an install, unless a module views it or only its manifest was refused."""
        if self._to_release(manifest):
            self.consumer.release(manifest.update_id, manifest.transport)

    async def _done_with_async(self, manifest: WeightManifest) -> None:
        """:meth:`_done_with` on an event loop: a wait for the GPU's reads of the update is awaited."""
        if self._to_release(manifest):
            await self.consumer.release_async(manifest.update_id, manifest.transport)

    def _to_release(self, manifest: WeightManifest) -> bool:
        update_id = manifest.update_id
        return self.consumer.state(update_id) is not None and not self.consumer.holds_alias(update_id)

    def close(self) -> None:
        """Release what is queued and held, and close the consumer (on an event loop: :meth:`close_async`)."""
        self._closing()
        for manifest in self._queue:
            self._drop(manifest, "inbox closed")
        self._queue.clear()
        self.consumer.close()

    def _closing(self) -> None:
        """Mark the inbox closed and wake a :meth:`wait` under way (it raises)."""
        self._closed = True
        if self._arrived is not None:
            self._arrived.set()

    async def close_async(self) -> None:
        """:meth:`close` for an event loop: the wait for the GPU's reads of a held ``cuda-ipc`` slot is awaited."""
        self._closing()
        for manifest in self._queue:  # rejected here, released (awaited) with everything else the consumer holds
            self._reject(manifest, "inbox closed")
        self._queue.clear()
        await self.consumer.close_async()


def _older(candidates: list[WeightManifest], chosen: int) -> list[tuple[WeightManifest, str]]:
    """The candidates older than ``candidates[chosen]`` (installed, or failed other than stale), to drop, with why."""
    return [(manifest, f"superseded by version {candidates[chosen].version}") for manifest in candidates[chosen + 1 :]]


class ReceivesWeights(Actor):
    """An actor base with a queue-backed ``update_weights`` endpoint.

    Subclasses call ``await self.weight_inbox.install_newest_async(model)``
    (or ``install_newest`` where no update comes over ``tcp``) from their
    own loop; ``update_weights`` only enqueues and returns, so it is safe to
    invoke fire-and-forget (``send(..., selection="choose")``).
    """

    @property
    def weight_inbox(self) -> WeightInbox:
        inbox: WeightInbox | None = self.__dict__.get("_weight_inbox")
        if inbox is None:
            inbox = self.__dict__["_weight_inbox"] = WeightInbox()
        return inbox

    @endpoint
    async def update_weights(self, manifest: WeightManifest) -> None:
        self.weight_inbox.put(manifest)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await self.weight_inbox.close_async()
