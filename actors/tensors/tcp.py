"""The ``tcp`` transport: weights for consumers on other hosts, streamed from a staging buffer.

The writer copies each update into a staging buffer of its own (pinned host
memory when the tensors are on a GPU, so the device-to-host copy runs at
full speed), computes a CRC-32 per chunk, and serves it from a small server
thread bound to this host's cluster address. A reader fetches the whole
update over one dedicated connection (:mod:`._stream`) into a buffer of its
own, then builds its tensors as views of it: the bytes never pass through
msgpack, the actors' sockets or a Python object.

Lifecycle as for the other transports: a staging buffer is reused once its
update is released or superseded and no reader is being sent it; a reader
asking for an update whose buffer was reused gets :class:`StaleUpdateError`,
and one whose publisher has gone gets :class:`PublisherDied`. The fetch
takes time on the network, so on an event loop it must be awaited
(:meth:`TcpReader.read_async`); :meth:`TcpReader.read` refuses to block one.

Other fabrics (NCCL, RDMA) would plug in at this same seam: a writer that
registers its staging memory, a reader that pulls it, the same manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._shared._errors import ManifestError, PublisherDied, StaleUpdateError, WeightSyncError
from .._shared._loops import loop_running
from .._shared._readiness import fd_ready
from .._shared._session import bind_host
from .._wire._buffers import tensor_buffer
from . import ALIGN, TensorSpec, check_specs, checksum
from ._sharded import is_sharded, wholes
from ._slots import CLOSED, LOCK_TIMEOUT, checked_wait, poll_async, poll_blocking
from ._stream import (
    CHUNK,
    HELLO,
    MAGIC,
    MAX_ID_BYTES,
    MIN_CHUNK,
    OK,
    REFUSED,
    REPLY,
    REQUEST,
    UNKNOWN,
    TcpHandle,
    check_reply,
    chunk_crcs,
    nonce,
    receive_exactly,
    receive_verified,
    reply_mac,
    request_mac,
)

__all__ = ["FETCH_TIMEOUT", "TcpHandle", "TcpReader", "TcpWriter", "probe"]

log = logging.getLogger("actors.weights")

#: How long a fetch may take by default (connect, handshake and every byte).
FETCH_TIMEOUT = 120.0
#: How long the server waits on one reader's socket before dropping it.
SERVE_TIMEOUT = 60.0
#: How long a connection may take to send its (authenticated) request: a peer without the key holds no more.
REQUEST_TIMEOUT = 10.0
#: Readers served at once; more connections wait in the listen backlog (their connect waits, within its deadline).
MAX_READERS = 128
#: After a failed ``accept`` (out of file descriptors, of memory): the pause before trying again.
ACCEPT_RETRY = 0.1


def probe() -> str | None:
    return None  # sockets are always there


@dataclass(eq=False)
class _Staged:
    """One staging buffer of a writer and the update it holds."""

    data: torch.Tensor  # uint8, CPU (pinned when its updates come from a GPU)
    update_id: str | None = None
    version: int = -1
    nbytes: int = 0
    crcs: bytes = b""
    released: bool = True
    filling: bool = False
    sending: int = 0  # readers being sent this update now

    @property
    def capacity(self) -> int:
        return self.data.numel()


class TcpWriter:
    """Publisher side: stages updates in reusable host buffers and serves them to readers."""

    host_copy = True

    def __init__(
        self, slots: int = 2, lock_timeout: float = LOCK_TIMEOUT, host: str | None = None, chunk: int = CHUNK
    ) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"a publisher needs at least one slot, not {slots!r}")
        if type(chunk) is not int or chunk < MIN_CHUNK:
            raise ValueError(f"chunk must be at least {MIN_CHUNK} bytes (an int), not {chunk!r}")
        self.max_slots = slots
        self.lock_timeout = checked_wait(lock_timeout, "lock_timeout")
        self.chunk = chunk
        self._lock = threading.Lock()
        self._slots: list[_Staged] = []
        self._newest: str | None = None
        self._reclaimed: list[str] = []
        self._closed = False
        self._server = _Server(host or bind_host(), self)

    @property
    def address(self) -> tuple[str, int]:
        return self._server.host, self._server.port

    def reserve(self, nbytes: int) -> _Staged | None:
        """A free staging buffer (released first, then a new one, then the oldest superseded); none once closed."""
        with self._lock:
            if self._closed:
                raise WeightSyncError(CLOSED)
            idle = [s for s in self._slots if not s.filling and s.sending == 0]
            released = [s for s in idle if s.released]
            superseded = sorted((s for s in idle if not s.released and s.update_id != self._newest), key=_version)
            newest = [s for s in idle if not s.released and s.update_id == self._newest]
            if released:
                staged = released[0]
            elif len(self._slots) < self.max_slots:
                staged = _Staged(torch.empty(0, dtype=torch.uint8))
                self._slots.append(staged)
            elif superseded or newest:
                staged = (superseded or newest)[0]
            else:
                return None
            if staged.update_id is not None and not staged.released:
                self._reclaimed.append(staged.update_id)
            staged.update_id, staged.version, staged.released, staged.filling = None, -1, True, True
            staged.nbytes = nbytes
            return staged

    async def reserve_async(self, nbytes: int, timeout: float) -> _Staged:
        return await poll_async(lambda: self.reserve(nbytes), timeout, self._exhausted)

    def reserve_blocking(self, nbytes: int, timeout: float) -> _Staged:
        return poll_blocking(lambda: self.reserve(nbytes), timeout, self._exhausted)

    def _exhausted(self, timeout: float) -> WeightSyncError:
        return WeightSyncError(
            f"all {self.max_slots} weight staging buffers were being sent to readers for {timeout:g}s; "
            "publish with more slots, or less often"
        )

    def fill(
        self, staged: _Staged, tensors: list[tuple[str, torch.Tensor]], specs: list[TensorSpec], with_checksums: bool
    ) -> list[TensorSpec]:
        """Copy into the staging buffer (through pinned memory from a GPU), then CRC each chunk."""
        from_gpu = any(t.is_cuda for _, t in tensors)
        if staged.capacity < staged.nbytes or (from_gpu and not staged.data.is_pinned()):
            staged.data = torch.empty(staged.nbytes, dtype=torch.uint8, pin_memory=from_gpu)
        data = staged.data
        sources = wholes(t for _, t in tensors)  # sharded ones gathered here, a bucket at a time
        for spec, (_, tensor), source in zip(specs, tensors, sources, strict=True):
            dst = data[spec.offset : spec.offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
            # a gathered copy is freed at once: copied synchronously
            dst.copy_(source, non_blocking=tensor.is_cuda and not is_sharded(tensor))
        for device in {tensor.device for _, tensor in tensors if tensor.is_cuda}:
            torch.cuda.synchronize(device)  # each source's GPU (a worker thread's current device is GPU 0's)
        out = (
            [replace(s, checksum=checksum(data[s.offset : s.offset + s.nbytes])) for s in specs]
            if with_checksums
            else specs
        )
        staged.crcs = chunk_crcs(tensor_buffer(data, staged.nbytes), self.chunk) if staged.nbytes else b""
        return out

    def commit(self, staged: _Staged, update_id: str, version: int, nbytes: int) -> TcpHandle:
        with self._lock:
            staged.update_id, staged.version, staged.released, staged.filling = update_id, version, False, False
            self._newest = update_id
        return self._server.handle

    def abort(self, staged: _Staged) -> None:
        with self._lock:
            staged.update_id, staged.version, staged.released, staged.filling = None, -1, True, False

    def release(self, update_id: str) -> None:
        with self._lock:
            for staged in self._slots:
                if staged.update_id == update_id:
                    staged.released = True

    def reclaimed(self) -> list[str]:
        with self._lock:
            out, self._reclaimed = self._reclaimed, []
        return out

    def close(self) -> None:
        self._server.close()
        with self._lock:
            self._closed = True
            self._slots.clear()

    # ------------------------------------------------------------------ the server's view

    def lend(self, update_id: str, version: int) -> _Staged | None:
        """The buffer holding exactly that update, counted as being sent; None if it holds no longer."""
        with self._lock:
            for staged in self._slots:
                if staged.update_id == update_id and staged.version == version and not staged.filling:
                    staged.sending += 1
                    return staged
        return None

    def give_back(self, staged: _Staged) -> None:
        with self._lock:
            staged.sending -= 1


def _version(staged: _Staged) -> int:
    return staged.version


class _Server:
    """A listening socket and one thread per reader, serving a writer's staged updates."""

    def __init__(self, host: str, writer: TcpWriter) -> None:
        self._writer = writer
        self._key = os.urandom(32)
        self._listener = socket.create_server((host, 0), backlog=64)
        self.host, self.port = host, self._listener.getsockname()[1]
        self.handle = TcpHandle(host, self.port, self._key)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._senders: set[threading.Thread] = set()
        self._closed = False
        self._closing = threading.Event()  # (wakes the accept thread out of a pause)
        self._readers = threading.Semaphore(MAX_READERS)
        self._thread = threading.Thread(target=self._accept, name=f"actors-weights-tcp:{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        """Accept readers until closed; a failed ``accept`` (no file descriptor left) is retried, never the end."""
        while not self._closing.is_set():
            if not self._readers.acquire(timeout=ACCEPT_RETRY):
                continue  # (as many readers as it serves at once: the next waits in the backlog)
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                self._readers.release()
                if self._closing.is_set():
                    return
                log.warning("weights: the tcp server could not accept a reader (%s); trying again", exc)
                self._closing.wait(ACCEPT_RETRY)
                continue
            self._start_sender(sock)

    def _start_sender(self, sock: socket.socket) -> None:
        """Serve ``sock`` on a thread of its own (closed at once if the server is closing or no thread starts)."""
        with self._lock:
            if not self._closed:
                sender = threading.Thread(target=self._serve, args=(sock,), name="actors-weights-send", daemon=True)
                try:
                    sender.start()
                except RuntimeError as exc:  # (no thread can be started now)
                    log.warning("weights: the tcp server could not serve a reader (%s)", exc)
                else:
                    self._open.add(sock)
                    # (a thread that ended is forgotten here, not by itself: one that ran its last lines still
                    # counts until it has ended, so a close joins it)
                    self._senders = {thread for thread in self._senders if thread.is_alive()}
                    self._senders.add(sender)
                    return
        sock.close()
        self._readers.release()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(REQUEST_TIMEOUT)  # until the request is in and checked: then SERVE_TIMEOUT
            self._answer(sock)
        except OSError as exc:  # the reader went away or stalled: its fetch fails on its side
            log.debug("weight transfer to a reader ended early: %s", exc)
        finally:
            with self._lock:
                self._open.discard(sock)
            sock.close()
            self._readers.release()

    def _answer(self, sock: socket.socket) -> None:
        server_nonce = nonce()
        sock.sendall(HELLO.pack(MAGIC, server_nonce))
        head = bytearray(REQUEST.size)
        receive_exactly(sock, memoryview(head))
        magic, reader_nonce, mac, version, id_bytes = REQUEST.unpack(head)
        if magic != MAGIC or id_bytes > MAX_ID_BYTES:
            return
        update_id = bytearray(id_bytes)
        receive_exactly(sock, memoryview(update_id))
        if not hmac.compare_digest(mac, request_mac(self._key, server_nonce, reader_nonce, version, bytes(update_id))):
            sock.sendall(REPLY.pack(MAGIC, REFUSED, 0, 0, 0, bytes(32)))
            return
        sock.settimeout(SERVE_TIMEOUT)
        staged = self._writer.lend(update_id.decode(errors="replace"), version)
        if staged is None:
            mac = reply_mac(self._key, reader_nonce, server_nonce, UNKNOWN, 0, 0, b"")
            sock.sendall(REPLY.pack(MAGIC, UNKNOWN, 0, 0, 0, mac))
            return
        try:
            total, chunk, crcs = staged.nbytes, self._writer.chunk, staged.crcs
            mac = reply_mac(self._key, reader_nonce, server_nonce, OK, total, chunk, crcs)
            sock.sendall(REPLY.pack(MAGIC, OK, total, chunk, len(crcs) // 4, mac) + crcs)
            if total:
                data = tensor_buffer(staged.data, total)
                for start in range(0, total, chunk):
                    sock.sendall(data[start : start + chunk])
        finally:
            self._writer.give_back(staged)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            readers = list(self._open)
            senders = list(self._senders)
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in readers:  # a reader mid-transfer sees the connection end: its fetch fails cleanly
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)
        for sender in senders:  # each ends as soon as its socket is shut down
            sender.join(5.0)


class _Fetch:
    """One fetch in progress: its socket, so that a cancelled caller can end it from another thread."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.aborted = False
        self.expired = False

    def expire(self) -> None:
        """The fetch's deadline passed (a timer's thread): end it."""
        self.expired = True
        self.abort()

    def abort(self) -> None:
        self.aborted = True
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


#: How often a connect in progress looks whether its fetch was aborted (seconds).
CONNECT_SLICE = 0.05


def _connect(handle: TcpHandle, fetch: _Fetch, timeout: float, what: str) -> socket.socket:
    """A connection to ``handle``'s server within ``timeout``, given up as soon as ``fetch`` is aborted.

    A blocking connect cannot be interrupted from another thread (a server
    whose accept queue is full leaves it hanging), so it runs non-blocking
    and is polled in slices of :data:`CONNECT_SLICE`.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(handle.host, handle.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise WeightSyncError(f"{what}: cannot reach its publisher: {exc}") from None
    try:
        sock.setblocking(False)
        error = sock.connect_ex(address)
        deadline = time.monotonic() + timeout
        while error in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
            if fetch.aborted:
                raise WeightSyncError(f"{what}: the fetch was cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncError(f"{what}: cannot reach its publisher: no connection within {timeout:g}s")
            if fd_ready(sock, write=True, timeout=min(left, CONNECT_SLICE)):
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error == errno.ECONNREFUSED:
            raise PublisherDied(f"{what}: its publisher no longer serves it (connection refused)", pid=-1)
        if error:
            raise WeightSyncError(f"{what}: cannot reach its publisher: {os.strerror(error)}")
        sock.setblocking(True)
        return sock
    except BaseException:
        sock.close()
        raise


class TcpReader:
    """Consumer side: fetches each update into a buffer of its own and hands out views of it.

    Buffers are pinned when this process uses CUDA (installing into a GPU
    model then copies at full speed) and reused once released.
    """

    def __init__(self, timeout: float = FETCH_TIMEOUT, pin: bool | None = None) -> None:
        self.timeout = timeout
        self._pin = pin
        self._held: dict[str, torch.Tensor] = {}
        self._spare: torch.Tensor | None = None
        self._lock = threading.Lock()  # the spare buffer and the checker, taken by fetches on worker threads
        self._checker: ThreadPoolExecutor | None = None
        self._fetches: set[_Fetch] = set()
        self._closed = False

    def read(self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        if loop_running():
            raise WeightSyncError(
                "a 'tcp' update is fetched over the network, and read() will not block a running event loop: "
                "use `await consumer.install_async(...)` (or `import_update_async`), which fetches off the loop"
            )
        handle = _check_handle(handle)
        fetch = _Fetch()
        deadline = threading.Timer(self.timeout, fetch.expire)  # (a socket timeout bounds one receive, not all)
        deadline.daemon = True
        deadline.start()
        try:
            data = self._fetch(update_id, version, handle, specs, fetch)
        except WeightSyncError:
            if fetch.expired:
                raise WeightSyncError(f"update {update_id}: fetching it took longer than {self.timeout:g}s") from None
            raise
        finally:
            deadline.cancel()
        return self._hold(update_id, data, specs)

    async def read_async(
        self, update_id: str, version: int, handle: Any, specs: tuple[TensorSpec, ...], timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """:meth:`read` off the event loop's thread; a cancelled or late caller ends the transfer."""
        handle = _check_handle(handle)
        fetch = _Fetch()
        future = asyncio.get_running_loop().run_in_executor(None, self._fetch, update_id, version, handle, specs, fetch)
        limit = self.timeout if timeout is None else timeout
        try:
            data = await asyncio.wait_for(asyncio.shield(future), limit)
        except BaseException as exc:
            fetch.abort()
            try:
                await future  # the thread writes into our buffer until it stops (at once, aborted)
            except asyncio.CancelledError:
                raise  # cancelled again while the fetch ended: that cancel stands (the buffer is the thread's alone)
            except BaseException:  # the aborted fetch's own ending: the first exception is the one to raise
                pass
            if isinstance(exc, asyncio.TimeoutError):
                raise WeightSyncError(f"update {update_id}: fetching it took longer than {limit:g}s") from None
            raise
        return self._hold(update_id, data, specs)

    def _hold(self, update_id: str, data: torch.Tensor, specs: tuple[TensorSpec, ...]) -> dict[str, torch.Tensor]:
        self._held[update_id] = data
        return {s.name: data[s.offset : s.offset + s.nbytes].view(s.torch_dtype).view(s.shape) for s in specs}

    def _fetch(
        self, update_id: str, version: int, handle: TcpHandle, specs: tuple[TensorSpec, ...], fetch: _Fetch
    ) -> torch.Tensor:
        check_specs(specs, 1 << 62)
        needed = max((s.offset + s.nbytes for s in specs), default=0)
        what = f"update {update_id} (version {version}) from {handle.host}:{handle.port}"
        with self._lock:  # registered before it connects: a close() meanwhile aborts the connect too
            if self._closed:
                raise WeightSyncError(f"{what}: this reader was closed")
            self._fetches.add(fetch)
        try:
            sock = _connect(handle, fetch, min(self.timeout, 30.0), what)
        except BaseException:
            with self._lock:
                self._fetches.discard(fetch)
            raise
        fetch.sock = sock
        try:
            sock.settimeout(self.timeout)
            if fetch.aborted:
                raise WeightSyncError(f"{what}: the fetch was cancelled")
            return self._transfer(sock, update_id, version, handle, needed, what)
        except OSError as exc:
            if fetch.aborted:
                raise WeightSyncError(f"{what}: the fetch was cancelled") from None
            if isinstance(exc, ConnectionError):  # reset, refused, broken pipe, or closed mid-stream: gone
                raise PublisherDied(f"{what}: the transfer broke off ({exc})", pid=-1) from None
            # A receive that timed out, or any other local failure, says nothing of the publisher's life.
            raise WeightSyncError(f"{what}: the transfer failed ({type(exc).__name__}: {exc})") from None
        except RuntimeError as exc:  # (the checker shut down under it: the reader closed mid-transfer)
            if not self._closed:
                raise
            raise WeightSyncError(f"{what}: this reader was closed") from exc
        finally:
            with self._lock:
                self._fetches.discard(fetch)
            sock.close()

    def _transfer(
        self, sock: socket.socket, update_id: str, version: int, handle: TcpHandle, needed: int, what: str
    ) -> torch.Tensor:
        hello = bytearray(HELLO.size)
        receive_exactly(sock, memoryview(hello))
        magic, server_nonce = HELLO.unpack(hello)
        if magic != MAGIC:
            raise WeightSyncError(f"{what}: the address does not serve weights")
        reader_nonce, id_bytes = nonce(), update_id.encode()
        mac = request_mac(handle.key, server_nonce, reader_nonce, version, id_bytes)
        sock.sendall(REQUEST.pack(MAGIC, reader_nonce, mac, version, len(id_bytes)) + id_bytes)
        reply = bytearray(REPLY.size)
        receive_exactly(sock, memoryview(reply))

        def crcs_of(count: int) -> bytes:
            crcs = bytearray(4 * count)
            receive_exactly(sock, memoryview(crcs))
            return bytes(crcs)

        status, total, chunk, crcs = check_reply(
            bytes(reply), handle.key, reader_nonce, server_nonce, crcs_of, needed + ALIGN
        )
        if status == REFUSED:
            raise WeightSyncError(f"{what}: the publisher refused the manifest's key")
        if status == UNKNOWN:
            raise StaleUpdateError(f"{what}: its publisher no longer holds it (released or replaced by a newer one)")
        if not needed <= total <= needed + ALIGN:
            raise ManifestError(f"{what}: the publisher serves {total} bytes, the manifest describes {needed}")
        data = self._buffer(total)
        if total:
            with self._lock:  # concurrent fetches (worker threads) share one checker
                if self._closed:
                    raise WeightSyncError(f"{what}: this reader was closed")
                if self._checker is None:
                    self._checker = ThreadPoolExecutor(1, thread_name_prefix="actors-weights-crc")
                checker = self._checker
            receive_verified(sock, tensor_buffer(data, total), chunk, crcs, checker, what)
        return data

    def _buffer(self, nbytes: int) -> torch.Tensor:
        with self._lock:  # concurrent fetches run on worker threads: one of them takes the spare
            spare, self._spare = self._spare, None
        pin = self._pin if self._pin is not None else torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if spare is not None and spare.numel() >= nbytes and spare.is_pinned() == pin:
            return spare[:nbytes] if spare.numel() > nbytes else spare
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def release(self, update_id: str) -> None:
        data = self._held.pop(update_id, None)
        with self._lock:
            if data is not None and (self._spare is None or self._spare.numel() < data.numel()):
                self._spare = data  # the next fetch reuses it (pages already touched, pinning already paid)

    def close(self) -> None:
        """Abort every fetch under way (connecting ones too) and refuse new ones; free the buffers and checker."""
        with self._lock:
            self._closed = True
            fetches, checker, self._checker = list(self._fetches), self._checker, None
        for fetch in fetches:
            fetch.abort()
        self._held.clear()
        self._spare = None
        if checker is not None:
            checker.shutdown(wait=True)


def _check_handle(handle: Any) -> TcpHandle:
    if (
        type(handle) is not TcpHandle
        or type(handle.host) is not str
        or type(handle.port) is not int
        or not 0 < handle.port < 65536
        or type(handle.key) is not bytes
        or len(handle.key) != 32
    ):
        raise ManifestError(f"not a 'tcp' weight handle: {type(handle).__name__}")
    return handle
