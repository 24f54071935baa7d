"""GPU to GPU over cuda-ipc, placement on GPUs, and the pipeline on CUDA (skipped without a GPU).

Run on a GPU machine with ``python -m pytest -m gpu``. Every test here is
marked ``gpu``; on a machine without CUDA each is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
import torch
from support import CudaSink, CudaSource, Echo, filled_model

from actors import (
    ActorError,
    ManifestError,
    PublisherDied,
    WeightInbox,
    WeightPublisher,
)

pytestmark = pytest.mark.gpu


def fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


@pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
async def test_updates_go_gpu_to_gpu_into_another_process(procs, alias):
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(0.0).cuda()
    with WeightPublisher("cuda-ipc", slots=3) as publisher:
        for version in range(1, 8):
            fill(model, float(version))
            manifest = publisher.publish(model, version)
            fill(model, -1.0)  # the trainer moves on at once: the copy is ordered before this write
            report = await sink.install.call_one(manifest, alias)
            assert report["version"] == version and report["values"] == [float(version)], report
            assert report["device"].startswith("cuda")
        assert report["open_slots"] <= 3, "each slot is opened once, then reused"
    assert await sink.close_inbox.call_one() == 0, "no IPC handle stays open"


@pytest.mark.parametrize("alias", [False, True], ids=["copy", "alias"])
async def test_an_install_on_the_event_loop_awaits_its_gpu_reads_and_never_blocks_on_them(procs, alias):
    """``install_newest_async`` releases the update it copied (or the one its module viewed until now) by polling an
    event between turns of the loop: no stream, device or event synchronize on the loop's thread; the slots are
    given back (a publisher of two slots keeps publishing)."""
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(0.0).cuda()
    with WeightPublisher("cuda-ipc", slots=2, lock_timeout=10.0) as publisher:
        for version in range(1, 6):
            fill(model, float(version))
            report = await sink.install_async_never_blocking.call_one(publisher.publish(model, version), alias)
            assert report["version"] == version and report["values"] == [float(version)], report
    assert await sink.close_inbox.call_one() == 0


async def test_closing_an_inbox_on_its_loop_awaits_the_gpu_reads_of_the_slot_its_model_views(procs):
    """``ReceivesWeights.__cleanup__`` closes its inbox on the actor's loop: the aliased slot is released by polling
    an event, not by a stream synchronize on the loop's thread."""
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(3.0).cuda()
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        report = await sink.install.call_one(publisher.publish(model, 1), True)
        assert report["values"] == [3.0]
        assert await sink.close_inbox_never_blocking.call_one() == 0


async def test_a_tcp_publish_of_gpu_tensors_on_an_event_loop_waits_for_the_gpu_off_its_thread(monkeypatch):
    """A host copy out of a GPU waits for the device: ``publish_async`` runs it on a worker thread at any size
    (a small one ran on the loop's thread, below the 1 MiB offload bound)."""
    import threading

    from actors import WeightConsumer

    loop_thread = threading.get_ident()
    real = torch.cuda.synchronize, torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize

    def guard(wait):  # type: ignore[no-untyped-def]
        def guarded(*args, **kwargs):  # type: ignore[no-untyped-def]
            assert threading.get_ident() != loop_thread, "publish_async waited for the GPU on the loop's thread"
            return wait(*args, **kwargs)

        return guarded

    model = filled_model(4.0).cuda()  # 17 KiB
    with WeightPublisher("tcp") as publisher:
        monkeypatch.setattr(torch.cuda, "synchronize", guard(real[0]))
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", guard(real[1]))
        monkeypatch.setattr(torch.cuda.Event, "synchronize", guard(real[2]))
        manifest = await publisher.publish_async(model, 1)
        monkeypatch.undo()
        consumer = WeightConsumer()
        target = filled_model(0.0)
        await consumer.install_async(manifest, target)
        assert all(bool((p == 4.0).all()) for p in target.parameters())
        await consumer.close_async()


async def test_publish_never_synchronizes_the_device(procs, monkeypatch):
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(1.0).cuda()
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        publisher.publish(model, 1)  # allocates the first slot (its setup may wait)
        publisher.publish(model, 2)

        def refuse(*args, **kwargs):
            raise AssertionError("publish waited for the GPU")

        monkeypatch.setattr(torch.cuda, "synchronize", refuse)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", refuse)
        started = time.perf_counter()
        manifests = [await publisher.publish_async(model, version) for version in range(3, 13)]
        stall = (time.perf_counter() - started) / 10
        monkeypatch.undo()
        report = await sink.install.call_one(manifests[-1], False)
        assert report["values"] == [1.0] and report["version"] == 12
        assert stall < 0.01, f"publish stalled the trainer for {stall * 1000:.2f} ms"


async def test_a_consumer_reopens_slots_only_when_the_layout_changes(procs):
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        small = filled_model(1.0).cuda()
        opened = [await sink.touch.call_one(publisher.publish(small, v)) for v in range(1, 21)]
        assert max(opened) == 2, opened
        big = filled_model(1.0, width=512).cuda()  # larger than either slot: both are replaced
        opened = [await sink.touch.call_one(publisher.publish(big, v)) for v in range(21, 41)]
        assert opened[-1] == 2, "the old slots were forgotten, the new ones opened once each"
    assert await sink.close_inbox.call_one() == 0


async def test_a_thousand_updates_keep_gpu_memory_flat_on_both_sides(procs):
    sink = procs.spawn("sink", CudaSink, 256).slice(procs=0)
    model = filled_model(0.0, width=256).cuda()
    before = torch.cuda.memory_allocated()
    with WeightPublisher("cuda-ipc", slots=3) as publisher:
        reports = []
        for version in range(1, 1001):
            fill(model, float(version % 7))
            reports.append(await sink.install.call_one(await publisher.publish_async(model, version), version % 2 == 0))
            if version == 20:
                publisher_after_warmup = torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() == publisher_after_warmup, "the publisher allocates nothing per update"
        assert reports[-1]["allocated"] == reports[19]["allocated"], "the consumer allocates nothing per update"
        assert max(r["open_slots"] for r in reports) <= 3
    assert await sink.close_inbox.call_one() == 0  # the last install (version 1000) viewed its slot until now
    await _until_allocated(before)


async def test_a_closed_publisher_keeps_the_slot_an_aliasing_consumer_views_until_it_lets_go(procs):
    """The trainer closes its publisher (a restart, the end of a run) while a generator's parameters view a slot:
    the slot stays allocated until the generator lets go, so what the trainer allocates next lands elsewhere (freed
    at once, the consumer would silently read the trainer's new tensors); then it is freed."""
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(0.0).cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    publisher = WeightPublisher("cuda-ipc", slots=2)
    fill(model, 7.0)
    assert (await sink.install.call_one(publisher.publish(model, 1), True))["values"] == [7.0]
    publisher.close()
    assert torch.cuda.memory_allocated() > before, "the slot the consumer views was freed under it"
    junk = [torch.full((1 << 20,), -3.0, device="cuda") for _ in range(16)]  # what the allocator hands out next
    torch.cuda.synchronize()
    assert (await sink.holding.call_one())["values"] == [7.0]
    assert await sink.close_inbox.call_one() == 0  # lets go of the slot
    await _until_allocated(before + sum(t.numel() * t.element_size() for t in junk))


async def _until_allocated(expected: int) -> None:
    """This process's GPU memory back to ``expected``: a closed publisher frees a slot a consumer held from a thread
    waiting for the slot's lock, soon after the consumer lets go."""
    deadline = time.monotonic() + 10
    while torch.cuda.memory_allocated() != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert torch.cuda.memory_allocated() == expected, "a slot outlived its last reader, or the publisher leaked one"


async def test_a_dead_publisher_leaves_the_last_good_weights_installed(procs):
    source = procs.spawn("source", CudaSource).slice(procs=1)
    inbox = WeightInbox()
    model = filled_model(0.0).cuda()
    inbox.put(await source.publish.call_one(1))
    assert inbox.install_newest(model) is not None
    os.kill(inbox.publisher, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(PublisherDied):
        await inbox.wait(30)
    assert time.monotonic() - started < 1.0
    assert all(bool((p == 1.0).all()) for p in model.parameters())
    inbox.close()


async def test_wrong_handles_and_invisible_gpus_are_refused(procs):
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    model = filled_model(3.0).cuda()
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        manifest = publisher.publish(model, 1)
        elsewhere = dataclasses.replace(manifest, handle={**manifest.handle, "device": "GPU-not-here"})
        with pytest.raises(ActorError) as info:
            await sink.install.call_one(elsewhere, False)
        assert info.value.exception_type.endswith("TransportBlocked") and "not visible" in info.value.message
        broken = dataclasses.replace(manifest, handle={**manifest.handle, "mem": b"x"})
        with pytest.raises(ActorError) as info:
            await sink.install.call_one(broken, False)
        assert info.value.exception_type.endswith("ManifestError")
        report = await sink.install.call_one(manifest, False)
        assert report["values"] == [3.0], "a refused manifest installs nothing; the good one still works"
    consumer = WeightInbox().consumer
    with pytest.raises(ManifestError):
        consumer.import_update(dataclasses.replace(manifest, handle=[1]))
    consumer.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_across_two_gpus_of_one_host(procs):
    sink = procs.spawn("sink", CudaSink, 64, "cuda:0").slice(procs=0)
    model = filled_model(4.0).to("cuda:1")
    with WeightPublisher("cuda-ipc", slots=2, device="cuda:1") as publisher:
        report = await sink.install.call_one(publisher.publish(model, 1), False)
        assert report["values"] == [4.0] and report["device"] == "cuda:0"
        with pytest.raises(ActorError, match="aliasing install needs the update on the model's device"):
            await sink.install.call_one(publisher.publish(model, 2), True)


async def test_a_gpus_mesh_gives_each_process_one_device(spawn):
    mesh = spawn(gpus=1)
    seen = await mesh.spawn("echo", Echo).getenv.call_one("CUDA_VISIBLE_DEVICES")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert seen == (visible.split(",")[0] if visible else "0")


async def test_an_async_publish_from_a_side_stream_copies_what_that_stream_wrote():
    """publish_async copies GPU tensors to the host on a worker thread, whose current stream is the device's
    default: it first waits for the work the caller queued on its own stream (before, it copied at once and could
    read the weights before the caller's optimizer step wrote them)."""
    from actors import WeightConsumer

    weights = torch.ones(1 << 20, device="cuda")  # 4 MiB: a host copy on a worker thread
    side = torch.cuda.Stream()
    consumer = WeightConsumer()
    with WeightPublisher("shm", slots=1) as publisher:
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)  # ~0.3 s of GPU time queued before the write
            weights.fill_(2.0)
            manifest = await publisher.publish_async({"w": weights}, 1)
        got = consumer.import_update(manifest)["w"]
        assert torch.all(got == 2.0), "the copy read the weights before the side stream wrote them"
        consumer.release(manifest.update_id)
    consumer.close()


async def test_an_async_cuda_ipc_publish_off_the_loop_holds_the_callers_stream_until_its_copy_is_done(procs):
    """A ``cuda-ipc`` publish with 1 MiB of host tensors runs its copy on a worker thread, whose current stream was
    the device's default: the copy's "later writes wait for me" was put on that stream, not the caller's, so the
    caller's next in-place step on its own stream could overwrite a GPU source before the copy read it (version v
    holding some of v+1). The worker thread now copies with the caller's streams current."""
    state = {"host": torch.zeros(1 << 20), "gpu": torch.ones(1 << 20, device="cuda")}  # 4 MiB on the host: off the loop
    side = torch.cuda.Stream()
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    with WeightPublisher("cuda-ipc", slots=1) as publisher:
        torch.cuda._sleep(1_000_000_000)  # the default stream busy (~0.6 s): before, the copy waited behind it
        with torch.cuda.stream(side):
            manifest = await publisher.publish_async(state, 1)
            state["gpu"].add_(1.0)  # the caller's next step, on its own stream: ordered after the copy
        got = await sink.sums.call_one(manifest)
    assert got == {"host": 0.0, "gpu": float(1 << 20)}, "the caller's step overwrote a source before the copy read it"


async def test_a_cuda_ipc_publish_of_host_tensors_copies_them_to_the_gpu_off_the_loop(procs):
    """A host-memory source (a trainer's reference weights) published over ``cuda-ipc`` is a pageable host to
    device copy, which holds its thread until done: ``publish_async`` runs it on a worker thread from 1 MiB (it
    ran on the loop: ~25 ms for 256 MiB at 10 GB/s), and the consumer installs exactly what was published."""
    from support import Heartbeat

    state = {f"w{i}": torch.full((8 * 1024 * 1024,), float(i)) for i in range(8)}  # 256 MiB in host memory
    sink = procs.spawn("sink", CudaSink).slice(procs=0)
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        await publisher.publish_async(state, 1)  # the slot's allocation, not measured
        async with Heartbeat() as beat:
            manifest = await publisher.publish_async(state, 2)
        assert beat.worst_stall < 0.1, f"the loop stalled during a 256 MiB host to device copy: {beat}"
        got = await sink.sums.call_one(manifest)
    assert got == {f"w{i}": float(i) * 8 * 1024 * 1024 for i in range(8)}
