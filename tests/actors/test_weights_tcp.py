"""The ``tcp`` weight transport: updates streamed to consumers on other hosts, authenticated and checked."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from harness import descriptors_below_1024_taken
from support import WeightSink, WeightSource, filled_model, models_equal

from actors import (
    ChecksumError,
    ManifestError,
    PublisherDied,
    StaleUpdateError,
    WeightConsumer,
    WeightInbox,
    WeightManifest,
    WeightPublisher,
    WeightSyncError,
    available_transports,
    host_id,
    send,
)
from actors._wire._codec import Decoder, Encoder
from actors.tensors import TcpHandle
from actors.tensors._stream import HELLO, MAGIC, OK, REPLY, UNKNOWN
from actors.tensors.tcp import TcpReader


def weight_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("actors-weights")}


@pytest.fixture
def publisher():
    before = weight_threads()
    publisher = WeightPublisher("tcp", slots=2, lock_timeout=0.3, chunk=4096)
    yield publisher
    publisher.close()
    assert weight_threads() <= before, f"threads left behind: {weight_threads() - before}"


def remote(manifest):  # type: ignore[no-untyped-def]
    """The manifest as a consumer on another host sees it: the publisher's pid means nothing there."""
    return dataclasses.replace(manifest, publisher_host="another-host")


def one_tensor_served_at(listener: socket.socket) -> tuple[WeightManifest, TcpHandle]:
    """A one-tensor update's manifest (its specs, from a ``local`` publish) and a ``tcp`` handle at ``listener``."""
    spec_source = WeightPublisher("local")
    manifest = spec_source.publish({"w": torch.zeros(1)}, 1)
    spec_source.close()
    return manifest, TcpHandle("127.0.0.1", listener.getsockname()[1], os.urandom(32))


def test_tcp_is_always_available_and_its_handle_hides_the_key(publisher):
    assert available_transports()["tcp"] == "pass"
    manifest = publisher.publish(filled_model(1.0), 1)
    assert type(manifest.handle) is TcpHandle and len(manifest.handle.key) == 32
    assert "key" not in repr(manifest) and manifest.handle.key.hex() not in repr(manifest)
    assert manifest.publisher_host == host_id()
    decoded = Decoder().decode(Encoder().encode(manifest))  # crosses any port or endpoint as is
    assert decoded == manifest


def test_a_failed_accept_leaves_the_server_serving(monkeypatch):
    """The server's ``accept`` fails (out of file descriptors: EMFILE); it says so and goes on accepting (before,
    its thread ended without a word: every later fetch, of every version, waited out its deadline)."""
    import errno

    accept, failed = socket.socket.accept, []

    def once_out_of_descriptors(self: socket.socket):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(True)
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    monkeypatch.setattr(socket.socket, "accept", once_out_of_descriptors)
    with WeightPublisher("tcp", slots=2, chunk=4096) as publisher:
        manifest = publisher.publish(filled_model(2.0), 1)
        reader = TcpReader(timeout=10)
        try:
            tensors = reader.read(manifest.update_id, manifest.version, manifest.handle, manifest.tensors)
            assert failed and all(bool((t == 2.0).all()) for t in tensors.values())
            reader.release(manifest.update_id)
        finally:
            reader.close()


def test_a_peer_that_connects_and_says_nothing_holds_a_reader_slot_only_briefly(monkeypatch):
    """Connections that never send their request (a stranger without the key) are dropped after
    ``REQUEST_TIMEOUT``; with every reader slot held by such, a reader's connection waits in the backlog for a
    slot (before: a thread and a descriptor per connection, without a bound, held for 60 s each)."""
    from actors.tensors import tcp

    monkeypatch.setattr(tcp, "MAX_READERS", 2)
    monkeypatch.setattr(tcp, "REQUEST_TIMEOUT", 0.5)
    with WeightPublisher("tcp", slots=2, chunk=4096) as publisher:
        manifest = publisher.publish(filled_model(3.0), 1)
        handle = manifest.handle
        idle = [socket.create_connection((handle.host, handle.port)) for _ in range(2)]
        try:
            reader = TcpReader(timeout=20)
            try:
                tensors = reader.read(manifest.update_id, manifest.version, handle, manifest.tensors)
                assert all(bool((t == 3.0).all()) for t in tensors.values())
                reader.release(manifest.update_id)
            finally:
                reader.close()
            for sock in idle:  # each was dropped: its read sees the end of the stream after the server's hello
                sock.settimeout(10)
                assert len(sock.recv(1 << 16)) == HELLO.size and sock.recv(1) == b""
        finally:
            for sock in idle:
                sock.close()


def test_closing_a_reader_ends_a_fetch_still_connecting(publisher, monkeypatch):
    """``close()`` from another thread while a fetch connects: the fetch ends with ``WeightSyncError`` and leaves
    no thread behind (before, it was not yet registered: it went on after the close, fetched the whole update,
    and started a checker thread nobody would stop)."""
    from actors.tensors import tcp

    manifest = publisher.publish(filled_model(1.0), 1)
    connecting, go = threading.Event(), threading.Event()
    connect = tcp._connect

    def slow_connect(*args, **kwargs):  # type: ignore[no-untyped-def]
        connecting.set()
        go.wait(30)
        return connect(*args, **kwargs)

    monkeypatch.setattr(tcp, "_connect", slow_connect)
    reader, got = TcpReader(timeout=30), []

    def fetch() -> None:
        try:
            got.append(reader.read(manifest.update_id, manifest.version, manifest.handle, manifest.tensors))
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=fetch)
    thread.start()
    assert connecting.wait(30)
    reader.close()
    go.set()
    thread.join(30)
    assert len(got) == 1 and isinstance(got[0], WeightSyncError) and not isinstance(got[0], PublisherDied), got
    assert not any(name.startswith("actors-weights-crc") for name in weight_threads())
    with pytest.raises(WeightSyncError, match="closed"):
        reader.read(manifest.update_id, manifest.version, manifest.handle, manifest.tensors)


def test_install_from_the_stream_is_whole_and_exact(publisher):
    source, target = filled_model(3.0), filled_model(0.0)
    with torch.no_grad():
        source[0].weight.copy_(torch.randn_like(source[0].weight))  # varied bytes over many 4 KiB chunks
    consumer = WeightConsumer()
    manifest = publisher.publish(source, 1)
    consumer.install(remote(manifest), target)
    consumer.release(manifest.update_id)
    assert models_equal(source, target)
    assert consumer.state(manifest.update_id) == "released"
    consumer.close()


def test_a_fetch_whose_socket_is_numbered_past_1024_connects(publisher):
    """A consumer holding over a thousand descriptors: its fetch's socket is numbered 1024 or more, which
    ``select.select`` refuses (a raw ``ValueError`` for every version, naming nothing); the connect is polled."""
    source, target = filled_model(3.0), filled_model(0.0)
    consumer = WeightConsumer()
    manifest = publisher.publish(source, 1)
    with descriptors_below_1024_taken():
        consumer.install(remote(manifest), target)
    consumer.release(manifest.update_id)
    assert models_equal(source, target)
    consumer.close()


async def test_an_async_install_fetches_off_the_loop_and_the_loop_keeps_running(publisher):
    source = {"w": torch.randn(4 << 20)}  # 16 MiB
    target = {"w": torch.zeros(4 << 20)}
    model = torch.nn.Module()
    model.register_buffer("w", target["w"])
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    consumer = WeightConsumer()
    manifest = await publisher.publish_async(source, 1)
    running = asyncio.ensure_future(ticker())
    try:
        await consumer.install_async(remote(manifest), model)
    finally:
        running.cancel()
    assert torch.equal(model.w, source["w"])
    assert ticks > 1, "the loop did not run while the update was fetched"
    consumer.close()


async def test_concurrent_fetches_by_one_reader_each_get_a_buffer_of_their_own():
    """Two updates fetched at once on worker threads, after a released one left a spare buffer: one fetch may
    reuse the spare, never both (each would be overwritten by the other's bytes)."""
    with WeightPublisher("tcp", slots=3, chunk=4096) as publisher:
        reader = TcpReader()
        first = await publisher.publish_async({"w": torch.zeros(1 << 18)}, 1)
        spare = (await reader.read_async(first.update_id, 1, first.handle, first.tensors))["w"]
        spare_at = spare.untyped_storage().data_ptr()
        del spare
        reader.release(first.update_id)
        publisher.release(first.update_id)
        sources = [{"w": torch.full((1 << 18,), float(v))} for v in (2, 3)]
        manifests = [await publisher.publish_async(source, v) for v, source in zip((2, 3), sources, strict=True)]
        fetched = await asyncio.gather(
            *(reader.read_async(m.update_id, m.version, m.handle, m.tensors) for m in manifests)
        )
        for source, tensors in zip(sources, fetched, strict=True):
            assert torch.equal(tensors["w"], source["w"])
        pointers = {tensors["w"].untyped_storage().data_ptr() for tensors in fetched}
        assert len(pointers) == 2, "two fetches shared one buffer"
        assert spare_at in pointers, "the released buffer was not reused"
        reader.close()


async def test_a_blocking_read_on_an_event_loop_is_refused_with_the_way_out_and_costs_nothing(publisher):
    """The caller's mistake, not the update's: it stays unknown here (before: rejected, and an inbox had taken it
    off its queue, so the async install that followed found nothing, and a copy delivered again was dropped)."""
    consumer = WeightConsumer()
    manifest = remote(publisher.publish(filled_model(1.0), 1))
    target = filled_model(0.0)
    with pytest.raises(WeightSyncError, match="install_async"):
        consumer.install(manifest, target)
    with pytest.raises(WeightSyncError, match="import_update_async"):
        consumer.import_update(manifest)
    assert models_equal(target, filled_model(0.0)) and consumer.state(manifest.update_id) is None
    await consumer.install_async(manifest, target)
    assert models_equal(target, filled_model(1.0))
    second = filled_model(0.0)
    consumer.install(manifest, second)  # already fetched: nothing blocks, into another module it goes
    assert models_equal(second, filled_model(1.0))
    consumer.release(manifest.update_id)
    consumer.close()
    inbox = WeightInbox()
    inbox.put(remote(publisher.publish(filled_model(2.0), 2)))
    with pytest.raises(WeightSyncError, match="install_newest_async"):
        inbox.install_newest(target)
    assert len(inbox) == 1, "still queued"
    assert (await inbox.install_newest_async(target)) is not None and models_equal(target, filled_model(2.0))
    await inbox.close_async()


def test_a_corrupted_chunk_is_refused_and_the_model_keeps_its_weights(publisher):
    manifest = publisher.publish(filled_model(2.0), 1)
    staged = publisher._writer._slots[0]  # type: ignore[attr-defined]
    staged.data[5000] ^= 0xFF  # the bytes change after their CRCs were taken
    target = filled_model(0.0)
    consumer = WeightConsumer()
    with pytest.raises(ChecksumError, match="chunk 1 arrived corrupted"):
        consumer.install(remote(manifest), target)
    assert models_equal(target, filled_model(0.0))
    consumer.close()


def test_a_reader_without_the_key_is_refused_and_reads_nothing(publisher):
    manifest = publisher.publish(filled_model(2.0), 1)
    forged = dataclasses.replace(manifest.handle, key=os.urandom(32))
    consumer = WeightConsumer()
    with pytest.raises(WeightSyncError, match="refused the manifest's key"):
        consumer.import_update(remote(dataclasses.replace(manifest, handle=forged)))
    consumer.close()


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (
            REPLY.pack(MAGIC, OK, 4, 4096, 1, bytes(32)) + bytes(4) + b"evil",
            "could not prove it holds the update's key",
        ),
        # 4 GiB in one-byte chunks: a 16 GiB table of CRCs, offered before anything is authenticated
        (
            REPLY.pack(MAGIC, OK, (1 << 32) - 1, 1, (1 << 32) - 1, bytes(32)),
            "offers 4294967295 bytes where the manifest",
        ),
        # "no such update": proved like any reply (before, taken unproved: StaleUpdateError, and the consumer
        # waited for a newer manifest from a publisher that may be gone or impersonated)
        (REPLY.pack(MAGIC, UNKNOWN, 0, 0, 0, bytes(32)), "could not prove it holds the update's key"),
    ],
    ids=["wrong-mac", "oversized", "unproved-unknown"],
)
def test_a_server_that_cannot_prove_the_key_is_not_read_from(reply, match):
    """An impostor at the manifest's address: its reply's MAC is wrong, or its sizes are more than the manifest
    allows (refused before its CRC table is read), so no byte of it is used."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.sendall(HELLO.pack(MAGIC, os.urandom(16)))
            sock.recv(4096)
            sock.sendall(reply)

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        manifest, handle = one_tensor_served_at(listener)
        fake = dataclasses.replace(manifest, transport="tcp", handle=handle, publisher_host="elsewhere")
        consumer = WeightConsumer()
        with pytest.raises(WeightSyncError, match=match):
            consumer.import_update(fake)
        consumer.close()
    finally:
        thread.join(10)
        listener.close()


def test_a_reply_in_chunks_too_small_to_be_ours_is_refused_before_its_crc_table_is_read():
    """Within the manifest's size, a reply in 1-byte chunks asks the reader to take a table of 4 bytes per byte
    (4 GiB for a 1 GiB update) before anything is authenticated: chunks below MIN_CHUNK are refused first."""
    from actors.tensors._stream import MIN_CHUNK

    listener = socket.create_server(("127.0.0.1", 0))
    total = 1 << 20
    replied = threading.Event()

    def impostor() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.sendall(HELLO.pack(MAGIC, os.urandom(16)))
            sock.recv(4096)
            sock.sendall(REPLY.pack(MAGIC, OK, total, 1, total, bytes(32)))
            replied.set()
            sock.recv(1)  # holds the connection open: the reader must not wait for a table

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        spec_source = WeightPublisher("local")
        manifest = spec_source.publish({"w": torch.zeros(total // 4)}, 1)
        spec_source.close()
        handle = TcpHandle("127.0.0.1", listener.getsockname()[1], os.urandom(32))
        fake = dataclasses.replace(manifest, transport="tcp", handle=handle, publisher_host="elsewhere")
        consumer = WeightConsumer()
        with pytest.raises(WeightSyncError, match=f"malformed.*at least {MIN_CHUNK}"):
            consumer.import_update(fake)
        consumer.close()
        assert replied.is_set()
    finally:
        thread.join(10)
        listener.close()
    with pytest.raises(ValueError, match=f"chunk must be at least {MIN_CHUNK}"):
        WeightPublisher("tcp", chunk=MIN_CHUNK - 1)


def test_an_update_whose_buffer_was_reused_is_stale(publisher):
    first = publisher.publish(filled_model(1.0), 1)
    publisher.publish(filled_model(2.0), 2)
    publisher.publish(filled_model(3.0), 3)  # two slots: version 1's buffer now holds version 3
    consumer = WeightConsumer()
    with pytest.raises(StaleUpdateError, match="no longer holds it"):
        consumer.import_update(remote(first))
    consumer.close()


def test_closing_joins_a_sender_still_ending_after_its_reply(publisher):
    """A sender thread that has answered and is still ending (its last lines: its socket closed, its reader's
    place given back) as the publisher closes: it forgot itself before ending, so the close did not join it, and
    it outlived the publisher (a CI run's leak check caught it)."""
    server = publisher._writer._server
    places = server._readers

    class SlowToGiveBack:
        def acquire(self, *args: object, **kwargs: object) -> bool:
            return places.acquire(*args, **kwargs)

        def release(self) -> None:
            if threading.current_thread().name == "actors-weights-send":
                time.sleep(0.3)  # (the sender's end, drawn out: the close comes meanwhile)
            places.release()

    server._readers = SlowToGiveBack()
    first = publisher.publish(filled_model(1.0), 1)
    publisher.publish(filled_model(2.0), 2)
    publisher.publish(filled_model(3.0), 3)
    consumer = WeightConsumer()
    with pytest.raises(StaleUpdateError):
        consumer.import_update(remote(first))  # answered; its sender still ending
    publisher.close()
    assert "actors-weights-send" not in weight_threads(), "the close joined it"
    consumer.close()


def test_a_closed_publisher_on_another_host_reads_as_dead():
    publisher = WeightPublisher("tcp")
    manifest = publisher.publish(filled_model(1.0), 1)
    publisher.close()
    consumer = WeightConsumer()
    with pytest.raises(PublisherDied, match="connection refused"):
        consumer.import_update(remote(manifest))
    assert consumer.state(manifest.update_id) == "rejected"
    consumer.close()


def test_malformed_handles_are_refused_before_any_connection(publisher):
    manifest = publisher.publish(filled_model(1.0), 1)
    reader = TcpReader()
    for handle in ("127.0.0.1:1", TcpHandle("127.0.0.1", 0, bytes(32)), TcpHandle("127.0.0.1", 80, b"short")):
        with pytest.raises(ManifestError, match="not a 'tcp' weight handle"):
            reader.read(manifest.update_id, 1, handle, manifest.tensors)
    reader.close()


async def test_a_fetch_that_outlives_its_deadline_fails_and_ends():
    """A server that accepts the connection but never speaks: the awaited fetch gives up on time."""
    listener = socket.create_server(("127.0.0.1", 0))  # never accepts: the kernel completes the connect
    try:
        manifest, handle = one_tensor_served_at(listener)
        reader = TcpReader()
        with pytest.raises(WeightSyncError, match=r"took longer than 0\.3s"):
            await reader.read_async(manifest.update_id, 1, handle, manifest.tensors, timeout=0.3)
        reader.close()
    finally:
        listener.close()


@contextlib.contextmanager
def _hanging_fetch(timeout: float) -> Iterator[tuple[TcpReader, WeightManifest, TcpHandle]]:
    """A reader with ``timeout`` and an update served by a listener whose accept queue is full (backlog 0, one
    connection never accepted): a connect to it hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=10)
    reader = TcpReader(timeout=timeout)
    try:
        yield (reader, *one_tensor_served_at(listener))
    finally:
        reader.close()
        filler.close()
        listener.close()


async def test_a_fetch_whose_connect_hangs_ends_at_its_deadline_or_when_cancelled():
    """The deadline and a cancel reach a fetch still connecting (before, both waited for the connect's own
    timeout: up to 30 s)."""
    with _hanging_fetch(60.0) as (reader, manifest, handle):
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"took longer than 0\.3s"):
            await reader.read_async(manifest.update_id, 1, handle, manifest.tensors, timeout=0.3)
        assert time.monotonic() - started < 5, "(a guard: the fetch ends at about 0.3 s)"
        task = asyncio.ensure_future(reader.read_async(manifest.update_id, 1, handle, manifest.tensors))
        await asyncio.sleep(0)  # (the fetch starts on its thread; cancelled before or during its connect alike)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 5, "(a guard: the cancel ends the connect at once)"


async def test_a_receive_that_times_out_is_not_a_dead_publisher():
    """A server that accepts and never speaks, read with a socket timeout shorter than the fetch's deadline: the
    timeout says nothing of the publisher's life (before, every socket error was PublisherDied)."""
    listener = socket.create_server(("127.0.0.1", 0))  # never accepts: the kernel completes the connect
    reader = TcpReader(timeout=0.3)
    try:
        manifest, handle = one_tensor_served_at(listener)
        with pytest.raises(WeightSyncError, match="TimeoutError") as caught:
            await reader.read_async(manifest.update_id, 1, handle, manifest.tensors, timeout=30)
        assert not isinstance(caught.value, PublisherDied)
    finally:
        reader.close()
        listener.close()


async def test_a_fetch_cancelled_again_while_it_ends_raises_the_cancel(monkeypatch):
    """Past its deadline a fetch aborts its transfer and waits for the thread to end; a cancel that comes then is
    the caller's and stands (before, it was swallowed and the deadline's WeightSyncError raised instead, so a
    caller that handles that error ran on although its task had been cancelled)."""
    reader = TcpReader()
    fetches: list[object] = []
    release = threading.Event()

    def stuck(update_id: str, version: int, handle: object, specs: object, fetch: object) -> None:
        fetches.append(fetch)
        assert release.wait(30)
        raise WeightSyncError("the fetch was cancelled")

    monkeypatch.setattr(reader, "_fetch", stuck)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        manifest, handle = one_tensor_served_at(listener)
        task = asyncio.ensure_future(reader.read_async(manifest.update_id, 1, handle, manifest.tensors, timeout=0.05))
        deadline = time.monotonic() + 30  # a guard against a hang only
        while not (fetches and fetches[0].aborted) and time.monotonic() < deadline:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
        task.cancel()  # the deadline passed: it now waits for the aborted fetch's thread
        await asyncio.sleep(0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        release.set()
        reader.close()
        listener.close()


def test_a_blocking_fetch_whose_connect_hangs_ends_at_its_deadline():
    with _hanging_fetch(0.5) as (reader, manifest, handle):
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"took longer than 0\.5s|no connection within 0\.5s"):
            reader.read(manifest.update_id, 1, handle, manifest.tensors)
        assert time.monotonic() - started < 5, "(a guard: the fetch ends at about 0.5 s)"


def test_a_blocking_fetch_from_a_server_that_trickles_ends_at_its_deadline():
    """A socket timeout bounds each receive, not the fetch: a server sending a byte every 0.2 s kept a blocking
    ``read`` going as long as it liked. The reader's ``timeout`` bounds the whole fetch, as documented."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        sock, _ = listener.accept()
        with sock:
            while not stop.wait(0.2):
                try:
                    sock.sendall(b"x")
                except OSError:
                    return

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        manifest, handle = one_tensor_served_at(listener)
        reader = TcpReader(timeout=1.0)
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"took longer than 1s"):
            reader.read(manifest.update_id, 1, handle, manifest.tensors)
        assert time.monotonic() - started < 10, "(a guard: the fetch ends at about 1 s)"
        reader.close()
    finally:
        stop.set()
        thread.join(10)
        listener.close()


async def test_a_cancelled_fetch_leaves_the_publisher_serving(publisher):
    source = {"w": torch.randn(8 << 20)}  # 32 MiB
    manifest = remote(await publisher.publish_async(source, 1))
    consumer = WeightConsumer()
    fetch = asyncio.ensure_future(consumer.import_update_async(manifest))
    await asyncio.sleep(0)
    fetch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fetch
    assert consumer.state(manifest.update_id) is None  # nothing half-imported
    staged = publisher._writer._slots[0]  # type: ignore[attr-defined]
    await asyncio.wait_for(_until(lambda: staged.sending == 0), 10)
    again = WeightConsumer()
    tensors = await again.import_update_async(manifest)
    assert torch.equal(tensors["w"], source["w"])
    again.close()
    consumer.close()


async def _until(condition) -> None:  # type: ignore[no-untyped-def]
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_remote_publishers_pid_is_not_watched_on_this_host():
    """An inbox whose updates come from another host waits for arrival or timeout, not for a local pid."""
    inbox = WeightInbox()
    publisher = WeightPublisher("tcp")
    manifest = dataclasses.replace(publisher.publish(filled_model(1.0), 1), publisher_pid=2**22 - 1)
    inbox.put(remote(manifest))
    assert not inbox.publisher_here
    inbox.take_newest()
    from actors import CallTimeout

    with pytest.raises(CallTimeout):
        await inbox.wait(0.05)
    publisher.close()
    inbox.close()


async def test_an_actor_installs_from_a_tcp_publisher_in_another_process(procs):
    source = procs.spawn("source", WeightSource, "tcp")
    sink = procs.spawn("sink", WeightSink)
    manifest = await source.slice(procs=0).publish.call_one(4)
    assert manifest.transport == "tcp"
    send(sink.slice(procs=1).update_weights, (manifest,))
    assert await sink.slice(procs=1).install_until.call_one(4) == 1


@pytest.mark.gpu
def test_gpu_tensors_are_staged_through_pinned_memory_and_installed_on_the_gpu():
    source = filled_model(5.0).cuda()
    target = filled_model(0.0).cuda()
    publisher = WeightPublisher("tcp")
    try:
        manifest = publisher.publish(source, 1)
        assert publisher._writer._slots[0].data.is_pinned()  # type: ignore[attr-defined]
        consumer = WeightConsumer()
        consumer.install(remote(manifest), target)
        consumer.close()
        assert models_equal(source, target)
    finally:
        publisher.close()
