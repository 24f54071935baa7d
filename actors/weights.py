"""Weight updates from a trainer to rollout actors: versioned manifests, zero-copy storage.

A :class:`WeightPublisher` turns a model (or state_dict) into a
:class:`WeightManifest`: a small frozen record naming one complete update
(id, version, per-tensor specs, transport and handle). The manifest travels
through any port or endpoint; the tensor bytes never do. A
:class:`WeightConsumer` imports the update (views over shared memory where
the transport allows), installs it into a module with at most one copy,
and acknowledges or rejects it. Both sides release it when done.

Lifecycle, per side::

    publisher:  published ──────────────────────────────► released
    consumer:   imported ──► acknowledged | rejected ──► released

:class:`WeightInbox` is the common actor pattern: an ``update_weights``
endpoint that only enqueues the manifest, and a loop that installs the
newest one, releasing every superseded one. :class:`ReceivesWeights` is an
actor base class that provides exactly that endpoint.
"""

from __future__ import annotations

import asyncio
import collections
import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ._actor import Actor, endpoint
from ._errors import (
    CallTimeout,
    ChecksumError,
    LifecycleError,
    StaleUpdateError,
    TransportBlocked,
    VersionError,
    WeightSyncError,
)
from .tensors import TRANSPORTS, Reader, TensorSpec, Writer, checksum, probe

__all__ = [
    "ReceivesWeights",
    "TensorSpec",
    "WeightConsumer",
    "WeightInbox",
    "WeightManifest",
    "WeightPublisher",
    "available_transports",
]


@dataclass(frozen=True)
class WeightManifest:
    """One complete weight update, small enough to send anywhere.

    ``handle`` is what the transport's reader needs (a segment name for
    ``shm``, IPC handles for ``cuda-ipc``, the publishing pid for ``local``).
    """

    update_id: str
    version: int
    transport: str
    tensors: tuple[TensorSpec, ...]
    handle: Any
    publisher_pid: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.tensors]


def available_transports() -> dict[str, str]:
    """Each transport's status on this machine: ``"pass"`` or ``"blocked: <reason>"``."""
    return {name: "pass" if (reason := probe(name)) is None else f"blocked: {reason}" for name in TRANSPORTS}


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    reason = probe(transport)
    if reason is not None:
        raise TransportBlocked(transport, reason)


def _writer(transport: str, options: dict[str, Any]) -> Writer:
    _check_transport(transport)
    if transport == "shm":
        from .tensors.shm import ShmWriter

        return ShmWriter(**options)
    if transport == "cuda-ipc":
        from .tensors.cuda_ipc import CudaIpcWriter

        return CudaIpcWriter(**options)
    from .tensors.local import LocalWriter

    if options:
        raise TypeError(f"the local transport takes no options, got {sorted(options)}")
    return LocalWriter()


def _reader(transport: str) -> Reader:
    _check_transport(transport)
    if transport == "shm":
        from .tensors.shm import ShmReader

        return ShmReader()
    if transport == "cuda-ipc":
        from .tensors.cuda_ipc import CudaIpcReader

        return CudaIpcReader()
    from .tensors.local import LocalReader

    return LocalReader()


def _named_tensors(source: torch.nn.Module | dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    state = source.state_dict() if isinstance(source, torch.nn.Module) else source
    if not isinstance(state, dict):
        raise TypeError(f"publish() takes a module or a state_dict, not {type(source).__name__}")
    tensors = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor")
        tensors.append((str(name), value))
    return tensors


class WeightPublisher:
    """Trainer side: publishes versioned updates and releases them.

    At most ``keep`` updates stay unreleased: publishing beyond that releases
    the oldest. ``shm`` options: ``slots`` (pool size, default 2; also the
    default ``keep``) and ``lock_timeout``; a slot whose update is superseded
    is reused once no consumer holds it.
    """

    def __init__(
        self, transport: str = "shm", *, checksums: bool = False, keep: int | None = None, **options: Any
    ) -> None:
        self.transport = transport
        self.checksums = checksums
        self.keep = keep if keep is not None else int(options.get("slots", 2))
        if self.keep < 1:
            raise ValueError("keep must be at least 1")
        self._writer = _writer(transport, options)
        self._version: int | None = None
        self._published: dict[str, int] = {}  # update_id -> version, until released
        self.closed = False
        # Storage is freed when the publisher is collected or the interpreter exits (Ctrl-C too).
        self._finalizer = weakref.finalize(self, self._writer.close)

    @property
    def version(self) -> int | None:
        """The last version published."""
        return self._version

    def publish(
        self, model: torch.nn.Module | dict[str, Any], version: int, metadata: dict[str, Any] | None = None
    ) -> WeightManifest:
        """Copy ``model``'s tensors into the transport and describe them in a manifest."""
        if self.closed:
            raise WeightSyncError("this publisher is closed")
        if type(version) is not int:
            raise TypeError("version must be an int")
        if self._version is not None and version <= self._version:
            raise VersionError(f"version {version} does not increase on the last published version {self._version}")
        tensors = _named_tensors(model)
        update_id = f"{os.getpid()}-{version}-{uuid.uuid4().hex[:12]}"
        with torch.no_grad():
            handle, specs = self._writer.write(update_id, version, tensors, self.checksums)
        self._version = version
        for reclaimed in self._writer.reclaimed():  # storage the transport reused: released here too
            self._published.pop(reclaimed, None)
        self._published[update_id] = version
        while len(self._published) > self.keep:
            self.release(next(iter(self._published)))
        return WeightManifest(
            update_id, version, self.transport, tuple(specs), handle, os.getpid(), dict(metadata or {})
        )

    def release(self, update_id: str) -> None:
        """The publisher is done with ``update_id``; its storage may be reused."""
        if update_id not in self._published:
            raise LifecycleError(f"update {update_id} is not published by this publisher (or already released)")
        del self._published[update_id]
        self._writer.release(update_id)

    @property
    def unreleased(self) -> list[str]:
        return list(self._published)

    def close(self) -> None:
        """Release every update and free the transport's storage."""
        if not self.closed:
            self.closed = True
            self._published.clear()
            self._finalizer()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_IMPORTED, _ACKNOWLEDGED, _REJECTED, _RELEASED = "imported", "acknowledged", "rejected", "released"


class WeightConsumer:
    """Rollout side: imports, installs, acknowledges or rejects, and releases updates.

    ``verify_checksums`` checks every tensor that carries a checksum at import.
    """

    def __init__(self, *, verify_checksums: bool = True, history: int = 4096) -> None:
        self.verify_checksums = verify_checksums
        self._readers: dict[str, Reader] = {}
        self._state: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._reasons: dict[str, str] = {}
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}
        self._history = history
        self._aliased: str | None = None  # the update a module's parameters currently view
        self.installed_version: int | None = None

    def state(self, update_id: str) -> str | None:
        """``imported``, ``acknowledged``, ``rejected``, ``released`` or None if unknown."""
        return self._state.get(update_id)

    def import_update(self, manifest: WeightManifest) -> dict[str, torch.Tensor]:
        """The update's tensors, valid until :meth:`release` (views, for ``shm``)."""
        update_id = manifest.update_id
        state = self._state.get(update_id)
        if state in (_RELEASED, _REJECTED):
            raise LifecycleError(f"update {update_id} was already {state}; it cannot be imported")
        if state is not None:
            return dict(self._tensors[update_id])
        reader = self._readers.get(manifest.transport)
        if reader is None:
            reader = self._readers[manifest.transport] = _reader(manifest.transport)
        tensors = reader.read(update_id, manifest.version, manifest.handle, manifest.tensors)
        if self.verify_checksums:
            for spec in manifest.tensors:
                if spec.checksum is not None and checksum(tensors[spec.name]) != spec.checksum:
                    reader.release(update_id)
                    raise ChecksumError(f"tensor {spec.name!r} of update {update_id} does not match its checksum")
        self._set(update_id, _IMPORTED)
        self._tensors[update_id] = tensors
        return dict(tensors)

    def install(
        self, manifest: WeightManifest, model: torch.nn.Module, *, strict: bool = True, alias: bool = False
    ) -> None:
        """Import, load into ``model`` and acknowledge; reject on any failure.

        By default the tensors are copied into the module (one copy) and the
        caller releases the update afterwards. With ``alias=True`` nothing is
        copied: the module's parameters become views of the update's storage
        (read-only shared memory for ``shm``), so the module must only be
        read. The update then stays held until the next install replaces it
        (do not release it yourself); publishers need one more slot than
        aliasing consumers.
        """
        previous = self._aliased
        try:
            tensors = self.import_update(manifest)
            with torch.no_grad():
                model.load_state_dict(tensors, strict=strict, assign=alias)
        except BaseException as exc:
            if self._state.get(manifest.update_id) not in (_RELEASED, _REJECTED):
                self.reject(manifest.update_id, f"{type(exc).__name__}: {exc}")
            raise
        self.acknowledge(manifest.update_id)
        self.installed_version = manifest.version
        self._aliased = manifest.update_id if alias else None
        if previous is not None and previous != manifest.update_id:
            self.release(previous)

    def holds_alias(self, update_id: str) -> bool:
        """True while a module's parameters are views of ``update_id``'s storage."""
        return self._aliased == update_id

    def acknowledge(self, update_id: str) -> None:
        """The update is fully installed."""
        state = self._state.get(update_id)
        if state != _IMPORTED:
            raise LifecycleError(
                f"cannot acknowledge update {update_id} before it is imported (it is {state or 'unknown'})"
            )
        self._set(update_id, _ACKNOWLEDGED)

    def reject(self, update_id: str, reason: str) -> None:
        """The update will not be used (failed install, stale, superseded)."""
        state = self._state.get(update_id)
        if state in (_ACKNOWLEDGED, _RELEASED):
            raise LifecycleError(f"cannot reject update {update_id}: it is {state}")
        self._reasons[update_id] = reason
        self._set(update_id, _REJECTED)

    def rejection_reason(self, update_id: str) -> str | None:
        return self._reasons.get(update_id)

    def release(self, update_id: str, transport: str | None = None) -> None:
        """Drop the update's storage; its tensors must not be used afterwards."""
        if self._state.get(update_id) == _RELEASED:
            return
        if self._aliased == update_id:
            self._aliased = None
        self._tensors.pop(update_id, None)
        for name, reader in self._readers.items():
            if transport is None or name == transport:
                reader.release(update_id)
        self._set(update_id, _RELEASED)

    def _set(self, update_id: str, state: str) -> None:
        self._state[update_id] = state
        self._state.move_to_end(update_id)
        while len(self._state) > self._history:
            old, old_state = self._state.popitem(last=False)
            if old_state != _RELEASED:  # never forget something still held
                self._state[old] = old_state
                break
            self._reasons.pop(old, None)

    def close(self) -> None:
        for update_id, state in list(self._state.items()):
            if state != _RELEASED:
                self.release(update_id)
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


class WeightInbox:
    """Manifests waiting to be installed; newest wins, the rest are released.

    ``put`` is all an ``update_weights`` endpoint does; the actor's own loop
    calls :meth:`install_newest` between steps.
    """

    def __init__(self, consumer: WeightConsumer | None = None) -> None:
        self.consumer = consumer or WeightConsumer()
        self._queue: collections.deque[WeightManifest] = collections.deque()
        self.superseded = 0
        self._arrived: asyncio.Event | None = None

    def put(self, manifest: WeightManifest) -> None:
        if not isinstance(manifest, WeightManifest):
            raise TypeError(f"expected a WeightManifest, got {type(manifest).__name__}")
        self._queue.append(manifest)
        if self._arrived is not None:
            self._arrived.set()

    async def wait(self, timeout: float) -> None:
        """Wait until an update is waiting (at once if one is); CallTimeout after ``timeout`` s."""
        if self._queue:
            return
        if self._arrived is None:
            self._arrived = asyncio.Event()
        self._arrived.clear()
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
        except asyncio.TimeoutError:
            raise CallTimeout(f"no weight update arrived within {timeout:g}s") from None

    def __len__(self) -> int:
        return len(self._queue)

    def take_newest(self) -> WeightManifest | None:
        """The newest waiting manifest; every older one is rejected and released."""
        if not self._queue:
            return None
        unique = {m.update_id: m for m in self._queue}  # the same update delivered twice is one update
        self._queue.clear()
        newest = max(unique.values(), key=lambda m: m.version)
        for manifest in unique.values():
            if manifest is not newest:
                self._drop(manifest, f"superseded by version {newest.version}")
        installed = self.consumer.installed_version
        if installed is not None and newest.version <= installed:
            self._drop(newest, f"not newer than installed version {installed}")
            return None
        return newest

    def _drop(self, manifest: WeightManifest, reason: str) -> None:
        self.superseded += 1
        if self.consumer.state(manifest.update_id) is None:
            self.consumer.reject(manifest.update_id, reason)
        self.consumer.release(manifest.update_id, manifest.transport)

    def install_newest(self, model: torch.nn.Module, *, alias: bool = False) -> WeightManifest | None:
        """Install the newest waiting update into ``model``; None if there was none usable.

        A stale update (its storage already reused for a newer version) is
        rejected and skipped; any other failure is raised after release.
        With ``alias=True`` see :meth:`WeightConsumer.install`.
        """
        manifest = self.take_newest()
        if manifest is None:
            return None
        try:
            self.consumer.install(manifest, model, alias=alias)
        except StaleUpdateError:
            return None
        finally:
            if not self.consumer.holds_alias(manifest.update_id):
                self.consumer.release(manifest.update_id, manifest.transport)
        return manifest

    def close(self) -> None:
        for manifest in self._queue:
            self._drop(manifest, "inbox closed")
        self._queue.clear()
        self.consumer.close()


class ReceivesWeights(Actor):
    """An actor base with a queue-backed ``update_weights`` endpoint.

    Subclasses call ``self.weight_inbox.install_newest(model)`` from their
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
        self.weight_inbox.close()
