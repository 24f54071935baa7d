"""Weight sync: manifests, lifecycle rules, shm slots, and installs across processes."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import glob
import os
import signal
import struct

import pytest
import torch
from harness import actor_pids, run_python, wait_for
from support import ShardedSource, WeightSink, WeightSource, filled_model, models_equal, seeded_model

from actors import (
    ChecksumError,
    LifecycleError,
    ManifestError,
    StaleUpdateError,
    TransportBlocked,
    VersionError,
    WeightConsumer,
    WeightInbox,
    WeightManifest,
    WeightPublisher,
    WeightSyncError,
    available_transports,
    join_publish,
    send,
)
from actors._wire._codec import Decoder, Encoder
from actors.tensors._slots import segment_prefix
from actors.tensors.shm import HEADER_BYTES, SHM_DIR
from actors.weights import SpecTable


@pytest.fixture
def shm_publisher():
    publisher = WeightPublisher("shm", slots=2, lock_timeout=0.3)
    yield publisher
    publisher.close()


def test_transport_probe_reports_pass_or_reason():
    status = available_transports()
    assert status["local"] == "pass" and status["shm"] == "pass"
    if torch.cuda.is_available():
        assert status["cuda-ipc"] == "pass"
    else:
        assert status["cuda-ipc"].startswith("blocked: ") and "CUDA" in status["cuda-ipc"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the blocked path")
def test_cuda_ipc_is_blocked_without_cuda_never_a_fallback():
    with pytest.raises(TransportBlocked, match="no CUDA device") as info:
        WeightPublisher("cuda-ipc")
    assert info.value.transport == "cuda-ipc"
    with pytest.raises(ValueError, match="unknown transport"):
        WeightPublisher("carrier-pigeon")


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_publish_install_roundtrip(transport):
    source, target = filled_model(3.0), filled_model(0.0)
    with WeightPublisher(transport, checksums=True) as publisher:
        consumer = WeightConsumer()
        manifest = publisher.publish(source, 1, {"step": 10})
        assert manifest.version == 1 and manifest.metadata == {"step": 10} and manifest.transport == transport
        assert manifest.total_nbytes == sum(p.numel() * 4 for p in source.parameters())
        assert all(spec.checksum is not None for spec in manifest.tensors)
        consumer.install(manifest, target)
        assert consumer.state(manifest.update_id) == "acknowledged" and consumer.installed_version == 1
        consumer.release(manifest.update_id)
        assert models_equal(source, target)
        consumer.close()


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_a_bfloat16_publisher_sends_half_the_bytes_cast_in_its_one_copy(transport):
    source = filled_model(3.0)
    with torch.no_grad():
        next(source.parameters()).add_(1 / 3)  # a value bfloat16 rounds
    target = filled_model(0.0).to(torch.bfloat16)
    with WeightPublisher(transport, dtype=torch.bfloat16) as publisher:
        manifest = publisher.publish(source, 1)
        assert {spec.dtype for spec in manifest.tensors} == {"bfloat16"}
        assert manifest.total_nbytes == sum(p.numel() * 2 for p in source.parameters())
        consumer = WeightConsumer()
        consumer.install(manifest, target)
        consumer.close()
    for got, want in zip(target.state_dict().values(), source.state_dict().values(), strict=True):
        assert torch.equal(got, want.to(torch.bfloat16))
    with pytest.raises(TypeError, match="floating-point"):
        WeightPublisher(transport, dtype=torch.int8)


def test_manifest_is_small_and_travels_through_the_codec(shm_publisher):
    manifest = shm_publisher.publish(filled_model(1.0, width=256), 1, {"note": "x"})
    enc = Encoder()
    data = enc.encode(manifest)
    assert not enc.frames and len(data) < 1024, "only the manifest crosses the wire, never the weights"
    again = Decoder().decode(data)
    assert isinstance(again, WeightManifest) and again == manifest
    assert again.tensors == manifest.tensors and type(again.table) is SpecTable


def test_a_manifests_specs_travel_as_columns_and_a_malformed_table_is_refused(shm_publisher):
    """A record per tensor cost the codec a nested record each: the table is a few plain lists. Whatever a peer
    sends in its place is refused with ManifestError before anything is read, and the update stays importable."""
    manifest = shm_publisher.publish(filled_model(1.0), 1)
    table = manifest.table
    assert table.names == [spec.name for spec in manifest.tensors] and all(type(s) is list for s in table.shapes)
    rows = len(table.names)
    malformed = [
        (dataclasses.replace(table, offsets=table.offsets[:-1]), "columns of other types or lengths"),
        (dataclasses.replace(table, shapes=tuple(table.shapes)), "columns of other types or lengths"),
        (dataclasses.replace(table, shapes=[5] * rows), "shape must be a tuple"),
        (dataclasses.replace(table, dtypes=["float99"] * rows), "unknown dtype"),
        ({"names": table.names}, "carries no tensor table"),
    ]
    consumer = WeightConsumer()
    try:
        for bad, said in malformed:
            sent = Decoder().decode(Encoder().encode(dataclasses.replace(manifest, table=bad)))
            with pytest.raises(ManifestError, match=said):
                consumer.import_update(sent)
            assert consumer.state(manifest.update_id) is None
        assert set(consumer.import_update(manifest)) == set(table.names)
        consumer.release(manifest.update_id)
        # the next update of the same model carries an equal table: its specs are not rebuilt
        again = Decoder().decode(Encoder().encode(shm_publisher.publish(filled_model(2.0), 2)))
        assert again.table == table and again.table is not table
        assert consumer.specs(again) is consumer.specs(manifest)
        moved = dataclasses.replace(again, table=dataclasses.replace(table, checksums=[7] * rows))
        assert consumer.specs(moved) == tuple(dataclasses.replace(spec, checksum=7) for spec in manifest.tensors)
    finally:
        consumer.close()


def test_versions_must_strictly_increase(shm_publisher):
    shm_publisher.publish(filled_model(1.0), 5)
    for bad in (5, 4):
        with pytest.raises(VersionError, match="does not increase"):
            shm_publisher.publish(filled_model(1.0), bad)
    with pytest.raises(TypeError):
        shm_publisher.publish(filled_model(1.0), 6.0)  # type: ignore[arg-type]
    assert shm_publisher.publish(filled_model(1.0), 6).version == 6


def test_a_bad_version_or_metadata_is_refused_before_the_update_exists(shm_publisher):
    """Refused before anything is copied or committed: no version used up, nothing left held."""
    for version, error in [(-1, ValueError), (2**63, ValueError), (True, TypeError)]:
        with pytest.raises(error, match="version"):
            shm_publisher.publish(filled_model(1.0), version)
    for metadata in ["x", [1, 2], {1: "a"}]:
        with pytest.raises(TypeError, match="metadata"):
            shm_publisher.publish(filled_model(1.0), 1, metadata)  # type: ignore[arg-type]
    assert shm_publisher.version is None and shm_publisher.unreleased == []
    manifest = shm_publisher.publish(filled_model(1.0), 1, {"step": 1})
    assert manifest.version == 1 and manifest.metadata == {"step": 1}


def test_lifecycle_errors_are_distinct(shm_publisher):
    consumer = WeightConsumer()
    manifest = shm_publisher.publish(filled_model(1.0), 1)
    with pytest.raises(LifecycleError, match="before it is imported"):
        consumer.acknowledge(manifest.update_id)
    consumer.import_update(manifest)
    consumer.acknowledge(manifest.update_id)
    with pytest.raises(LifecycleError, match="acknowledged"):
        consumer.reject(manifest.update_id, "too late")
    consumer.release(manifest.update_id)
    consumer.release(manifest.update_id)  # idempotent
    with pytest.raises(LifecycleError, match="released"):
        consumer.import_update(manifest)
    rejected = shm_publisher.publish(filled_model(2.0), 2)
    consumer.reject(rejected.update_id, "not wanted")
    assert consumer.rejection_reason(rejected.update_id) == "not wanted"
    with pytest.raises(LifecycleError, match="rejected"):
        consumer.import_update(rejected)
    with pytest.raises(LifecycleError, match="not published"):
        shm_publisher.release("no-such-update")
    shm_publisher.release(rejected.update_id)
    with pytest.raises(LifecycleError):
        shm_publisher.release(rejected.update_id)
    consumer.close()


@pytest.mark.parametrize("on_a_loop", [False, True], ids=["install", "install_async"])
def test_tampered_bytes_fail_the_checksum(on_a_loop):
    """Either way the update is let go and rejected (on a loop, its release awaited: a cuda-ipc release waits for
    the GPU's reads, which the loop's thread must not)."""
    with WeightPublisher("shm", checksums=True, slots=1, lock_timeout=0.2) as publisher:
        manifest = publisher.publish(filled_model(1.0), 1)
        with open(os.path.join(SHM_DIR, manifest.handle), "r+b") as segment:
            segment.seek(HEADER_BYTES + manifest.tensors[0].offset)
            segment.write(b"\x13\x37")
        consumer = WeightConsumer()
        with pytest.raises(ChecksumError, match=manifest.tensors[0].name):
            if on_a_loop:
                asyncio.run(consumer.install_async(manifest, filled_model(0.0)))
            else:
                consumer.install(manifest, filled_model(0.0))
        assert consumer.state(manifest.update_id) == "rejected"
        unchecked = WeightConsumer(verify_checksums=False)
        assert unchecked.import_update(manifest)
        unchecked.close()
        publisher.publish(filled_model(2.0), 2)  # its one slot is free again: the readers let it go
        consumer.close()


def test_a_blocking_import_interrupted_while_it_checks_the_bytes_lets_the_slot_go(monkeypatch):
    """A Ctrl-C (or a device error) during the checksum pass of ``import_update``: the reader let the slot go only
    on a checksum mismatch, so it kept its hold while the consumer forgot the update, and the publisher's one
    slot stayed held until the consumer closed. The async import let go on anything already."""
    with WeightPublisher("shm", checksums=True, slots=1, lock_timeout=0.2) as publisher:
        manifest = publisher.publish(filled_model(1.0), 1)
        consumer = WeightConsumer()

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(consumer, "_verify", interrupted)
        with pytest.raises(KeyboardInterrupt):
            consumer.import_update(manifest)
        publisher.publish(filled_model(2.0), 2)  # its one slot is free again (before: WeightSyncError, all held)
        consumer.close()


def test_import_is_zero_copy_over_the_slot(shm_publisher):
    manifest = shm_publisher.publish(filled_model(1.0), 1)
    consumer = WeightConsumer()
    tensors = consumer.import_update(manifest)
    first = manifest.tensors[0]
    with open(os.path.join(SHM_DIR, manifest.handle), "r+b") as segment:
        segment.seek(HEADER_BYTES + first.offset)
        segment.write(struct.pack("<f", 42.0))
    assert tensors[first.name].flatten()[0].item() == 42.0, "the imported tensor is a view of the segment"
    consumer.close()


def test_consumer_never_sees_a_mix_while_the_publisher_moves_on(shm_publisher):
    consumer = WeightConsumer()
    held = shm_publisher.publish(filled_model(1.0), 1)
    tensors = consumer.import_update(held)
    for version in range(2, 8):  # every later version goes to the other slot
        shm_publisher.publish(filled_model(float(version)), version)
    assert all(bool((t == 1.0).all()) for t in tensors.values())
    assert len(shm_publisher._writer.segment_names) == 2
    consumer.close()


def test_single_slot_waits_for_the_reader_then_reuses_it():
    with WeightPublisher("shm", slots=1, lock_timeout=0.2) as publisher:
        consumer = WeightConsumer()
        manifest = publisher.publish(filled_model(1.0), 1)
        consumer.import_update(manifest)
        with pytest.raises(WeightSyncError, match="held by consumers"):
            publisher.publish(filled_model(2.0), 2)
        consumer.release(manifest.update_id)
        second = publisher.publish(filled_model(3.0), 3)
        assert second.handle == manifest.handle, "the slot is reused once released"
        consumer.close()


def test_stale_manifest_is_refused(shm_publisher):
    consumer = WeightConsumer()
    old = shm_publisher.publish(filled_model(1.0), 1)
    shm_publisher.publish(filled_model(2.0), 2)
    shm_publisher.publish(filled_model(3.0), 3)  # reuses version 1's slot
    with pytest.raises(StaleUpdateError, match="replaced"):
        consumer.import_update(old)
    assert old.update_id not in shm_publisher.unreleased, "a reclaimed update is released on the publisher side"
    consumer.close()


def test_inbox_installs_newest_and_releases_the_rest(shm_publisher):
    inbox = WeightInbox()
    manifests = [shm_publisher.publish(filled_model(float(v)), v) for v in (1, 2)]
    for manifest in manifests:
        inbox.put(manifest)
    target = filled_model(0.0)
    installed = inbox.install_newest(target)
    assert installed is not None and installed.version == 2 and inbox.superseded == 1
    assert models_equal(target, filled_model(2.0))
    assert {inbox.consumer.state(m.update_id) for m in manifests} == {"released"}
    assert inbox.install_newest(target) is None
    inbox.put(manifests[0])
    assert inbox.install_newest(target) is None, "an older version than installed is dropped"
    with pytest.raises(TypeError):
        inbox.put("not a manifest")  # type: ignore[arg-type]
    inbox.close()


@pytest.mark.parametrize("on_a_loop", [False, True], ids=["install_newest", "install_newest_async"])
def test_an_inbox_whose_newest_update_is_stale_installs_the_older_one_still_whole(on_a_loop):
    """Another consumer holds version 5's slot, so version 7 reused version 6's: an inbox holding 5 and 6 found 6
    stale and had already dropped 5, so it installed nothing, and in the pipeline nothing else was sent to it (the
    trainer counted 5 as delivered): the generator waited out its weights timeout. It installs 5 now."""
    with WeightPublisher("shm", slots=2, keep=3, lock_timeout=0.2) as publisher:
        five = publisher.publish(filled_model(5.0), 5)
        other = WeightConsumer()
        other.import_update(five)  # (another generator's install of 5, under way)
        six = publisher.publish(filled_model(6.0), 6)
        publisher.publish(filled_model(7.0), 7)  # into six's slot: five's is held
        inbox = WeightInbox()
        inbox.put(five)
        inbox.put(six)
        target = filled_model(0.0)
        if on_a_loop:
            installed = asyncio.run(inbox.install_newest_async(target))
        else:
            installed = inbox.install_newest(target)
        assert installed is not None and installed.version == 5 and models_equal(target, filled_model(5.0))
        assert inbox.consumer.state(six.update_id) == "released" and inbox.consumer.installed_version == 5
        other.close()
        inbox.close()


async def test_an_inbox_on_an_event_loop_lets_the_updates_it_drops_go_the_async_way(shm_publisher, monkeypatch):
    """The updates ``install_newest_async`` drops (superseded, or not newer than the installed one) were released
    synchronously, which for a ``cuda-ipc`` update still held waits for the GPU on the loop's thread; they are let
    go with ``release_async`` now, as the installed one is."""
    inbox = WeightInbox()
    manifests = [shm_publisher.publish(filled_model(float(v)), v) for v in (1, 2)]
    for manifest in manifests:
        inbox.put(manifest)

    def blocking(*args: object) -> None:
        raise AssertionError("a synchronous release on the event loop")

    monkeypatch.setattr(inbox.consumer, "release", blocking)
    target = filled_model(0.0)
    installed = await inbox.install_newest_async(target)
    assert installed is not None and installed.version == 2 and models_equal(target, filled_model(2.0))
    assert {inbox.consumer.state(m.update_id) for m in manifests} == {"released"}
    inbox.put(manifests[0])
    assert await inbox.install_newest_async(target) is None, "an older version than installed is dropped"
    monkeypatch.undo()
    inbox.close()


def test_local_publisher_keeps_a_bounded_history():
    with WeightPublisher("local", keep=2) as publisher:
        for version in range(1, 6):
            publisher.publish(filled_model(float(version)), version)
        assert len(publisher.unreleased) == 2


def test_a_closed_local_publisher_frees_its_updates():
    """Its copies live in this process's memory: closing the publisher frees them, and an update of it can no
    longer be imported (it stayed importable, and held, until the process ended)."""
    publisher = WeightPublisher("local", keep=3)
    manifests = [publisher.publish(filled_model(float(v)), v) for v in (1, 2)]
    other = WeightPublisher("local")
    kept = other.publish(filled_model(5.0), 1)
    publisher.close()
    consumer = WeightConsumer()
    for manifest in manifests:
        with pytest.raises(StaleUpdateError):
            consumer.import_update(manifest)
    assert consumer.import_update(kept)["0.weight"].eq(5.0).all(), "another publisher's updates are its own"
    consumer.close()
    other.close()


def test_local_updates_stay_in_their_process():
    with WeightPublisher("local") as publisher:
        manifest = publisher.publish(filled_model(1.0), 1)
        foreign = WeightManifest(manifest.update_id, 1, "local", manifest.table, manifest.handle + 1, 1)
        with pytest.raises(WeightSyncError, match="process that published"):
            WeightConsumer().import_update(foreign)


def test_a_thousand_updates_keep_segments_and_memory_flat():
    def rss_kib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    model, target = filled_model(0.0, width=256), filled_model(0.0, width=256)
    inbox = WeightInbox()
    with WeightPublisher("shm", slots=2) as publisher:
        prefix = segment_prefix()
        baseline = None
        for version in range(1, 1001):
            inbox.put(publisher.publish(model, version))
            assert inbox.install_newest(target) is not None
            if version == 50:
                baseline = rss_kib()
            assert len(glob.glob(f"{SHM_DIR}/{prefix}*")) <= 2
        assert baseline is not None and rss_kib() - baseline < 16 * 1024, "RSS grew over 1,000 updates"
    inbox.close()


async def test_cross_process_install_via_fire_and_forget(procs):
    sinks = procs.spawn("sink", WeightSink)
    with WeightPublisher("shm", slots=3) as publisher:
        for version in range(1, 4):
            send(sinks.update_weights, (publisher.publish(filled_model(float(version)), version),), selection="choose")
        # "choose" alternates: one actor got versions 1 and 3 (installs 3, drops 1), the other got 2.
        assert sorted((await sinks.install_pending.call()).values()) == [2, 3]
        assert sorted(s for _, s in (await sinks.inbox_stats.call()).values()) == [0, 1]
        # everyone gets the newest directly
        newest = publisher.publish(filled_model(9.0), 9)
        sinks.update_weights.broadcast(newest)
        assert list((await sinks.install_pending.call()).values()) == [9, 9]


async def test_concurrent_publish_and_install_never_mixes(procs):
    sink = procs.spawn("sink", WeightSink, 128).slice(procs=0)
    with WeightPublisher("shm", slots=2) as publisher:
        final = 200
        done = sink.install_until.call_one(final)
        for version in range(1, final + 1):
            send(sink.update_weights, (publisher.publish(filled_model(float(version), 128), version),))
            await asyncio.sleep(0)
        installs = await asyncio.wait_for(done, 60)
        assert 1 <= installs <= final


async def test_dead_consumer_frees_its_slot(procs):
    sink = procs.spawn("sink", WeightSink).slice(procs=0)
    with WeightPublisher("shm", slots=1, lock_timeout=10) as publisher:
        manifest = publisher.publish(filled_model(1.0), 1)
        pid = await sink.hold.call_one(manifest)
        os.kill(pid, signal.SIGKILL)
        again = await publisher.publish_async(
            filled_model(2.0), 2
        )  # waits, loop running, for the kernel to drop the lock
        assert again.handle == manifest.handle


def test_an_update_read_twice_is_freed_by_one_release():
    """A consumer that reads an update again (a retried install) and then releases it once frees its slot (before,
    each read took a hold and one release dropped one: the slot stayed locked for good)."""
    from actors.tensors.shm import ShmReader

    with WeightPublisher("shm", slots=1, lock_timeout=0.5) as publisher:
        manifest = publisher.publish(filled_model(1.0), 1)
        reader = ShmReader()
        try:
            for _ in range(2):
                reader.read(manifest.update_id, 1, manifest.handle, manifest.tensors)
            reader.release(manifest.update_id)
            assert publisher.publish(filled_model(2.0), 2).handle == manifest.handle, "the one slot is free again"
        finally:
            reader.close()


async def test_dead_publisher_segments_are_removed(procs):
    source = procs.spawn("source", WeightSource).slice(procs=1)
    manifest = await source.publish.call_one(1)
    path = os.path.join(SHM_DIR, manifest.handle)
    assert os.path.exists(path)
    os.kill(manifest.publisher_pid, signal.SIGKILL)
    assert wait_for(lambda: manifest.publisher_pid not in actor_pids(), timeout=5)
    with pytest.raises(Exception):  # noqa: B017 - the call fails once the death is noticed
        await asyncio.wait_for(source.publish.call_one(2), 5)
    assert not os.path.exists(path)


def aliasing_version_1(publisher: WeightPublisher) -> tuple[WeightInbox, torch.nn.Module, WeightManifest]:
    """An inbox whose model (all 0.0 before) views version 1 (all 1.0) of ``publisher``, and that update."""
    inbox = WeightInbox()
    model = filled_model(0.0)
    first = publisher.publish(filled_model(1.0), 1)
    inbox.put(first)
    assert inbox.install_newest(model, alias=True) is first
    return inbox, model, first


def test_alias_install_is_zero_copy_and_holds_the_slot_until_replaced():
    with WeightPublisher("shm", slots=2, lock_timeout=0.2) as publisher:
        inbox, model, first = aliasing_version_1(publisher)
        assert inbox.consumer.holds_alias(first.update_id) and inbox.consumer.state(first.update_id) == "acknowledged"
        weight = next(model.parameters())
        with open(os.path.join(SHM_DIR, first.handle), "r+b") as segment:
            segment.seek(HEADER_BYTES + first.tensors[0].offset)
            segment.write(struct.pack("<f", 7.0))
        assert weight.flatten()[0].item() == 7.0, "the parameters view the shared slot"
        # The aliased slot is held: later versions go to the other slot, never under the model.
        for version in (2, 3):
            publisher.publish(filled_model(float(version)), version)
        assert weight.flatten()[1].item() == 1.0
        second = publisher.publish(filled_model(4.0), 4)
        inbox.put(second)
        inbox.install_newest(model, alias=True)
        assert inbox.consumer.state(first.update_id) == "released", "the replaced alias is released"
        assert all(bool((p == 4.0).all()) for p in model.parameters())
        inbox.close()


async def test_manifests_travel_through_a_typed_port(procs):
    sink = procs.spawn("sink", WeightSink).slice(procs=0)
    inlet = await sink.manifest_inlet.call_one()
    with WeightPublisher("shm") as publisher:
        with pytest.raises(TypeError, match="WeightManifest"):
            inlet.send({"not": "a manifest"})
        inlet.send(publisher.publish(filled_model(5.0), 5))
        assert await sink.install_from_port.call_one() == 5


def test_publisher_segments_are_freed_at_interpreter_exit(tmp_path):
    import sys

    script = tmp_path / "publisher.py"
    script.write_text(
        "import os, signal, sys\n"
        "from actors import WeightPublisher\n"
        "from support import filled_model\n"
        "p = WeightPublisher('shm')\n"
        "m = p.publish(filled_model(1.0), 1)\n"
        "print(m.handle, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"  # Ctrl-C: KeyboardInterrupt, then normal exit
        "signal.pause()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    out = run_python(str(script), timeout=60, env=env)
    handle = out.stdout.split()[0]
    assert "KeyboardInterrupt" in out.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, handle))


def test_two_publishers_in_one_process_do_not_collide():
    with WeightPublisher("shm") as first, WeightPublisher("shm") as second:
        a = first.publish(filled_model(1.0), 1)
        b = second.publish(filled_model(2.0), 1)
        assert a.handle != b.handle
        consumer = WeightConsumer()
        assert all(bool((t == 2.0).all()) for t in consumer.import_update(b).values())
        consumer.close()


def test_a_repeat_of_the_update_a_model_aliases_leaves_it_held():
    """The same manifest delivered again (a trainer's grant and its fire-and-forget send) is dropped without
    releasing the update the model's parameters still view: the publisher must not write a newer one under them."""
    with WeightPublisher("shm", slots=2, lock_timeout=0.2) as publisher:
        inbox, model, first = aliasing_version_1(publisher)
        inbox.put(first)
        assert inbox.install_newest(model, alias=True) is None
        second = publisher.publish(filled_model(2.0), 2)
        inbox.put(first)  # an older repeat beside a newer update: superseded, still not released
        inbox.put(second)
        assert inbox.install_newest(model, alias=True) is second
        assert inbox.consumer.state(first.update_id) == "released", "released once the model views the next"
        assert inbox.consumer.holds_alias(second.update_id)
        inbox.put(second)
        assert inbox.install_newest(model, alias=True) is None
        assert inbox.consumer.holds_alias(second.update_id)
        for version in (3, 4):  # slot A is free again; slot B must stay under the model
            publisher.publish(filled_model(float(version)), version)
        assert all(bool((p == 2.0).all()) for p in model.parameters()), "the model's weights were overwritten"
        inbox.close()


def two_modules_installed(
    publisher: WeightPublisher, second_alias: bool
) -> tuple[WeightConsumer, torch.nn.Module, torch.nn.Module, WeightManifest, WeightManifest]:
    """A consumer with version 1 aliased into one module and version 2 installed into another."""
    consumer = WeightConsumer()
    viewer, other = filled_model(0.0), filled_model(0.0)
    first = publisher.publish(filled_model(1.0), 1)
    consumer.install(first, viewer, alias=True)
    second = publisher.publish(filled_model(2.0), 2)
    consumer.install(second, other, alias=second_alias)
    return consumer, viewer, other, first, second


@pytest.mark.parametrize("copied", [True, False], ids=["then-a-copy", "then-an-alias"])
def test_an_update_one_module_views_stays_held_while_another_module_installs_the_next(copied):
    """Two modules in one consumer (replicas, a policy beside its reference): installing the next update into one
    released the update the other still viewed (the consumer kept one aliased update, whoever viewed it), and the
    publisher wrote newer weights under it. Each module's view is its own: an update is released once no module
    views it."""
    with WeightPublisher("shm", slots=3, lock_timeout=0.2) as publisher:
        consumer, viewer, other, first, second = two_modules_installed(publisher, second_alias=not copied)
        if copied:
            consumer.release(second.update_id)
        assert consumer.holds_alias(first.update_id) and consumer.state(first.update_id) == "acknowledged"
        assert consumer.holds_alias(second.update_id) is not copied
        for version in (3, 4, 5):  # the slots no module views are written again
            newest = publisher.publish(filled_model(float(version)), version)
        assert all(bool((p == 1.0).all()) for p in viewer.parameters()), "the viewed update was written over"
        consumer.install(newest, viewer, alias=True)
        assert consumer.state(first.update_id) == "released", "released once its last viewer moved on"
        assert consumer.holds_alias(second.update_id) is not copied, "the other module's view is its own"
        del other  # a viewer garbage-collected: the next install releases what it viewed
        gc.collect()
        consumer.install(newest, viewer, alias=True)
        assert consumer.state(second.update_id) == "released" and consumer.holds_alias(newest.update_id)
        consumer.close()


def test_updates_an_install_replaces_are_each_released_or_owed_whatever_fails_first(monkeypatch):
    """An install can leave two updates unviewed (the module's own, and one whose other viewer was collected): if
    releasing the first failed, the second was neither released nor owed, and stayed held for good. Each is
    owed until let go: the next release makes what is left."""
    with WeightPublisher("shm", slots=4, lock_timeout=0.2) as publisher:
        consumer, viewer, other, first, second = two_modules_installed(publisher, second_alias=True)
        del other
        gc.collect()
        reader = consumer.reader("shm")
        release = reader.release
        failing = {first.update_id}

        def flaky(update_id: str) -> None:
            if update_id in failing:
                failing.discard(update_id)
                raise OSError("interrupted")
            release(update_id)

        monkeypatch.setattr(reader, "release", flaky)
        third = publisher.publish(filled_model(3.0), 3)
        with pytest.raises(OSError, match="interrupted"):
            consumer.install(third, viewer, alias=True)  # (installed: the failure is in letting the others go)
        assert consumer.holds_alias(third.update_id)
        later = publisher.publish(filled_model(4.0), 4)
        consumer.import_update(later)
        consumer.release(later.update_id)  # makes what is owed
        assert [consumer.state(u.update_id) for u in (first, second)] == ["released", "released"]
        consumer.close()


COPY_AFTER_ALIAS = """
import torch
from actors import WeightInbox, WeightPublisher

class Tied(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(value)

with WeightPublisher("shm", slots=3) as publisher:
    inbox = WeightInbox()
    model = Tied(0.0)
    first = publisher.publish(Tied(1.0), 1)
    inbox.put(first)
    assert inbox.install_newest(model, alias=True) is first
    second = publisher.publish(Tied(2.0), 2)
    inbox.put(second)
    assert inbox.install_newest(model) is second  # a copying install: the slot's mapping is read-only
    assert inbox.consumer.state(first.update_id) == "released"
    assert inbox.consumer.state(second.update_id) == "released"
    assert model.head.weight is model.embed.weight, "the tie is kept"
    for version in (3, 4, 5):
        publisher.publish(Tied(float(version)), version)
    assert all(bool((p == 2.0).all()) for p in model.parameters()), "the model owns its weights again"
    inbox.close()
print("ok")
"""


async def test_a_loader_load_after_an_aliasing_install_leaves_the_viewed_update_held():
    """The module still views the update it aliased after a loader takes the next one (another destination): that
    update was released under it (its shared memory unmapped: the module read freed memory)."""
    with WeightPublisher("shm", slots=3) as publisher:
        inbox, model, first = aliasing_version_1(publisher)
        taken: list[float] = []
        inbox.put(publisher.publish(filled_model(2.0), 2))
        await inbox.load_newest_async(lambda tensors: taken.append(float(next(iter(tensors.values())).flatten()[0])))
        assert taken == [2.0] and inbox.consumer.installed_version == 2
        assert inbox.consumer.holds_alias(first.update_id) and inbox.consumer.state(first.update_id) == "acknowledged"
        assert all(bool((p == 1.0).all()) for p in model.parameters()), "the module reads the update it views"
        inbox.close()


@pytest.mark.parametrize("alias", [False, True])
def test_a_partial_install_after_an_aliasing_one_leaves_no_tensor_on_the_released_update(alias):
    """``strict=False`` with an update of some of the module's tensors: the others still viewed the aliased update's
    slot when it was released. They get storage of their own (the values they had), taken before the release."""
    with WeightPublisher("shm", slots=3) as publisher:
        inbox, model, first = aliasing_version_1(publisher)
        slot = {t.untyped_storage().data_ptr() for t in inbox.consumer._tensors[first.update_id].values()}
        some = dict(list(filled_model(5.0).state_dict().items())[:1])
        second = publisher.publish(some, 2)
        inbox.consumer.install(second, model, strict=False, alias=alias)
        assert not any(t.untyped_storage().data_ptr() in slot for t in model.state_dict().values())
        assert inbox.consumer.state(first.update_id) == "released"
        values = model.state_dict()
        assert all(bool((values[name] == 5.0).all()) for name in some)
        assert all(bool((t == 1.0).all()) for name, t in values.items() if name not in some)
        if not alias:
            inbox.consumer.release(second.update_id)
        inbox.close()


def test_a_copying_install_after_an_aliasing_one_gives_the_model_its_own_storage_again():
    """The parameters viewed the first update's read-only slot; copying into them would write into shared memory
    (a crash for ``shm``, the publisher's slot for ``cuda-ipc``). Run in a process of its own: a crash is a fail."""
    proc = run_python("-c", COPY_AFTER_ALIAS, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


READ_AFTER_CLOSE = """
import torch
from actors import WeightInbox, WeightPublisher

with WeightPublisher("shm", slots=2) as publisher:
    inbox = WeightInbox()
    model = torch.nn.Linear(64, 64)
    source = torch.nn.Linear(64, 64)
    with torch.no_grad():
        for p in source.parameters():
            p.fill_(3.0)
    inbox.put(publisher.publish(source, 1))
    inbox.install_newest(model, alias=True)  # the parameters view the slot's mapping
    inbox.close()  # (an actor's __cleanup__, while another task still runs the model)
    total = sum(float(p.sum()) for p in model.parameters())
print(total)
"""


def test_closing_the_inbox_leaves_an_aliased_models_weights_readable():
    """Torch's views of a mapping hold the mapping object, not a buffer export, so closing the reader unmapped
    pages the aliased parameters still viewed: the next read of the model was a segfault. The mapping goes when
    the last view does. Run in a process of its own: a crash is a fail."""
    proc = run_python("-c", READ_AFTER_CLOSE, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert float(proc.stdout.strip()) == 3.0 * (64 * 64 + 64)


def test_inbox_treats_a_repeated_manifest_as_one_update(shm_publisher):
    inbox = WeightInbox()
    manifest = shm_publisher.publish(filled_model(2.0), 1)
    inbox.put(manifest)
    inbox.put(manifest)
    target = filled_model(0.0)
    assert inbox.install_newest(target) is manifest and inbox.superseded == 0
    inbox.put(manifest)  # delivered again after installing: dropped quietly
    assert inbox.install_newest(target) is None
    inbox.close()


async def test_a_loader_takes_an_update_whose_names_are_not_the_destinations():
    """An engine with fused layers loads through a callable: acknowledged and released, or rejected with the reason."""
    publisher = WeightPublisher("shm", slots=2)
    inbox = WeightInbox()
    fused = torch.zeros(4, 3)
    state = {"q.weight": torch.ones(2, 3), "k.weight": torch.full((2, 3), 2.0)}

    def into_fused(tensors: dict[str, torch.Tensor]) -> None:
        fused.copy_(torch.cat([tensors["q.weight"], tensors["k.weight"]]))

    def refuses(tensors: dict[str, torch.Tensor]) -> None:
        raise KeyError("v.weight")

    try:
        assert await inbox.load_newest_async(into_fused) is None  # nothing waiting
        inbox.put(first := publisher.publish(state, 1))
        assert await inbox.load_newest_async(into_fused) is first
        assert fused[:2].eq(1).all() and fused[2:].eq(2).all()
        assert inbox.consumer.installed_version == 1 and inbox.consumer.state(first.update_id) == "released"
        inbox.put(second := publisher.publish({k: v * 3 for k, v in state.items()}, 2))
        with pytest.raises(KeyError, match=r"v\.weight"):
            await inbox.load_newest_async(refuses)
        assert inbox.consumer.rejection_reason(second.update_id) == "KeyError: 'v.weight'"
        assert inbox.consumer.state(second.update_id) == "released" and inbox.consumer.installed_version == 1
        assert fused[:2].eq(1).all()  # the last good weights stay
        inbox.put(third := publisher.publish(state, 3))  # both slots are free again
        assert await inbox.load_newest_async(into_fused) is third
    finally:
        inbox.close()
        publisher.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_model_sharded_over_two_ranks_is_published_whole(procs, transport):
    """FSDP2 shards on two gloo ranks: rank 0's manifest holds the whole model, each tensor gathered as copied."""
    sources = procs.spawn("sharded", ShardedSource, transport)
    port = await sources.slice(procs=0).serve.call_one(2)
    await sources.join.call(port)
    results = [value for _, value in (await sources.publish.call(7)).items()]
    manifest, gathered = results
    expected = seeded_model()
    assert isinstance(manifest, WeightManifest) and manifest.version == 7
    assert gathered == len(expected.state_dict()), "the other rank joined every gather"
    assert manifest.total_nbytes == sum(p.numel() * 2 for p in expected.parameters()), "published whole, in bf16"
    target = seeded_model(seed=1).to(torch.bfloat16)
    consumer = WeightConsumer()
    try:
        await consumer.install_async(manifest, target)
        consumer.release(manifest.update_id)
    finally:
        consumer.close()
    for name, value in expected.state_dict().items():
        assert torch.equal(target.state_dict()[name], value.to(torch.bfloat16)), name


async def test_shards_gathered_in_small_buckets_are_the_whole_tensors(procs):
    """Several buckets (flushed by size), uneven rows, a rank left no row: each tensor whole, in order, on each rank."""
    sources = procs.spawn("sharded", ShardedSource, "shm")
    port = await sources.slice(procs=0).serve.call_one(2)
    await sources.join.call(port)
    expected = list(seeded_model().state_dict().values())
    for bucket_bytes in (1, 4096, 1 << 30):  # one tensor per bucket, a few, all in one
        for _, gathered in (await sources.gathered_in_buckets.call(bucket_bytes)).items():
            assert len(gathered) == len(expected)
            for got, want in zip(gathered, expected, strict=True):
                assert torch.equal(got, want)


def test_a_rank_outside_any_group_joins_no_gather():
    assert join_publish(filled_model(1.0)) == 0, "nothing sharded: nothing to gather, nothing waited for"


class TiedLM(torch.nn.Module):
    """An embedding and an output head that share one weight, as tied language models do."""

    def __init__(self, value: float, tied: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        with torch.no_grad():
            for index, parameter in enumerate(self.parameters()):
                parameter.fill_(value + index)


@pytest.mark.parametrize("transport", ["local", "shm", "tcp"])
@pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
def test_a_tied_head_is_published_once_and_installs_into_tied_and_untied_models(transport, alias):
    if alias and transport != "shm":
        pytest.skip("aliasing installs views of a shared slot: shm's")
    source = TiedLM(2.0)
    with WeightPublisher(transport, checksums=True) as publisher:
        manifest = publisher.publish(source, 1)
        if transport == "tcp":
            manifest = dataclasses.replace(manifest, publisher_host="another-host")
        specs = {spec.name: spec for spec in manifest.tensors}
        assert specs["head.weight"].offset == specs["embed.weight"].offset
        assert specs["head.weight"].checksum == specs["embed.weight"].checksum is not None
        assert manifest.total_nbytes == 4 * (50 * 8 + 8 + 8), "the head's bytes are the embedding's: sent once"
        for target in (TiedLM(0.0), TiedLM(0.0, tied=False)):
            consumer = WeightConsumer()
            consumer.install(manifest, target, alias=alias)
            for name, value in source.state_dict().items():
                assert torch.equal(target.state_dict()[name], value), name
            consumer.release(manifest.update_id)
            consumer.close()
    untied = TiedLM(2.0, tied=False)  # equal values, separate storage: both sent
    with WeightPublisher("local") as publisher:
        assert publisher.publish(untied, 1).total_nbytes == 4 * (2 * 50 * 8 + 8 + 8)


def test_a_slots_views_are_made_once_per_layout_and_a_new_layout_is_checked_first():
    """Both sides make the tensors over a slot once per layout (hundreds of tensor operations an update), and the
    reader still checks any layout it has not seen in that slot."""
    source = filled_model(1.0)
    with WeightPublisher("shm", slots=1) as publisher:
        consumer = WeightConsumer()
        try:
            first = publisher.publish(source, 1)
            made = consumer.import_update(first)
            consumer.release(first.update_id)
            with torch.no_grad():
                next(source.parameters()).add_(1.0)
            second = publisher.publish(source, 2)
            again = consumer.import_update(second)
            assert all(again[name] is made[name] for name in made), "the same views, not made again"
            assert torch.equal(again[first.tensors[0].name], next(source.parameters())), "over the new bytes"
            consumer.release(second.update_id)
            third = publisher.publish(source, 3)
            outside = dataclasses.replace(third.tensors[0], offset=1 << 40)
            tampered = dataclasses.replace(third, table=SpecTable.of((outside, *third.tensors[1:])))
            with pytest.raises(ManifestError, match="outside its slot"):
                consumer.import_update(tampered)
        finally:
            consumer.close()


def test_an_alias_install_keeps_each_parameter_and_gives_it_the_slots_bytes():
    """Each parameter object stays (an optimizer or a captured graph's owner holding it sees the update) and views
    the slot; a module whose state_dict names are not its tensors' own still installs, through load_state_dict."""
    model = filled_model(0.0)
    before = list(model.parameters())
    with WeightPublisher("shm", slots=2) as publisher:
        inbox = WeightInbox()
        manifest = publisher.publish(filled_model(1.0), 1)
        inbox.put(manifest)
        assert inbox.install_newest(model, alias=True) is manifest
        views = inbox.consumer.import_update(manifest)  # the same update's tensors: views of the slot
        assert all(a is b for a, b in zip(model.parameters(), before, strict=True))
        for name, parameter in model.named_parameters():
            assert parameter.data_ptr() == views[name].data_ptr() and bool((parameter == 1.0).all())
        inbox.close()

        class Renamed(torch.nn.Module):  # its state_dict says "w", its parameter is "inner.weight"
            def __init__(self) -> None:
                super().__init__()
                self.inner = torch.nn.Linear(2, 2, bias=False)
                self._register_state_dict_hook(lambda module, state, prefix, local: {"w": state["inner.weight"]})
                self.register_load_state_dict_pre_hook(
                    lambda module, state, prefix, *rest: state.update({"inner.weight": state.pop("w")})
                )

        source, target = Renamed(), Renamed()
        consumer = WeightConsumer()
        consumer.install(publisher.publish(source, 2), target, alias=True)
        assert torch.equal(target.inner.weight, source.inner.weight)
        consumer.close()


def test_ties_are_the_same_bytes_seen_the_same_way_not_just_the_same_address():
    """A tie is an earlier tensor's bytes with its device, shape, stride and dtype: a view starting at the same
    address but read another way is bytes of its own (copied, not aliased), and an empty tensor is no one's."""
    from actors.tensors import ties

    base = torch.arange(12, dtype=torch.float32, device="cpu").reshape(3, 4)
    flat, as_ints = base.view(12), base.view(torch.int32)
    tensors = [
        ("w", base),
        ("flat", flat),  # the same address, another shape
        ("head", base),  # the same bytes: tied to w
        ("ints", as_ints),  # the same address and shape, another dtype
        ("flat_again", flat),  # tied to flat, not to w
        ("transposed", base.t()),  # the same address, other strides
        ("empty", torch.empty(0, device="cpu")),
        ("other", torch.ones(3, 4, device="cpu")),
    ]
    assert ties(tensors) == [None, None, 0, None, 1, None, None, None]


def test_a_conjugated_or_negated_view_is_not_tied_to_the_tensor_it_reads():
    """``w.conj()`` and a negative view are w's address, shape, stride and dtype read another way: bytes of their
    own (before, they were tied to w and w's values arrived in their place)."""
    from actors.tensors import ties

    w = torch.complex(torch.arange(4.0), torch.ones(4))
    real = torch.arange(4.0)
    tensors = [("w", w), ("conj", w.conj()), ("conj_again", w.conj()), ("real", real), ("neg", torch._neg_view(real))]
    assert ties(tensors) == [None, None, 1, None, None]


def test_a_stale_update_delivered_again_is_dropped_not_an_error():
    """An update turned down as stale (its slot rewritten before the install) can arrive again (a grant and a
    fire-and-forget send carry one version): it is dropped as it was, not a LifecycleError out of the install."""
    with WeightPublisher("shm", slots=1, lock_timeout=0.2) as publisher:
        inbox, model = WeightInbox(), filled_model(0.0)
        first = publisher.publish(filled_model(1.0), 1)
        publisher.publish(filled_model(2.0), 2)  # takes over the one slot: version 1 is stale
        for _ in range(2):
            inbox.put(first)
            assert inbox.install_newest(model) is None
        assert inbox.consumer.state(first.update_id) in ("rejected", "released") and inbox.superseded == 1
        assert all(bool((p == 0.0).all()) for p in model.parameters())
        inbox.close()
