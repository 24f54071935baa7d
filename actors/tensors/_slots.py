"""Slots: reusable storage for weight updates, arbitrated by ``flock`` on a control segment.

Both shared-memory transports keep a bounded pool of *slots*. A slot is a
POSIX shared-memory segment (``/dev/shm/actors-<session>-w<pid>-<kind><n>``)
whose first page is a header (version and update id of the bytes in the
slot); its payload follows the header (``shm``) or lives elsewhere, on a GPU
(``cuda-ipc``). Who may touch a slot is decided by ``flock`` on that segment:

* the writer takes an exclusive lock while it fills a slot, and only on a
  slot no reader holds: a slot is never written while a consumer may read it;
* a reader takes a shared lock from import until release; the kernel drops
  it if the reader dies, so the slot is reclaimed without any heartbeat.

A reader checks the header under its lock: a manifest whose slot now holds
another version is refused (:class:`StaleUpdateError`), never read as a mix.
A slot that is locked exclusively is being rewritten, so its old update is
stale too: readers never wait for a writer.

:class:`SlotPool` is the writer's side, :class:`SlotHolds` the reader's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import math
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._runtime._core import current_runtime
from .._shared._errors import ManifestError, StaleUpdateError, WeightSyncError
from .._shared._segments import SHM_DIR, drop_solo_marker, hold_solo_marker, process_prefix, solo_session
from .._shared._segments import remove_process_segments as remove_segments
from ._slot_views import SlotViews

__all__ = [
    "CLOSED",
    "HEADER_BYTES",
    "LOCK_TIMEOUT",
    "SHM_DIR",
    "PooledWriter",
    "Slot",
    "SlotHolds",
    "SlotPool",
    "poll_async",
    "poll_blocking",
    "remove_segments",
    "segment_prefix",
]

#: Bytes reserved at the start of a segment for the header (one page keeps a payload aligned).
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sqq64sq")  # magic, state, version, update id, payload bytes
_MAGIC = b"ACTWGT01"
_EMPTY, _READY = 0, 2
#: How long a writer waits for a free slot by default.
LOCK_TIMEOUT = 30.0
#: What a closed writer's reservations raise.
CLOSED = "this weight publisher is closed"


def _claim_memory(fd: int, size: int, path: str) -> None:
    """Reserve a segment's first ``size`` bytes now: on tmpfs ``ftruncate`` makes a sparse file, and a write past
    what ``/dev/shm`` has free faults (SIGBUS kills the process) where this raises :class:`WeightSyncError`."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system that cannot reserve: written as before
            return
        raise WeightSyncError(
            f"{os.path.dirname(path)} has no room for a {size}-byte weight slot ({exc.strerror}): free space there, "
            "or give the container more shared memory (docker --shm-size)"
        ) from exc


def segment_prefix(pid: int | None = None) -> str:
    """``actors-<session>-w<pid>-``: every segment process ``pid`` publishes starts with it.

    The session is this process's runtime session when there is one (its
    forkserver removes the session's segments at teardown); a process
    without a runtime uses a session of its own.
    """
    pid = os.getpid() if pid is None else pid
    rt = current_runtime()
    session = rt.session if rt is not None else solo_session(os.getpid())
    return process_prefix(session, pid)


T = TypeVar("T")
#: Backoff of a storage wait: first and longest pause between tries.
_FIRST_PAUSE, _LONGEST_PAUSE = 0.0005, 0.01


def checked_wait(timeout: object, what: str = "timeout") -> float:
    """``timeout`` as seconds to wait, refused unless a finite number of 0 or more (a NaN deadline never passes)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < math.inf:
        raise ValueError(f"{what} is a finite number of seconds, 0 or more, not {timeout!r}")
    return float(timeout)


def poll_blocking(attempt: Callable[[], T | None], timeout: float, exhausted: Callable[[float], Exception]) -> T:
    """``attempt()`` until it returns something, sleeping this thread between tries; ``exhausted(timeout)`` raised."""
    deadline = time.monotonic() + checked_wait(timeout)
    delay = _FIRST_PAUSE
    while (got := attempt()) is None:
        if time.monotonic() >= deadline:
            raise exhausted(timeout)
        time.sleep(delay)
        delay = min(delay * 2, _LONGEST_PAUSE)
    return got


async def poll_async(attempt: Callable[[], T | None], timeout: float, exhausted: Callable[[float], Exception]) -> T:
    """:func:`poll_blocking` for an event loop: the pauses are awaited, so the loop keeps running."""
    deadline = time.monotonic() + checked_wait(timeout)
    delay = _FIRST_PAUSE
    while (got := attempt()) is None:
        if time.monotonic() >= deadline:
            raise exhausted(timeout)
        await asyncio.sleep(delay)
        delay = min(delay * 2, _LONGEST_PAUSE)
    return got


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@dataclass(eq=False)
class Slot:
    """One slot of a writer's pool: its control segment, payload capacity and contents."""

    name: str
    fd: int
    mm: mmap.mmap
    capacity: int  # payload bytes the slot holds
    storage: Any = None  # the transport's payload storage, when it is not inside the segment
    update_id: str | None = None
    version: int = -1
    released: bool = True
    claimed: bool = False  # its payload's memory is reserved (shm)
    views: SlotViews = field(default_factory=SlotViews)  # the payload's tensors by layout (shm)


class SlotPool:
    """The writer's pool: at most ``max_slots`` slots, reused across versions.

    ``payload_in_segment`` puts the payload after the header (``shm``);
    otherwise ``allocate(slot)`` attaches storage of ``slot.capacity`` bytes
    and ``free(slot)`` drops it (``cuda-ipc``).
    """

    def __init__(
        self,
        max_slots: int,
        *,
        kind: str = "",
        payload_in_segment: bool = True,
        allocate: Callable[[Slot], None] | None = None,
        free: Callable[[Slot], None] | None = None,
    ) -> None:
        if type(max_slots) is not int or max_slots < 1:
            raise ValueError(f"a publisher needs at least one slot, not {max_slots!r}")
        self.max_slots = max_slots
        # A token per pool keeps two publishers of one process apart; a count per pool numbers its segments.
        self._prefix = f"{segment_prefix()}{kind}{uuid.uuid4().hex[:8]}-"
        # (a process without a runtime marks its segments live: once it has gone, even killed, a session's sweep
        # removes them)
        solo = solo_session(os.getpid())
        held = hold_solo_marker(solo) if self._prefix.startswith(f"{solo}-") else None
        self._marker = (solo, held) if held is not None else None
        self._numbers = itertools.count()
        self._inline = payload_in_segment
        self._allocate = allocate
        self._free = free
        self._slots: list[Slot] = []
        self._newest: str | None = None
        self._reclaimed: list[str] = []
        self.closed = False
        # try_acquire and close may run on two threads (a publish polling on a worker thread, a close on the
        # loop's): a slot made while the pool closes must not outlive it
        self._lock = threading.RLock()

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self._slots]

    def try_acquire(self, nbytes: int) -> Slot | None:
        """An exclusively locked slot for ``nbytes`` of payload, or None while readers hold them all.

        Preference keeps in-flight manifests importable as long as possible:
        released slots, then a new slot while the pool has room, then
        superseded updates (oldest first), and the newest update last. A new
        ``shm`` slot is made only while ``/dev/shm`` has room for it: a full
        one reuses the slots that hold their room instead. A
        closed pool makes no slot (one would outlive it): it raises
        :class:`WeightSyncError`, which also ends a publish polling for one.
        """
        with self._lock:
            slot = self._try_acquire(nbytes)
            if slot is not None and self.closed:  # closed on this thread while it made the slot (its allocator)
                self._slots.remove(slot)
                self._destroy(slot)
                raise WeightSyncError(CLOSED)
            return slot

    def _try_acquire(self, nbytes: int) -> Slot | None:
        if self.closed:
            raise WeightSyncError(CLOSED)
        released = [s for s in self._slots if s.released]
        superseded = sorted(
            (s for s in self._slots if not s.released and s.update_id != self._newest), key=lambda s: s.version
        )
        newest = [s for s in self._slots if not s.released and s.update_id == self._newest]
        for group in (released, None, superseded, newest):
            if group is None:
                if len(self._slots) < self.max_slots and (not self._slots or self._room_for(nbytes)):
                    return self._create(nbytes)
                continue
            for slot in group:
                if _try_lock(slot.fd, fcntl.LOCK_EX):  # no reader holds it
                    return self._claim(slot, nbytes)
        return None

    def acquire(self, nbytes: int, timeout: float) -> Slot:
        """:meth:`try_acquire`, blocking this thread up to ``timeout`` s (callers outside an event loop)."""
        return poll_blocking(lambda: self.try_acquire(nbytes), timeout, self.exhausted)

    async def acquire_async(self, nbytes: int, timeout: float) -> Slot:
        """:meth:`try_acquire`, awaiting up to ``timeout`` s; the event loop keeps running meanwhile."""
        return await poll_async(lambda: self.try_acquire(nbytes), timeout, self.exhausted)

    def exhausted(self, timeout: float) -> WeightSyncError:
        """The error of a publish that found no free slot within ``timeout``: what held them, and what would help."""
        made = len(self._slots)
        if made < self.max_slots and self._inline:  # the pool could not grow: /dev/shm is full
            return WeightSyncError(
                f"the {made} weight slot(s) /dev/shm had room for (of {self.max_slots}) stayed held by consumers "
                f"for {timeout:g}s, and /dev/shm has no room for another; consumers must release imported "
                "updates, or /dev/shm needs more room (Docker: --shm-size)"
            )
        return WeightSyncError(
            f"all {made} weight slots stayed held by consumers for {timeout:g}s; "
            "consumers must release imported updates, or publish with more slots"
        )

    def payload(self, slot: Slot) -> mmap.mmap:
        """The mapping whose bytes from :data:`HEADER_BYTES` on are the slot's payload (``shm``)."""
        return slot.mm

    def claim_payload(self, slot: Slot) -> None:
        """Reserve the memory of ``slot``'s payload before its first write (``shm``), once per slot.

        Called by the copy, which runs off the event loop from 1 MiB: reserving 256 MiB takes ~0.1 s.
        """
        if self._inline and not slot.claimed:
            _claim_memory(slot.fd, HEADER_BYTES + slot.capacity, os.path.join(SHM_DIR, slot.name))
            slot.claimed = True

    def commit(self, slot: Slot, update_id: str, version: int, nbytes: int) -> None:
        """The payload is in place (or its copy is ordered before any read): readers may take it."""
        _HEADER.pack_into(slot.mm, 0, _MAGIC, _READY, version, update_id.encode(), nbytes)
        fcntl.flock(slot.fd, fcntl.LOCK_UN)
        slot.update_id, slot.version, slot.released = update_id, version, False
        self._newest = update_id

    def abort(self, slot: Slot) -> None:
        """Give back a slot that was acquired but not committed; it holds nothing now.

        One whose payload memory was never reserved (``shm``: its reservation
        failed) is removed: kept, it would be the first slot every later
        publish took, and failed on, again.
        """
        with self._lock:
            if self._inline and not slot.claimed and slot in self._slots:
                self._slots.remove(slot)
                self._destroy(slot)
                return
        with contextlib.suppress(ValueError, OSError):
            _HEADER.pack_into(slot.mm, 0, _MAGIC, _EMPTY, -1, b"", 0)
            fcntl.flock(slot.fd, fcntl.LOCK_UN)
        slot.update_id, slot.version, slot.released = None, -1, True

    def _room_for(self, nbytes: int) -> bool:
        """Whether ``/dev/shm`` has room for a new slot of ``nbytes`` (always, for a payload held elsewhere)."""
        if not self._inline:
            return True
        try:
            free = os.statvfs(SHM_DIR)
        except OSError:
            return True
        if free.f_blocks == 0:  # a tmpfs without a size limit says nothing of its room
            return True
        return free.f_bavail * free.f_frsize >= HEADER_BYTES + nbytes

    def _claim(self, slot: Slot, nbytes: int) -> Slot:
        """Take over a locked slot: its old update is reclaimed; replaced if too small."""
        if slot.update_id is not None and not slot.released:
            self._reclaimed.append(slot.update_id)
        _HEADER.pack_into(slot.mm, 0, _MAGIC, _EMPTY, -1, b"", 0)  # its old bytes are going away
        slot.update_id, slot.version, slot.released = None, -1, True
        if slot.capacity >= nbytes:
            return slot
        self._slots.remove(slot)
        self._destroy(slot)
        return self._create(nbytes)

    def _create(self, nbytes: int) -> Slot:
        name = f"{self._prefix}{next(self._numbers)}"
        path = os.path.join(SHM_DIR, name)
        size = HEADER_BYTES + (nbytes if self._inline else 0)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            _claim_memory(fd, HEADER_BYTES, path)  # the header's page (one page: cheap on the loop's thread)
            mm = mmap.mmap(fd, size)
            fcntl.flock(fd, fcntl.LOCK_EX)
            slot = Slot(name, fd, mm, nbytes)
            if self._allocate is not None:
                self._allocate(slot)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self._slots.append(slot)
        return slot

    def _destroy(self, slot: Slot) -> None:
        """Remove ``slot``, its header emptied first: a reader that kept the segment mapped (and a GPU buffer's
        opened handle) finds its update gone, not a header that still vouches for freed storage."""
        with contextlib.suppress(ValueError, OSError):
            _HEADER.pack_into(slot.mm, 0, _MAGIC, _EMPTY, -1, b"", 0)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, slot.name))
        if self._free is not None:
            self._free(slot)
        with contextlib.suppress(BufferError):
            slot.mm.close()
        os.close(slot.fd)

    def release(self, update_id: str) -> None:
        for slot in self._slots:
            if slot.update_id == update_id:
                slot.released = True

    def reclaimed(self) -> list[str]:
        """Updates whose slot was taken over for a newer one since the last call."""
        out, self._reclaimed = self._reclaimed, []
        return out

    def close(self) -> None:
        """Remove every slot (no name outlives this).

        A slot whose payload lives outside its segment (a GPU buffer) and that
        a reader still holds keeps that payload until the last reader lets go:
        freed now, it would go back to this process's allocator while the
        reader still reads it (an aliasing install would silently view
        whatever comes next there). A thread waits for the slot's lock.
        """
        with self._lock:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self._marker is not None:  # (this pool's hold: another pool of this process keeps its own)
            drop_solo_marker(*self._marker)
            self._marker = None
        for slot in self._slots:
            if self._free is not None and not _try_lock(slot.fd, fcntl.LOCK_EX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, slot.name))
                name = f"actors-weights-held-{slot.name}"
                threading.Thread(target=self._destroy_once_unheld, args=(slot,), name=name, daemon=True).start()
            else:
                self._destroy(slot)
        self._slots.clear()

    def _destroy_once_unheld(self, slot: Slot) -> None:
        fcntl.flock(slot.fd, fcntl.LOCK_EX)  # until the last reader releases (or its process ends)
        self._destroy(slot)


class PooledWriter:
    """A transport writer whose storage is a :class:`SlotPool`: reserving and releasing are the pool's."""

    def __init__(self, pool: SlotPool, lock_timeout: float) -> None:
        try:
            self.lock_timeout = checked_wait(lock_timeout, "lock_timeout")
        except ValueError:
            pool.close()  # (it holds this process's solo marker already, where there is no runtime)
            raise
        self._pool = pool

    @property
    def segment_names(self) -> list[str]:
        return self._pool.names

    def reserve(self, nbytes: int) -> Slot | None:
        return self._pool.try_acquire(nbytes)

    async def reserve_async(self, nbytes: int, timeout: float) -> Slot:
        return await self._pool.acquire_async(nbytes, timeout)

    def reserve_blocking(self, nbytes: int, timeout: float) -> Slot:
        return self._pool.acquire(nbytes, timeout)

    def abort(self, slot: Slot) -> None:
        self._pool.abort(slot)

    def release(self, update_id: str) -> None:
        self._pool.release(update_id)

    def reclaimed(self) -> list[str]:
        return self._pool.reclaimed()

    def close(self) -> None:
        self._pool.close()


class Mapping:
    """The reader's mapping of one control segment, and how many held updates use it."""

    __slots__ = ("fd", "holders", "mm", "name", "views")

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.fd = fd
        self.mm = mm
        self.holders = 0
        self.views = SlotViews()  # the payload's tensors by layout (shm): unmapped with the mapping


def check_segment_name(handle: Any) -> str:
    """``handle`` if it can name one of our segments, else :class:`ManifestError`."""
    if type(handle) is not str or "/" in handle or not handle.startswith("actors-") or len(handle) > 200:
        raise ManifestError(f"not a weight slot name: {handle!r:.80}")
    return handle


class SlotHolds:
    """The reader's side: segments mapped read-only, a shared lock while any update in them is held.

    ``map_payload`` maps the whole segment (``shm``: the payload follows the
    header) rather than its header page alone. ``on_forget(name)`` runs when
    a segment that nobody here holds is found removed by its publisher.
    """

    def __init__(self, *, map_payload: bool = True, on_forget: Callable[[str], None] | None = None) -> None:
        self._map_payload = map_payload
        self._on_forget = on_forget
        self._maps: dict[str, Mapping] = {}

    @property
    def mapped(self) -> list[str]:
        return list(self._maps)

    def hold(self, name: str, update_id: str, version: int) -> tuple[Mapping, int]:
        """Lock segment ``name`` shared for ``update_id``; returns its mapping and payload size.

        Raises :class:`StaleUpdateError` when the segment no longer holds that
        version (reused, being rewritten, or removed with its publisher).
        """
        mapping = self._map(check_segment_name(name))
        if mapping.holders == 0 and not _try_lock(mapping.fd, fcntl.LOCK_SH):
            raise StaleUpdateError(f"update {update_id} (version {version}): its slot is being rewritten")
        mapping.holders += 1
        try:
            magic, state, slot_version, slot_id, total = _HEADER.unpack_from(mapping.mm, 0)
            if (
                magic != _MAGIC
                or state != _READY
                or slot_version != version
                or slot_id.rstrip(b"\0") != update_id.encode()
            ):
                raise StaleUpdateError(
                    f"update {update_id} (version {version}) was replaced in its slot by version {slot_version}"
                )
            if self._map_payload and HEADER_BYTES + total > len(mapping.mm):
                raise ManifestError(f"slot {name} is shorter than the update it claims to hold")
        except BaseException:
            self.unhold(name)
            raise
        return mapping, int(total)

    def _map(self, name: str) -> Mapping:
        mapping = self._maps.get(name)
        if mapping is not None:
            return mapping
        self.forget_unlinked()
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        except FileNotFoundError:
            raise StaleUpdateError(f"slot {name} no longer exists: its publisher released it or exited") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ManifestError(f"{name} is not a weight slot ({size} bytes)")
            length = size if self._map_payload else HEADER_BYTES
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if self._map_payload else 0)
            mm = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        mapping = self._maps[name] = Mapping(name, fd, mm)
        return mapping

    def forget_unlinked(self) -> None:
        """Unmap segments nobody here holds whose publisher has removed them."""
        for name, mapping in list(self._maps.items()):
            if mapping.holders == 0 and not os.path.exists(os.path.join(SHM_DIR, name)):
                self._unmap(mapping)

    def _unmap(self, mapping: Mapping) -> None:
        del self._maps[mapping.name]
        mapping.views.clear()
        if self._on_forget is not None:
            self._on_forget(mapping.name)
        # Not closed: torch's views over it hold the mapping object, not a buffer export, so closing it would unmap
        # the pages under tensors still alive (an aliased model's parameters: a segfault at their next read). It
        # is unmapped when the last of them goes.
        os.close(mapping.fd)

    def keep(self, held: dict[str, str], update_id: str, name: str) -> None:
        """Record in ``held`` (a reader's update -> segment) the hold :meth:`hold` just took for ``update_id``; an
        update read again gives its extra hold back, so that the reader's one release frees it."""
        if update_id in held:
            self.unhold(name)
        else:
            held[update_id] = name

    def unhold(self, name: str) -> None:
        mapping = self._maps.get(name)
        if mapping is None or mapping.holders == 0:
            return
        mapping.holders -= 1
        if mapping.holders == 0:
            fcntl.flock(mapping.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for mapping in list(self._maps.values()):
            if mapping.holders:
                mapping.holders = 0
                with contextlib.suppress(OSError):
                    fcntl.flock(mapping.fd, fcntl.LOCK_UN)
            self._unmap(mapping)
