"""The trainer's side of weight sync: publish versioned updates, release them."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from .._shared._errors import LifecycleError, VersionError, WeightSyncError
from .._shared._loops import loop_running
from .._shared._session import host_id
from ..tensors import TensorSpec, distinct, gather_each, layout, origins
from ._manifest import WeightManifest, make_writer
from ._off_the_loop import OFFLOAD_BYTES, on_a_gpu, on_the_host, to_thread_after_queued_work
from ._spec_table import SpecTable

__all__ = ["WeightPublisher", "join_publish"]

#: The largest version a slot's header holds (a signed 64-bit field).
MAX_VERSION = 2**63 - 1


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


def join_publish(model: torch.nn.Module | dict[str, Any]) -> int:
    """On a rank that does not publish, join a sharded ``model``'s publish by a rank that does; the tensors gathered.

    A sharded tensor (FSDP2's ``DTensor``) is gathered whole as a publisher
    copies it, so publishing a sharded model is a collective: every other rank
    of its group runs this at the same time, for the same model. It gathers
    the same tensors in the same order, and drops each at once.
    """
    tensors = _named_tensors(model)
    specs, _ = layout(tensors)
    return gather_each(tensors[index][1] for index in distinct(specs))


class WeightPublisher:
    """Trainer side: publishes versioned updates and releases them.

    At most ``keep`` updates stay unreleased: publishing beyond that releases
    the oldest. Options of ``shm`` and ``cuda-ipc``: ``slots`` (pool size,
    default 2; also the default ``keep``) and ``lock_timeout`` (how long a
    publish waits for a consumer to free a slot, default 30 s); ``cuda-ipc``
    also takes ``device`` (default: the current GPU); ``tcp`` takes ``host``
    (the address its weight server binds; default this host's actors tcp
    address) and ``chunk`` (bytes per checksummed chunk). A slot whose update is
    superseded is reused once no consumer holds it.

    A model sharded with FSDP2 is published whole: each sharded tensor is
    gathered as it is copied, one at a time, while the group's other ranks
    run :func:`join_publish`.

    ``dtype`` publishes floating-point tensors in that dtype (``torch.bfloat16``
    halves an update of float32 weights): the copy into the slot casts, so no
    second copy is made.

    Inside an event loop use :meth:`publish_async`: waiting for a slot and a
    large host copy then leave the loop running. :meth:`publish` never waits
    for a slot on a running loop's thread: it raises instead.
    """

    def __init__(
        self,
        transport: str = "shm",
        *,
        checksums: bool = False,
        keep: int | None = None,
        dtype: torch.dtype | None = None,
        **options: Any,
    ) -> None:
        self.transport = transport
        self.checksums = checksums
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, not {dtype!r}")
        #: Floating-point tensors are published in this dtype (cast by the copy into the slot); None: their own.
        self.dtype = dtype
        self.keep = keep if keep is not None else int(options.get("slots", 2))
        if self.keep < 1:
            raise ValueError("keep must be at least 1")
        self._writer = make_writer(transport, options)
        self.timeout = float(getattr(self._writer, "lock_timeout", 0.0))
        self._version: int | None = None
        self._published: dict[str, int] = {}  # update_id -> version, until released
        self._publishing = False
        self._lock = threading.Lock()  # closed and _filling, between close() and a publish on another thread
        self._filling = False  # a publish is copying into a slot or committing it (a close() waits for it)
        self._host = host_id()
        self.closed = False
        # Storage is freed when the publisher is collected or the interpreter exits (Ctrl-C too).
        self._finalizer = weakref.finalize(self, self._writer.close)

    @property
    def version(self) -> int | None:
        """The last version published."""
        return self._version

    def _prepare(
        self, model: torch.nn.Module | dict[str, Any], version: int
    ) -> tuple[list[tuple[str, torch.Tensor]], list[TensorSpec], int]:
        if self.closed:
            raise WeightSyncError("this publisher is closed")
        if type(version) is not int:
            raise TypeError(f"version must be an int, not {type(version).__name__}")
        if not 0 <= version <= MAX_VERSION:
            raise ValueError(f"version must be an int from 0 to 2**63 - 1, not {version}")
        if self._version is not None and version <= self._version:
            raise VersionError(f"version {version} does not increase on the last published version {self._version}")
        tensors = _named_tensors(model)
        specs, total = layout(tensors, self.dtype)
        return tensors, specs, total

    def publish(
        self,
        model: torch.nn.Module | dict[str, Any],
        version: int,
        metadata: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> WeightManifest:
        """Copy ``model``'s tensors into the transport and describe them in a manifest.

        Outside an event loop, waits up to ``timeout`` s (default
        ``lock_timeout``) for a free slot. On a running loop's thread it never
        waits: with every slot held it raises (use :meth:`publish_async`).
        """
        extra = _checked_metadata(metadata)
        with self._one_publish():
            tensors, specs, total = self._prepare(model, version)
            writer = self._writer
            reservation = writer.reserve(total)
            if reservation is None:
                if loop_running():
                    raise WeightSyncError(
                        "every weight slot is held by a consumer, and publish() will not block a running event "
                        "loop: use `await publisher.publish_async(...)`, which waits for a slot while the loop runs"
                    )
                reservation = writer.reserve_blocking(total, self.timeout if timeout is None else timeout)
            with self._writing(version):
                with self._aborted_on_failure(reservation):
                    specs = self._fill_no_grad(reservation, tensors, specs)
                return self._commit_unless_closed(reservation, version, specs, total, extra)

    @contextlib.contextmanager
    def _aborted_on_failure(self, reservation: Any) -> Iterator[None]:
        """Give the reserved slot back if the copy into it fails (a closed publisher's storage is gone with it)."""
        try:
            yield
        except BaseException:
            if not self.closed:
                self._writer.abort(reservation)
            raise

    def _commit_unless_closed(
        self, reservation: Any, version: int, specs: list[TensorSpec], total: int, extra: dict[str, Any]
    ) -> WeightManifest:
        if self.closed:
            raise WeightSyncError(f"this weight publisher was closed while it published version {version}")
        return self._commit(reservation, version, specs, total, extra)

    @contextlib.contextmanager
    def _one_publish(self) -> Iterator[None]:
        """One publish at a time, whatever thread or loop starts it: a second is refused while the first runs
        (two would check their versions against the same last one and commit in either order)."""
        with self._lock:
            if self._publishing:
                raise WeightSyncError("another publish() of this publisher is still in progress")
            self._publishing = True
        try:
            yield
        finally:
            self._publishing = False

    async def publish_async(
        self,
        model: torch.nn.Module | dict[str, Any],
        version: int,
        metadata: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> WeightManifest:
        """:meth:`publish` for code on an event loop: nothing here blocks the loop.

        Waiting for a free slot is awaited (``WeightSyncError`` after
        ``timeout`` s), and a host copy of 1 MiB or more runs on a worker
        thread. ``cuda-ipc`` only enqueues device copies, so it never waits
        on the GPU either, except from host memory (a pageable copy holds its
        thread: from 1 MiB that runs on a worker thread too) or for checksums
        (read back from the GPU: on a worker thread). The model must not
        change until this returns.
        """
        extra = _checked_metadata(metadata)
        with self._one_publish():
            tensors, specs, total = self._prepare(model, version)
            writer = self._writer
            reservation = writer.reserve(total)
            if reservation is None:
                reservation = await writer.reserve_async(total, self.timeout if timeout is None else timeout)
            with self._writing(version):
                with self._aborted_on_failure(reservation):
                    if self._fills_off_the_loop(writer.host_copy, tensors, total):
                        specs = await to_thread_after_queued_work(
                            tensors, self._fill_no_grad, reservation, tensors, specs
                        )
                    else:
                        specs = self._fill_no_grad(reservation, tensors, specs)
                return self._commit_unless_closed(reservation, version, specs, total, extra)

    def _fills_off_the_loop(self, host_copy: bool, tensors: list[tuple[str, torch.Tensor]], total: int) -> bool:
        """Whether ``publish_async``'s copy would hold the loop: a host copy of 1 MiB or more or out of a GPU; a
        device copy of 1 MiB or more from host memory, or one whose checksums read the GPU's bytes back."""
        if host_copy:
            return total >= OFFLOAD_BYTES or on_a_gpu(tensors)
        return self.checksums or (total >= OFFLOAD_BYTES and on_the_host(tensors))

    @contextlib.contextmanager
    def _writing(self, version: int) -> Iterator[None]:
        """A copy into the reserved slot and its commit under way, unless a close() came first: a close() from
        another thread meanwhile frees the storage once they are done (that publish then raises)."""
        with self._lock:
            if self.closed:
                raise WeightSyncError(f"this weight publisher was closed while it published version {version}")
            self._filling = True
        try:
            yield
        finally:
            with self._lock:
                self._filling = False
                closed = self.closed
            if closed:
                self._finalizer()  # the close deferred while this publish wrote into a slot

    def _fill_no_grad(
        self, reservation: Any, tensors: list[tuple[str, torch.Tensor]], specs: list[TensorSpec]
    ) -> list[TensorSpec]:
        """Copy each distinct tensor once (a tied one's spec points at its twin's bytes and checksum)."""
        origin = origins(specs)
        copied = distinct(specs)
        with torch.no_grad():
            filled = self._writer.fill(
                reservation, [tensors[i] for i in copied], [specs[i] for i in copied], self.checksums
            )
        out = list(specs)
        for index, spec in zip(copied, filled, strict=True):
            out[index] = spec
        return [
            spec if first == index else replace(spec, checksum=out[first].checksum)
            for index, (spec, first) in enumerate(zip(out, origin, strict=True))
        ]

    def _commit(
        self, reservation: Any, version: int, specs: list[TensorSpec], total: int, metadata: dict[str, Any]
    ) -> WeightManifest:
        update_id = f"{os.getpid()}-{version}-{uuid.uuid4().hex[:12]}"
        handle = self._writer.commit(reservation, update_id, version, total)
        with self._lock:  # (a close() from another thread during the commit: nothing is recorded, and it raises)
            if self.closed:
                raise WeightSyncError(f"this weight publisher was closed while it published version {version}")
            self._version = version
            for reclaimed in self._writer.reclaimed():  # storage the transport reused: released here too
                self._published.pop(reclaimed, None)
            self._published[update_id] = version
            while len(self._published) > self.keep:
                self.release(next(iter(self._published)))
        return WeightManifest(
            update_id,
            version,
            self.transport,
            SpecTable.of(specs),
            handle,
            os.getpid(),
            metadata,
            self._host,
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
        """Release every update and free the transport's storage.

        A copy that ``publish_async`` runs on a worker thread still writes
        into its slot: the storage is freed when that copy ends, and that
        publish raises :class:`WeightSyncError`; one waiting for a slot ends
        with it too.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            filling = self._filling
        self._published.clear()
        if not filling:
            self._finalizer()

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_metadata(metadata: object) -> dict[str, Any]:
    """A publish's ``metadata`` as the manifest's dict, refused before anything is copied if it is not one."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(type(key) is str for key in metadata):
        raise TypeError(f"metadata must be a dict with str keys, not {metadata!r:.60}")
    return dict(metadata)
