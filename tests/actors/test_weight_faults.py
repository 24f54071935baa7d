"""Bad manifests and dead publishers: a clear error, and the model keeps its last good weights."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support import WeightSource, filled_model

from actors import (
    CallTimeout,
    ManifestError,
    PublisherDied,
    StaleUpdateError,
    WeightConsumer,
    WeightInbox,
    WeightPublisher,
    WeightSyncError,
)
from actors.tensors.cuda_ipc import IPC_HANDLE_BYTES, parse_handle
from actors.weights import SpecTable
from actors.weights._consumer import PublisherWatch


def all_equal(model: torch.nn.Module, value: float) -> bool:
    return all(bool((p == value).all()) for p in model.state_dict().values())


@pytest.fixture
def published():
    with WeightPublisher("shm", slots=3) as publisher:
        yield publisher.publish(filled_model(1.0), 1)


def spec_changed(manifest, **changes):
    first = dataclasses.replace(manifest.tensors[0], **changes)
    return dataclasses.replace(manifest, table=SpecTable.of((first, *manifest.tensors[1:])))


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (lambda: filled_model(5.0, width=32), "does not fit|is float32"),  # other shapes
        (lambda: filled_model(5.0).double(), "is float32.*float64"),  # other dtype
        (lambda: torch.nn.Linear(64, 64), "missing|unexpected"),  # other names
    ],
)
def test_a_manifest_that_does_not_fit_the_model_installs_nothing(published, target, match):
    model = target()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    consumer = WeightConsumer()
    with pytest.raises(ManifestError, match=match):
        consumer.install(published, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing was written"
    assert consumer.state(published.update_id) is None, "a refused manifest does not consume the update"
    fitting = filled_model(5.0)
    consumer.install(published, fitting)
    assert all_equal(fitting, 1.0) and consumer.state(published.update_id) == "acknowledged"
    consumer.close()


@pytest.mark.parametrize(
    "refused",
    [
        lambda m: dataclasses.replace(m, handle=42),  # a malformed handle
        lambda m: dataclasses.replace(m, handle="../../etc/passwd"),
        lambda m: spec_changed(m, nbytes=4),  # specs the slot cannot hold
        lambda m: spec_changed(m, dtype="float64"),  # specs that do not fit the model
    ],
    ids=["int-handle", "path-handle", "short-spec", "other-dtype"],
)
def test_a_refused_manifest_does_not_consume_the_update(published, refused):
    """After a broken manifest of an update is refused, a good manifest of the same update still installs."""
    inbox = WeightInbox()
    model = filled_model(5.0)
    inbox.put(refused(published))
    with pytest.raises(ManifestError):
        inbox.install_newest(model)
    assert all_equal(model, 5.0) and inbox.consumer.state(published.update_id) is None
    inbox.put(refused(published))  # refused again: the same error, not "already released"
    with pytest.raises(ManifestError):
        inbox.install_newest(model)
    inbox.put(published)
    assert inbox.install_newest(model) is published
    assert all_equal(model, 1.0)
    inbox.close()


def test_installing_something_that_is_not_a_manifest_is_a_type_error():
    consumer = WeightConsumer()
    with pytest.raises(TypeError, match="expected a WeightManifest, got str"):
        consumer.install("not a manifest", filled_model(5.0))  # type: ignore[arg-type]
    consumer.close()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"update_id": ["x"]}, r"update_id must be a string of 1-256 characters, not \['x'\]"),
        ({"update_id": 5}, "update_id must be a string"),
        ({"update_id": ""}, "update_id must be a string"),
        ({"version": "7"}, "version must be an int, not '7'"),
        ({"publisher_pid": 0}, "publisher_pid must be a positive int, not 0"),
        (
            {"publisher_pid": -1, "metadata": []},
            "publisher_pid must be a positive int, not -1; metadata must be a dict",
        ),
        ({"transport": None, "publisher_host": 3}, "transport must be a string.*publisher_host must be a string"),
    ],
)
def test_a_manifest_whose_own_fields_are_wrong_is_refused_and_poisons_nothing(published, fields, match):
    """A peer's manifest with a field of the wrong type: refused where it arrives, with the field named; an inbox
    keeps working (it never queued it) and a consumer still installs the good update afterwards."""
    bad = dataclasses.replace(published, **fields)
    model = filled_model(5.0)
    consumer = WeightConsumer()
    inbox = WeightInbox(consumer)
    with pytest.raises(ManifestError, match=match):
        inbox.put(bad)
    with pytest.raises(ManifestError, match=match):
        consumer.install(bad, model)
    assert len(inbox) == 0 and all_equal(model, 5.0)
    inbox.put(published)
    assert inbox.install_newest(model) is published and all_equal(model, 1.0)
    consumer.close()


def test_where_pidfd_open_is_refused_a_publisher_is_asked_whether_it_exists(monkeypatch):
    """A sandbox that refuses pidfd_open (seccomp) is not a dead publisher: its pid is looked up instead."""
    from actors.weights._consumer import PublisherWatch

    def refused(pid: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "pidfd_open", refused)
    watch = PublisherWatch()
    assert watch.alive(os.getppid())
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: the pid names nothing now
    assert not watch.alive(child.pid)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"nbytes": 4}, "bytes cannot hold"),
        ({"offset": 1 << 40}, "outside its slot"),
        ({"offset": 3}, "outside its slot"),
        ({"stride": (1, 1)}, "contiguous stride"),
        ({"checksum": "x"}, "checksum"),
    ],
)
def test_a_malformed_spec_is_refused_before_a_byte_is_read(published, changes, match):
    model = filled_model(5.0)
    consumer = WeightConsumer()
    with pytest.raises(ManifestError, match=match):
        consumer.install(spec_changed(published, **changes), model)
    assert all_equal(model, 5.0)
    consumer.close()


def test_a_size_that_is_not_an_int_is_refused_even_when_it_equals_the_right_one(published):
    model = filled_model(5.0)
    consumer = WeightConsumer()
    with pytest.raises(ManifestError, match="bytes cannot hold"):
        consumer.install(spec_changed(published, nbytes=float(published.tensors[0].nbytes)), model)
    assert all_equal(model, 5.0)
    consumer.close()


def test_bytes_of_one_dtype_described_as_another_are_refused(published):
    model = filled_model(5.0).double()
    lying = dataclasses.replace(
        published, table=SpecTable.of([dataclasses.replace(spec, dtype="float64") for spec in published.tensors])
    )
    consumer = WeightConsumer()
    with pytest.raises(ManifestError, match="bytes cannot hold"):
        consumer.install(lying, model)
    assert all_equal(model, 5.0)
    consumer.close()


@pytest.mark.parametrize(
    ("handle", "error"),
    [
        (42, ManifestError),
        ("../../etc/passwd", ManifestError),
        ("actors-no-such-segment", StaleUpdateError),
    ],
)
def test_a_wrong_handle_is_refused(published, handle, error):
    model = filled_model(5.0)
    consumer = WeightConsumer()
    with pytest.raises(error):
        consumer.install(dataclasses.replace(published, handle=handle), model)
    assert all_equal(model, 5.0)
    consumer.close()


def test_a_handle_naming_another_update_slot_is_stale():
    with WeightPublisher("shm", slots=3) as publisher:
        first = publisher.publish(filled_model(1.0), 1)
        second = publisher.publish(filled_model(2.0), 2)
        model = filled_model(5.0)
        consumer = WeightConsumer()
        with pytest.raises(StaleUpdateError):
            consumer.install(dataclasses.replace(first, handle=second.handle), model)
        assert all_equal(model, 5.0)
        consumer.close()


def good_cuda_handle() -> dict:
    return {
        "slot": "actors-x-w1-g0",
        "capacity": 128,
        "device": "8d0c-uuid",
        "pid": 1234,
        "mem": bytes(66),
        "size": 256,
        "offset": 0,
        "ready": bytes(IPC_HANDLE_BYTES),
        "ready_sync": False,
        "event": bytes(IPC_HANDLE_BYTES),
    }


@pytest.mark.parametrize(
    "change",
    [
        {"mem": b"x"},
        {"event": None},
        {"event": bytes(65)},
        {"ready": None},
        {"capacity": 512},
        {"offset": -1},
        {"slot": "/dev/shm/x"},
        {"extra": 1},
        {"ready": b"xx"},
    ],
)
def test_malformed_cuda_ipc_handles_are_refused_without_a_gpu(change):
    assert parse_handle(good_cuda_handle()).capacity == 128
    with pytest.raises(ManifestError):
        parse_handle({**good_cuda_handle(), **change})
    with pytest.raises(ManifestError):
        parse_handle([1, 2, 3])


@pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
async def test_a_dead_publisher_ends_the_wait_and_the_model_keeps_its_weights(procs, alias):
    source = procs.spawn("source", WeightSource).slice(procs=0)
    first = await source.publish.call_one(1)
    second = await source.publish.call_one(2)
    inbox = WeightInbox()
    model = filled_model(0.0)
    inbox.put(first)
    assert inbox.install_newest(model, alias=alias) is first
    assert all_equal(model, 1.0)
    os.kill(first.publisher_pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(PublisherDied, match=f"pid {first.publisher_pid}"):
        await inbox.wait(30)
    assert time.monotonic() - started < 1.0, "the death is seen at once, not after the timeout"
    assert all_equal(model, 1.0), "the last good weights stay"
    inbox.put(second)  # published before the death, delivered after it
    with pytest.raises(PublisherDied):
        inbox.install_newest(model, alias=alias)
    assert all_equal(model, 1.0)
    assert inbox.consumer.installed_version == 1
    inbox.close()


async def test_waiting_for_an_update_still_times_out_while_the_publisher_lives(procs):
    source = procs.spawn("source", WeightSource).slice(procs=0)
    inbox = WeightInbox()
    inbox.put(await source.publish.call_one(1))
    inbox.install_newest(filled_model(0.0))
    with pytest.raises(CallTimeout):
        await inbox.wait(0.2)
    inbox.close()


async def test_a_cancel_that_lands_while_the_inbox_wait_unwinds_is_not_swallowed(published):
    """An update arrives; as the wait's watch of the publisher's death unwinds, the waiting task is cancelled (an
    actor's stop). The cancel stands (before, it was suppressed with the watch's own, and the task ran on to
    install after its actor's cleanup had closed the consumer)."""
    started, unwinding, gate = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class SlowToUnwind:
        async def death(self, pid: int) -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                unwinding.set()
                await gate.wait()
                raise

    inbox = WeightInbox()
    watch, inbox.consumer.publishers = inbox.consumer.publishers, SlowToUnwind()  # type: ignore[assignment]
    inbox.publisher = os.getppid()  # (a live publisher on this host: its death is watched)
    try:
        waiting = asyncio.ensure_future(inbox.wait(30))
        await asyncio.wait_for(started.wait(), 30)
        inbox.put(published)
        await asyncio.wait_for(unwinding.wait(), 30)
        waiting.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 30)
    finally:
        inbox.consumer.publishers = watch
        inbox.close()


@pytest.mark.parametrize("watched", [True, False], ids=["publisher-watched", "no-publisher-yet"])
async def test_closing_the_inbox_ends_a_wait_with_that_reason(published, watched):
    """A task waits for an update and the inbox is closed (an actor's cleanup): the wait ends at once with a
    ``WeightSyncError`` saying so (before, the closed watch of the publisher read as its death, ``PublisherDied``
    of a live trainer; or, with no publisher known yet, the wait slept to its timeout)."""
    inbox = WeightInbox()
    if watched:
        inbox.put(published)
        inbox.install_newest(filled_model(0.0))  # (the publisher of what is installed is watched)
    waiting = asyncio.ensure_future(inbox.wait(30))
    await asyncio.sleep(0)  # (one turn: the wait is under way)
    started = time.monotonic()
    inbox.close()
    with pytest.raises(WeightSyncError, match="closed") as raised:
        await asyncio.wait_for(waiting, 30)
    assert not isinstance(raised.value, (PublisherDied, CallTimeout))
    assert time.monotonic() - started < 5, "at once, not at the wait's timeout"


@pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
def test_an_installed_update_installs_into_a_second_model_and_a_misfit_one_says_why(published, alias):
    """One update installed into two models (replicas in one process, or an install retried): the second gets
    the update too (before, it was written and then ``LifecycleError``: acknowledged twice); a model it does not
    fit gets the ``ManifestError`` (before, hidden behind a ``LifecycleError`` from rejecting an installed update),
    and the update stays installed."""
    consumer = WeightConsumer()
    first, second = filled_model(0.0), filled_model(0.0)
    consumer.install(published, first, alias=alias)
    consumer.install(published, second, alias=alias)
    assert all_equal(first, 1.0) and all_equal(second, 1.0)
    assert consumer.state(published.update_id) == "acknowledged"
    consumer.install(published, filled_model(0.0), alias=False)  # a copy of it, into a third
    assert consumer.holds_alias(published.update_id) is alias, "a module that views the update still does"
    with pytest.raises(ManifestError, match="the model's is float32"):
        consumer.install(published, filled_model(0.0, width=32))
    assert consumer.state(published.update_id) == "acknowledged"
    assert consumer.installed_version == 1
    consumer.close()


def test_a_closed_pool_keeps_a_held_slots_outside_storage_until_its_last_reader_lets_go():
    """cuda-ipc's case on the CPU: a slot's payload lives outside its segment (a GPU buffer). Closing the pool
    while a consumer still holds (aliases) one must not free that payload under it: the unheld slot is freed at
    once, the held one when its reader releases it; no slot's name outlives the close."""
    import threading

    from harness import wait_for

    from actors.tensors._slots import SHM_DIR, SlotHolds, SlotPool

    freed: list[str] = []
    pool = SlotPool(
        2, kind="t", payload_in_segment=False, allocate=lambda slot: None, free=lambda s: freed.append(s.name)
    )
    slots = []
    for version in (1, 2):
        slot = pool.try_acquire(64)
        assert slot is not None
        pool.commit(slot, f"u{version}", version, 64)
        slots.append(slot)
    holds = SlotHolds(map_payload=False)
    holds.hold(slots[0].name, "u1", 1)  # a consumer views update 1
    pool.close()
    assert freed == [slots[1].name], "only the slot nobody holds is freed at once"
    assert not any(os.path.exists(os.path.join(SHM_DIR, slot.name)) for slot in slots)
    holds.unhold(slots[0].name)
    assert wait_for(lambda: freed == [slots[1].name, slots[0].name], timeout=10)
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("actors-weights-held")], 10)
    holds.close()


def test_a_closed_pools_slot_is_stale_to_a_reader_that_kept_it_mapped():
    """A reader keeps a segment it held mapped (cuda-ipc keeps its opened handle too). Closing the pool unlinked
    the segment and freed its payload but left its header saying "ready": the reader's next hold of that update
    passed every check and viewed storage the writer's allocator may since have handed to something else."""
    from actors.tensors._slots import SlotHolds, SlotPool

    freed: list[str] = []
    pool = SlotPool(
        1, kind="t", payload_in_segment=False, allocate=lambda slot: None, free=lambda s: freed.append(s.name)
    )
    slot = pool.try_acquire(64)
    assert slot is not None
    pool.commit(slot, "u1", 1, 64)
    holds = SlotHolds(map_payload=False)
    holds.hold(slot.name, "u1", 1)
    holds.unhold(slot.name)  # still mapped here, held by nobody
    pool.close()
    assert freed == [slot.name]
    with pytest.raises(StaleUpdateError):
        holds.hold(slot.name, "u1", 1)
    holds.close()


def test_a_pool_closed_while_a_publish_makes_a_slot_leaves_no_slot_behind():
    """``close()`` from another thread while a publish makes a slot (a GPU buffer takes milliseconds to allocate):
    the slot was added after the close had removed every slot, and nothing ever removed it (a segment in /dev/shm
    and a GPU buffer, for good)."""
    from actors.tensors._slots import SHM_DIR, SlotPool

    freed: list[str] = []

    def allocate(slot: object) -> None:
        pool.close()  # (what the other thread does at that moment)

    pool = SlotPool(2, kind="t", payload_in_segment=False, allocate=allocate, free=lambda s: freed.append(s.name))
    with pytest.raises(WeightSyncError, match="closed"):
        pool.try_acquire(64)
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(pool._prefix)]
    assert len(freed) == 1 and pool.names == []


async def test_a_full_dev_shm_is_a_weight_sync_error_not_a_sigbus(monkeypatch):
    """On tmpfs ``ftruncate`` makes a sparse file and always succeeds: an update larger than what ``/dev/shm`` has
    free (Docker's default is 64 MiB) faulted at its first write past the quota, and SIGBUS killed the trainer.
    The payload's memory is reserved before the copy (off the loop from 1 MiB): a full ``/dev/shm`` is a
    ``WeightSyncError`` saying so, and a publish once there is room again succeeds."""
    import errno

    from actors.tensors import _slots

    reserve = _slots.os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        if length > _slots.HEADER_BYTES:  # (the header's page fits; the payload does not)
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, length)

    big = {"w": torch.full((1024 * 1024,), 2.0)}  # 4 MiB: copied on a worker thread
    monkeypatch.setattr(_slots.os, "posix_fallocate", full)
    with WeightPublisher("shm", slots=2) as publisher:
        with pytest.raises(WeightSyncError, match=r"/dev/shm has no room for a .*-byte weight slot"):
            publisher.publish(filled_model(1.0), 1)
        with pytest.raises(WeightSyncError, match=r"/dev/shm has no room for a .*-byte weight slot"):
            await publisher.publish_async(big, 1)
        assert publisher.version is None and not publisher.unreleased
        monkeypatch.setattr(_slots.os, "posix_fallocate", reserve)  # room again
        manifest = await publisher.publish_async(big, 1)
        consumer = WeightConsumer()
        assert bool((consumer.import_update(manifest)["w"] == 2.0).all())
        consumer.close()
    assert not [n for n in os.listdir(_slots.SHM_DIR) if n.startswith(_slots.segment_prefix())]


def test_a_full_dev_shm_reuses_the_slots_that_hold_room_and_the_pool_grows_again_once_there_is_room(monkeypatch):
    """A 64 MiB ``/dev/shm``, a 40 MiB model, two slots: the second slot's reservation fails. That slot stayed in
    the pool, released and unreserved, so every later publish took it first and failed again, though the first
    slot (whose room it lacked) was free to rewrite. It is removed; a new slot is made only while ``/dev/shm`` has
    room for it, so the next publish rewrites the first slot, and the pool grows once there is room again."""
    import errno
    from types import SimpleNamespace

    from actors.tensors import _slots

    reserve, statvfs = _slots.os.posix_fallocate, _slots.os.statvfs
    reserved: list[int] = []

    def room_for_one(fd: int, offset: int, length: int) -> None:
        if length > _slots.HEADER_BYTES:
            if reserved and fd not in reserved:  # (the first slot's payload took the room)
                raise OSError(errno.ENOSPC, "No space left on device")
            reserved.append(fd)
        reserve(fd, offset, length)

    monkeypatch.setattr(_slots.os, "posix_fallocate", room_for_one)
    with WeightPublisher("shm", slots=2, lock_timeout=0.2) as publisher:
        first = publisher.publish(filled_model(1.0), 1)
        with pytest.raises(WeightSyncError, match="no room"):
            publisher.publish(filled_model(2.0), 2)  # its new slot's reservation fails (the room looked free)
        assert publisher._writer.segment_names == [first.handle], "the slot that could not be reserved is gone"
        monkeypatch.setattr(
            _slots.os, "statvfs", lambda path: SimpleNamespace(f_blocks=16384, f_bavail=0, f_frsize=4096)
        )
        third = publisher.publish(filled_model(3.0), 3)  # no room for a new slot: the first one, rewritten
        assert third.handle == first.handle
        consumer = WeightConsumer()
        model = filled_model(0.0)
        consumer.install(third, model)  # its only slot held until released, and no room for another
        with pytest.raises(WeightSyncError, match=r"the 1 weight slot\(s\) /dev/shm had room for \(of 2\)"):
            publisher.publish(filled_model(9.0), 9)  # (before: "all 2 weight slots stayed held", though one existed)
        consumer.release(third.update_id)
        assert all_equal(model, 3.0)
        monkeypatch.setattr(_slots.os, "statvfs", statvfs)  # room again
        monkeypatch.setattr(_slots.os, "posix_fallocate", reserve)
        fourth = publisher.publish(filled_model(4.0), 4)
        assert fourth.handle != first.handle and len(publisher._writer.segment_names) == 2, "it grows again"
        consumer.close()
    unlimited = SimpleNamespace(f_blocks=0, f_bavail=0, f_frsize=4096)  # a tmpfs with no size limit says 0 free
    monkeypatch.setattr(_slots.os, "statvfs", lambda path: unlimited)
    with WeightPublisher("shm", slots=2) as publisher:
        consumer = WeightConsumer()
        consumer.import_update(publisher.publish(filled_model(1.0), 1))  # its slot held
        publisher.publish(filled_model(2.0), 2)  # a second slot, not a wait for the first
        assert len(publisher._writer.segment_names) == 2
        consumer.close()


def test_a_slots_views_are_made_once_per_layout_and_found_by_the_same_specs_without_hashing_them():
    from actors.tensors import TensorSpec
    from actors.tensors._slot_views import SlotViews

    made: list[str] = []

    def make(spec: TensorSpec) -> torch.Tensor:
        made.append(spec.name)
        return torch.zeros(spec.shape)

    def layout(*names: str) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(name, "float32", (2,), (1,), 8, 8 * i) for i, name in enumerate(names))

    views, specs = SlotViews(), layout("a", "b")
    first = views.of(specs, make)
    assert views.of(specs, make) is first and views.of(layout("a", "b"), make) is first, "an equal layout is found"
    assert made == ["a", "b"]
    other = views.of(layout("c"), make)
    assert made == ["a", "b", "c"] and views.of(specs, make) is first and views.of(layout("c"), make) is other
    checked: list[int] = []
    views.of(layout("d"), make, lambda: checked.append(1))
    assert checked == [1], "a layout the slot has not seen is checked"
    views.clear()
    assert views.of(specs, make) is not first, "cleared views are made again"


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_publisher_watch_works_with_descriptors_numbered_past_1024():
    """``select.select`` refuses a descriptor numbered 1024 or more, common beside torch, vLLM and many sockets:
    every install would then fail with ``filedescriptor out of range``."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files; the test needs 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    opened = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    child = _sleeper()
    watch = PublisherWatch()
    try:
        assert watch.alive(child.pid)
        assert watch._fds[child.pid] >= 1024
        child.kill()
        child.wait()
        assert not watch.alive(child.pid)
    finally:
        watch.close()
        for fd in opened:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_death_awaited_by_two_tasks_wakes_both_even_when_asked_about_meanwhile():
    """A wait registers the pid's fd with the loop; a check of the same pid meanwhile (another install) saw it
    readable and closed it under the wait, which then slept to its timeout; a second waiter replaced the first's."""
    child = _sleeper()
    watch = PublisherWatch()
    try:
        assert watch.alive(child.pid)
        waits = [asyncio.ensure_future(watch.death(child.pid)) for _ in range(2)]
        await asyncio.sleep(0)  # (one turn: both waits register)
        child.kill()
        child.wait()
        assert not watch.alive(child.pid)
        await asyncio.wait_for(asyncio.gather(*waits), 5)
        assert child.pid not in watch._fds, "the last waiter closed the fd"
        await asyncio.wait_for(watch.death(child.pid), 5)  # a dead pid: at once
    finally:
        child.kill()
        child.wait()
        watch.close()


def test_a_cuda_ipc_release_interrupted_in_its_wait_for_the_gpu_stays_owed(monkeypatch):
    """A synchronous cuda-ipc release waits for this process's GPU reads of the slot before it lets go; interrupted
    there (Ctrl-C, a device error), it had already forgotten the update: the retry the consumer owes found nothing
    to release and the slot stayed locked until the reader closed (a one-slot publisher then waited 30 s and
    failed each publish). The update stays held, and the next release lets it go."""
    from types import SimpleNamespace

    from actors.tensors.cuda_ipc import CudaIpcReader

    unheld: list[str] = []
    reader = object.__new__(CudaIpcReader)  # (its parts, without a GPU: only the release is under test)
    reader._holds = SimpleNamespace(unhold=unheld.append)  # type: ignore[assignment]
    reader._open = {"slot-0": SimpleNamespace(device=0)}  # type: ignore[dict-item]
    reader._held = {"update-1": "slot-0"}

    class Stream:
        def __init__(self, interrupt: bool) -> None:
            self.interrupt = interrupt

        def synchronize(self) -> None:
            if self.interrupt:
                raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(interrupt=True))
    with pytest.raises(KeyboardInterrupt):
        reader.release("update-1")
    assert reader._held == {"update-1": "slot-0"} and unheld == []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream(interrupt=False))
    reader.release("update-1")
    assert reader._held == {} and unheld == ["slot-0"]


@pytest.mark.parametrize("where", ["lock_timeout", "publish", "publish_async"])
async def test_a_wait_for_a_slot_that_is_not_a_finite_number_of_seconds_is_refused(where):
    """``lock_timeout=nan`` (or a publish's ``timeout=nan``) made a deadline that never passes: with every slot held
    the publish polled for good. It is a ``ValueError`` naming the value."""
    nan = float("nan")
    if where == "lock_timeout":
        with pytest.raises(ValueError, match="lock_timeout is a finite number of seconds, 0 or more, not nan"):
            WeightPublisher("shm", lock_timeout=nan)
        with pytest.raises(ValueError, match="lock_timeout is a finite number"):
            WeightPublisher("tcp", lock_timeout=-1.0)
        return
    with WeightPublisher("shm", slots=1) as publisher:
        consumer = WeightConsumer()
        consumer.import_update(publisher.publish(filled_model(1.0), 1))  # its one slot held
        with pytest.raises(ValueError, match="timeout is a finite number of seconds, 0 or more, not nan"):
            if where == "publish":
                await asyncio.to_thread(publisher.publish, filled_model(2.0), 2, timeout=nan)
            else:
                await publisher.publish_async(filled_model(2.0), 2, timeout=nan)
        consumer.close()


def test_a_killed_publisher_without_a_runtime_leaves_segments_a_later_session_removes():
    """A process with no runtime (initial weights published before any spawn) publishes under a session of its
    own, which no forkserver tears down: ``kill -9`` left its segments in ``/dev/shm`` for good. It holds a
    liveness lock on a marker while it has a pool; a session's start removes the segments of a marker nobody
    holds, and leaves a live one's alone (a pid alone could be a live process of another pid namespace)."""
    from actors._shared._segments import SHM_DIR, sweep_solo_segments

    publisher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch\n"
            "from actors import WeightPublisher\n"
            "p = WeightPublisher('shm')\n"
            "print(p.publish({'w': torch.ones(4)}, 1).handle, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        handle = publisher.stdout.readline().strip()  # type: ignore[union-attr]
        session = f"actors-solo{publisher.pid}"
        assert handle.startswith(f"{session}-w{publisher.pid}-")
        assert session not in sweep_solo_segments() and os.path.exists(os.path.join(SHM_DIR, handle)), "alive"
    finally:
        publisher.kill()
        publisher.wait(30)
    assert os.path.exists(os.path.join(SHM_DIR, handle)), "killed: nobody removed its segment"
    assert session in sweep_solo_segments()
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(session)], "segments and marker gone"


def test_a_publisher_without_a_runtime_leaves_no_marker_once_closed(monkeypatch):
    from actors._shared._segments import SHM_DIR
    from actors.tensors import _slots

    monkeypatch.setattr(_slots, "current_runtime", lambda: None)
    marker = os.path.join(SHM_DIR, f"actors-solo{os.getpid()}.u{os.getuid()}.live")
    first, second = WeightPublisher("shm"), WeightPublisher("shm")
    assert os.path.exists(marker)
    first.close()
    assert os.path.exists(marker), "the other pool still holds it"
    second.close()
    assert not os.path.exists(marker)


def test_a_publisher_refused_for_its_lock_timeout_leaves_no_marker_or_descriptor(monkeypatch):
    """Without a runtime a slot pool takes this process's solo marker (a locked descriptor) as it is made; a writer
    then refused for its ``lock_timeout`` left the pool unclosed: its descriptor and lock lived with the process,
    and the marker stayed after every other pool closed."""
    from actors._shared._segments import SHM_DIR
    from actors.tensors import _slots

    monkeypatch.setattr(_slots, "current_runtime", lambda: None)
    marker = os.path.join(SHM_DIR, f"actors-solo{os.getpid()}.u{os.getuid()}.live")
    descriptors = len(os.listdir("/proc/self/fd"))
    for bad in (float("nan"), -1.0, "5"):
        with pytest.raises(ValueError, match="lock_timeout is a finite number"):
            WeightPublisher("shm", lock_timeout=bad)
    assert not os.path.exists(marker)
    assert len(os.listdir("/proc/self/fd")) == descriptors


@pytest.mark.parametrize("bad_is", ["older", "newer"])
async def test_an_update_of_an_unusable_transport_blocks_no_later_install_on_a_loop(bad_is):
    """``install_newest`` on an event loop (shm updates only) first asked each queued manifest's reader whether it
    fetches over the network: building the reader of an unknown transport (or of cuda-ipc without a GPU) raised
    there, before anything was taken off the queue, so every later call raised the same and no update behind it
    was ever installed. The bad one is now refused as any other failure of its own, taken off the queue."""
    with WeightPublisher("shm", slots=3) as publisher:
        first = publisher.publish(filled_model(1.0), 1)
        second = publisher.publish(filled_model(2.0), 2)
        bad, good = (first, second) if bad_is == "older" else (second, first)
        inbox = WeightInbox()
        model = filled_model(5.0)
        inbox.put(dataclasses.replace(bad, transport="carrier-pigeon"))
        inbox.put(good)
        if bad_is == "older":  # the newest installs; the older one is let go
            assert inbox.install_newest(model) is good and all_equal(model, 2.0)
        else:  # the newest fails, naming why, as any failed install (the older ones go); a later update installs
            with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
                inbox.install_newest(model)
            assert len(inbox) == 0 and all_equal(model, 5.0)
            later = publisher.publish(filled_model(3.0), 3)
            inbox.put(later)
            assert inbox.install_newest(model) is later and all_equal(model, 3.0)
        assert len(inbox) == 0
        await inbox.close_async()


def test_a_malformed_table_equal_to_a_sound_one_poisons_no_later_update(published):
    """Spec tables are remembered by equality, which holds across number types: a peer's table with ``16.0`` for
    ``16`` was remembered, refused, and then given back for every sound table equal to it, refusing each update of
    that layout until a table that compared otherwise came."""
    model = filled_model(5.0)
    consumer = WeightConsumer()
    bad = spec_changed(published, nbytes=float(published.tensors[0].nbytes))
    with pytest.raises(ManifestError, match="bytes cannot hold"):
        consumer.install(bad, model)
    consumer.install(published, model)
    assert all_equal(model, 1.0) and consumer.state(published.update_id) == "acknowledged"
    consumer.close()


async def test_closing_a_consumer_on_a_loop_after_a_release_cut_short_waits_for_the_gpu_off_the_loop():
    """``close_async`` whose ``cuda-ipc`` release was cut short (the GPU's reads late, or the close cancelled) kept
    that update held, and the readers' close then released it the blocking way: a GPU synchronize on the loop's
    thread, for as long as the GPU took (for good on a hung one). That close now runs on a worker thread."""
    import threading

    loop_thread = threading.get_ident()

    class LateGpu:
        """A cuda-ipc reader whose GPU reads of ``u1`` never finish in time."""

        def __init__(self) -> None:
            self.closed_on: int | None = None

        def read(self, *args: object) -> dict:
            raise AssertionError("not read here")

        def release(self, update_id: str) -> None:
            raise AssertionError("a blocking release")

        async def release_async(self, update_id: str) -> None:
            raise WeightSyncError("this process's GPU reads of a weight slot did not finish within 120s")

        def close(self) -> None:
            self.closed_on = threading.get_ident()

    consumer = WeightConsumer()
    late = LateGpu()
    consumer._readers["cuda-ipc"] = late  # type: ignore[assignment]
    consumer._state["u1"] = "imported"
    await asyncio.wait_for(consumer.close_async(), 10)
    assert late.closed_on is not None and late.closed_on != loop_thread, "the blocking close ran on the loop"
    assert not consumer._readers


def test_a_blocking_close_interrupted_in_a_release_still_closes_the_readers():
    """A Ctrl-C in ``close()``'s wait for a release skipped closing the readers (their mappings, the pidfds)."""

    class Interrupted:
        closed = False

        def read(self, *args: object) -> dict:
            raise AssertionError("not read here")

        def release(self, update_id: str) -> None:
            raise KeyboardInterrupt

        def close(self) -> None:
            self.closed = True

    consumer = WeightConsumer()
    reader = Interrupted()
    consumer._readers["cuda-ipc"] = reader  # type: ignore[assignment]
    consumer._state["u1"] = "imported"
    with pytest.raises(KeyboardInterrupt):
        consumer.close()
    assert reader.closed and not consumer._readers
