"""Publishing never stalls the publisher's event loop: slot waits are awaited, big copies run off it."""

from __future__ import annotations

import asyncio
import glob
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from support import Heartbeat, filled_model

from actors import LifecycleError, WeightConsumer, WeightInbox, WeightPublisher, WeightSyncError
from actors.tensors.shm import SHM_DIR

R = TypeVar("R")

#: The contract: a 1 ms heartbeat on the publisher's loop never misses by this much.
MAX_GAP = 0.1


async def test_publish_async_waits_for_a_held_slot_while_the_loop_beats():
    with WeightPublisher("shm", slots=1, lock_timeout=10) as publisher:
        consumer = WeightConsumer()
        held = publisher.publish(filled_model(1.0), 1)
        consumer.import_update(held)  # the only slot is now held by a reader
        async with Heartbeat() as beat:
            asyncio.get_running_loop().call_later(0.3, consumer.release, held.update_id)
            started = time.monotonic()
            manifest = await publisher.publish_async(filled_model(2.0), 2)
            waited = time.monotonic() - started
        assert manifest.handle == held.handle, "the released slot is reused"
        assert waited >= 0.25, "publish_async waited for the reader to release"
        assert beat.worst_stall < MAX_GAP, f"the loop stalled while publish waited: {beat}"
        assert beat.beats > 50
        consumer.close()


async def test_publish_async_gives_up_at_its_deadline_and_the_loop_keeps_beating():
    with WeightPublisher("shm", slots=1) as publisher:
        consumer = WeightConsumer()
        consumer.import_update(publisher.publish(filled_model(1.0), 1))
        async with Heartbeat() as beat:
            started = time.monotonic()
            with pytest.raises(WeightSyncError, match="held by consumers"):
                await publisher.publish_async(filled_model(2.0), 2, timeout=0.3)
            assert 0.25 <= time.monotonic() - started < 2.0
        assert beat.worst_stall < MAX_GAP, f"the loop stalled: {beat}"
        assert publisher.version == 1, "a publish that timed out publishes nothing"
        consumer.close()
        assert (await publisher.publish_async(filled_model(3.0), 3)).version == 3


async def test_plain_publish_on_a_running_loop_refuses_to_wait():
    with WeightPublisher("shm", slots=1, lock_timeout=30) as publisher:
        consumer = WeightConsumer()
        consumer.import_update(publisher.publish(filled_model(1.0), 1))
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="publish_async"):
            publisher.publish(filled_model(2.0), 2)
        assert time.monotonic() - started < 0.5, "it raised at once instead of blocking the loop"
        consumer.close()


async def test_a_large_host_copy_runs_off_the_loop():
    state = {f"w{i}": torch.full((8 * 1024 * 1024,), float(i)) for i in range(8)}  # 256 MiB
    with WeightPublisher("shm", slots=2) as publisher:
        await publisher.publish_async(state, 1)  # first touch of the slot's pages, not measured
        async with Heartbeat() as beat:
            manifest = await publisher.publish_async(state, 2)
        assert beat.worst_stall < MAX_GAP, f"the loop stalled during a 256 MiB copy: {beat}"
        consumer = WeightConsumer()
        tensors = consumer.import_update(manifest)
        assert all(bool((tensors[f"w{i}"] == float(i)).all()) for i in range(8))
        consumer.close()


async def test_a_cancelled_publish_gives_its_slot_back():
    state = {"w": torch.ones(16 * 1024 * 1024)}  # 64 MiB: copied on a worker thread
    with WeightPublisher("shm", slots=1) as publisher:
        task = asyncio.ensure_future(publisher.publish_async(state, 1))
        await asyncio.sleep(0)  # the copy has started on its thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert publisher.version is None and not publisher.unreleased
        manifest = await asyncio.wait_for(publisher.publish_async(state, 2), 10)
        assert manifest.version == 2
        consumer = WeightConsumer()
        assert bool((consumer.import_update(manifest)["w"] == 1.0).all())
        consumer.close()
    assert not glob.glob(f"{SHM_DIR}/{manifest.handle}")


async def test_a_cancellation_landing_after_the_copy_finished_is_still_the_callers():
    """The copy's future done, its waiter not yet resumed, then the cancel: the caller sees CancelledError."""
    from actors.weights._off_the_loop import awaited_to_the_end

    copy: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(awaited_to_the_end(copy))
    await asyncio.sleep(0)  # the waiter is suspended on the copy
    copy.set_result(7)  # done; the waiter is woken only on the loop's next turn
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    finished: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    finished.set_result(8)
    assert await awaited_to_the_end(finished) == 8


async def test_concurrent_publishes_of_one_publisher_are_refused():
    state = {"w": torch.ones(4 * 1024 * 1024)}
    with WeightPublisher("shm", slots=2) as publisher:
        first = asyncio.ensure_future(publisher.publish_async(state, 1))
        await asyncio.sleep(0)
        with pytest.raises(WeightSyncError, match="in progress"):
            await publisher.publish_async(state, 2)
        assert (await first).version == 1


async def test_a_cancellation_during_a_copy_that_then_fails_is_still_the_callers():
    """Cancelled while the copy runs, then the copy raises: the caller sees its CancelledError (before: the copy's
    error, and ``wait_for``'s timeout was lost)."""
    from actors.weights._off_the_loop import awaited_to_the_end

    copy: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(awaited_to_the_end(copy))
    await asyncio.sleep(0)  # the waiter is suspended on the copy
    waiter.cancel()
    await asyncio.sleep(0)  # it took the cancel and waits on for the copy
    assert not waiter.done()
    copy.set_exception(RuntimeError("the copy failed"))
    with pytest.raises(asyncio.CancelledError):
        await waiter


def test_a_publish_from_a_thread_while_another_runs_is_refused_not_committed_out_of_order():
    """A blocking publish() on one thread while another thread's runs: it was not marked in progress, so both
    passed the version check and committed in either order (the publisher's version could go back)."""
    publisher = WeightPublisher("shm", slots=2)
    writer = publisher._writer
    filling, go_on = threading.Event(), threading.Event()
    real_fill = writer.fill

    def held_fill(*args: Any, **kwargs: Any) -> Any:
        filling.set()
        assert go_on.wait(30)
        return real_fill(*args, **kwargs)

    writer.fill = held_fill  # type: ignore[method-assign]
    try:
        first = threading.Thread(target=publisher.publish, args=(filled_model(3.0), 3))
        first.start()
        assert filling.wait(30)
        writer.fill = real_fill  # type: ignore[method-assign]
        with pytest.raises(WeightSyncError, match="in progress"):
            publisher.publish(filled_model(4.0), 4)
        go_on.set()
        first.join(30)
        assert publisher.version == 3
        assert publisher.publish(filled_model(4.0), 4).version == 4 and publisher.version == 4
    finally:
        go_on.set()
        publisher.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_closing_the_publisher_during_a_copy_ends_that_publish_and_frees_the_slot_after_the_copy(transport):
    """close() while a publish's copy writes into a slot on a worker thread: the slot outlives the copy (it was
    unmapped under it: a segfault), then is freed; the publish raises, saying the publisher was closed."""
    state = {"w": torch.ones(32 * 1024 * 1024)}  # 128 MiB: copied on a worker thread
    before = set(glob.glob(f"{SHM_DIR}/actors-*"))
    publisher = WeightPublisher(transport, slots=1)
    task = asyncio.ensure_future(publisher.publish_async(state, 1))
    await asyncio.sleep(0)  # the copy has started on its thread
    publisher.close()
    with pytest.raises(WeightSyncError, match="closed"):
        await asyncio.wait_for(task, 30)
    assert publisher.version is None and not publisher.unreleased
    assert set(glob.glob(f"{SHM_DIR}/actors-*")) <= before, "the slot was not freed once the copy ended"
    with pytest.raises(WeightSyncError, match="closed"):
        await publisher.publish_async(state, 2)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_closing_the_publisher_from_another_thread_during_a_blocking_publish_ends_it_after_its_copy(transport):
    """As for publish_async: a blocking publish() on one thread, close() on another while it copies. The storage
    is freed once the copy ends (not under it) and the publish raises, committing nothing (before, it committed
    an update into freed storage and returned its manifest)."""
    before = set(glob.glob(f"{SHM_DIR}/actors-*"))
    publisher = WeightPublisher(transport, slots=1)
    copying, closed = threading.Event(), threading.Event()
    fill = publisher._writer.fill

    def slow_fill(*args: object) -> object:
        copying.set()
        assert closed.wait(30)
        return fill(*args)

    publisher._writer.fill = slow_fill  # type: ignore[method-assign]
    outcome: list[BaseException | object] = []

    def publish() -> None:
        try:
            outcome.append(publisher.publish(filled_model(1.0), 1))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=publish)
    thread.start()
    assert copying.wait(30)
    publisher.close()
    closed.set()
    thread.join(30)
    [result] = outcome
    assert isinstance(result, WeightSyncError) and "closed" in str(result), result
    assert publisher.version is None and not publisher.unreleased
    assert set(glob.glob(f"{SHM_DIR}/actors-*")) <= before, "the slot was not freed once the copy ended"


@pytest.mark.parametrize("during", ["fill", "commit"])
async def test_a_close_from_another_thread_during_a_small_async_publish_waits_for_it(during):
    """A publish_async under 1 MiB copies on the loop's thread; a close() from another thread (a signal or
    checkpoint thread) during that copy, or during the commit of any publish, freed the storage under it: a raw
    ``AttributeError``/``ValueError`` from the writer, or an unlock of a closed descriptor. The close now waits
    for the copy and commit, and the publish raises saying the publisher was closed."""
    before = set(glob.glob(f"{SHM_DIR}/actors-*"))
    publisher = WeightPublisher("shm", slots=1)
    writer = publisher._writer
    step = getattr(writer, during)

    def closing_first(*args: object) -> object:
        closer = threading.Thread(target=publisher.close)
        closer.start()
        closer.join(30)  # (it returns at once: the storage is freed when this publish ends)
        return step(*args)

    setattr(writer, during, closing_first)
    with pytest.raises(WeightSyncError, match="closed while it published version 1"):
        await publisher.publish_async(filled_model(1.0), 1)
    assert publisher.closed and publisher.version is None and not publisher.unreleased
    assert set(glob.glob(f"{SHM_DIR}/actors-*")) <= before, "the slot was freed once the publish ended"


async def test_an_async_import_checks_its_checksums_off_the_loop(monkeypatch):
    """The CRC pass reads every byte of the update (a GPU's copied back first): from 1 MiB it runs on a worker
    thread, as the copy does (before, on the loop's thread)."""
    import actors.weights._consumer as consumer_module

    threads: list[int] = []
    crc = consumer_module.checksum

    def recorded(tensor: torch.Tensor) -> int:
        threads.append(threading.get_ident())
        return crc(tensor)

    state = {"w": torch.ones(1024 * 1024)}  # 4 MiB
    with WeightPublisher("shm", slots=1, checksums=True) as publisher:
        manifest = await publisher.publish_async(state, 1)
        consumer = WeightConsumer()
        monkeypatch.setattr(consumer_module, "checksum", recorded)
        tensors = await consumer.import_update_async(manifest)
        assert bool((tensors["w"] == 1.0).all())
        assert threads and threading.get_ident() not in threads
        consumer.release(manifest.update_id)
        consumer.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_closing_the_publisher_ends_a_publish_waiting_for_a_slot_and_makes_none(transport):
    """A publish waiting for a consumer to free a slot: close() ends the wait at once, with no new slot made
    (the closed pool used to make one: a segment nothing would remove)."""
    before = set(glob.glob(f"{SHM_DIR}/actors-*"))
    publisher = WeightPublisher(transport, slots=1, lock_timeout=30)
    consumer = WeightConsumer()
    held = publisher.publish(filled_model(1.0), 1)
    if transport == "shm":
        consumer.import_update(held)  # the only slot is held by a reader
    else:
        publisher._writer._slots[0].sending += 1  # type: ignore[attr-defined]  # a reader is being sent it
    waiting = asyncio.ensure_future(publisher.publish_async(filled_model(2.0), 2))
    await asyncio.sleep(0)  # the publish found no free slot and polls for one
    assert not waiting.done()
    started = time.monotonic()
    publisher.close()
    with pytest.raises(WeightSyncError, match="closed"):
        await asyncio.wait_for(waiting, 10)
    assert time.monotonic() - started < 1.0, "the closed publisher's waiting publish ran on"
    consumer.close()
    assert set(glob.glob(f"{SHM_DIR}/actors-*")) <= before


class AwaitedRelease:
    """A reader whose blocking release must not be called: an event loop's installs await ``release_async``."""

    def __init__(self, reader: object) -> None:
        self.reader = reader
        self.awaited: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.reader, name)

    def release(self, update_id: str) -> None:
        raise AssertionError(f"update {update_id} was released by blocking on the event loop")

    async def release_async(self, update_id: str) -> None:
        self.awaited.append(update_id)
        self.reader.release(update_id)  # type: ignore[attr-defined]


def consumer_with(wrap: Callable[[Any], R]) -> tuple[WeightConsumer, Any, R]:
    """A consumer whose ``shm`` reader is ``wrap(reader)``; the reader itself too (to put back before closing)."""
    consumer = WeightConsumer()
    shm = consumer.reader("shm")
    wrapped = wrap(shm)
    consumer._readers["shm"] = wrapped  # type: ignore[assignment]
    return consumer, shm, wrapped


async def test_installs_on_an_event_loop_release_through_the_readers_awaited_release():
    """``install_newest_async`` (copying, or aliasing: the update its module viewed until now is released) and
    ``load_newest_async`` release with the reader's ``release_async`` where it has one: a ``cuda-ipc`` reader waits
    there for the GPU's reads of the slot without blocking the loop."""
    consumer, shm, awaited = consumer_with(AwaitedRelease)
    inbox = WeightInbox(consumer)
    model = filled_model(0.0)
    with WeightPublisher("shm", slots=3) as publisher:
        manifests = []
        for version, install in [(1, "copy"), (2, "alias"), (3, "alias"), (4, "load")]:
            manifests.append(publisher.publish(filled_model(float(version)), version))
            inbox.put(manifests[-1])
            if install == "load":
                got = await inbox.load_newest_async(lambda tensors: None)
            else:  # an aliasing install holds its update; the next one releases it
                got = await inbox.install_newest_async(model, alias=install == "alias")
            assert got is manifests[-1]
        # 1 after its copy; 2 when 3 replaced it in the module; 4 after its load; 3 stays held: the module views it
        assert awaited.awaited == [manifests[i].update_id for i in (0, 1, 3)]
        assert consumer.holds_alias(manifests[2].update_id)
        consumer._readers["shm"] = shm  # type: ignore[assignment]
        consumer.close()


class GatedRelease(AwaitedRelease):
    """A reader whose awaited release waits for ``gate`` (a GPU whose reads have not finished yet)."""

    def __init__(self, reader: object) -> None:
        super().__init__(reader)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def release_async(self, update_id: str) -> None:
        self.entered.set()
        await self.gate.wait()
        await super().release_async(update_id)


async def test_a_release_cut_short_is_owed_and_made_by_the_next_one():
    """An install cancelled while it released the update its model viewed until then (an actor stopping, a
    ``wait_for``) leaves that update held; the consumer's next release makes it, so no slot stays held for good."""
    consumer, shm, gated = consumer_with(GatedRelease)
    inbox = WeightInbox(consumer)
    model = filled_model(0.0)
    with WeightPublisher("shm", slots=4) as publisher:
        manifests = [publisher.publish(filled_model(float(v)), v) for v in (1, 2, 3)]
        inbox.put(manifests[0])
        gated.gate.set()
        assert await inbox.install_newest_async(model, alias=True) is manifests[0]
        gated.gate.clear()
        inbox.put(manifests[1])
        installing = asyncio.ensure_future(inbox.install_newest_async(model, alias=True))
        await asyncio.wait_for(gated.entered.wait(), 10)
        installing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await installing
        assert consumer.state(manifests[0].update_id) == "acknowledged", "the cut-short release left it held"
        with pytest.raises(LifecycleError, match="owed"):  # (before: a KeyError, its tensors forgotten)
            consumer.import_update(manifests[0])
        gated.gate.set()
        inbox.put(manifests[2])
        assert await inbox.install_newest_async(model, alias=True) is manifests[2]
        assert consumer.state(manifests[0].update_id) == "released", "the owed release was made"
        assert consumer.state(manifests[1].update_id) == "released"
        assert all(bool((p == 3.0).all()) for p in model.parameters())
        consumer._readers["shm"] = shm  # type: ignore[assignment]
        consumer.close()


async def test_closing_an_inbox_on_an_event_loop_awaits_the_release_of_what_its_model_views():
    """An actor's ``__cleanup__`` closes its inbox on its loop: the aliased update (a ``cuda-ipc`` slot, whose
    release waits for the GPU's reads) is released through the awaited release, never the blocking one."""
    consumer, _shm, awaited = consumer_with(AwaitedRelease)
    inbox = WeightInbox(consumer)
    with WeightPublisher("shm", slots=3) as publisher:
        first = publisher.publish(filled_model(1.0), 1)
        inbox.put(first)
        assert await inbox.install_newest_async(filled_model(0.0), alias=True) is first
        inbox.put(publisher.publish(filled_model(2.0), 2))  # queued, never installed
        await inbox.close_async()
        assert awaited.awaited[0] == first.update_id
        assert consumer.state(first.update_id) == "released"
