"""Weight work that runs off the event loop's thread: copies and checksum passes of 1 MiB or more, or over GPU memory.

Such work would hold the loop (a host copy of a large update, any copy out
of a GPU, which waits for it): ``publish_async`` and the consumer's async
imports run it on a worker thread, awaited to its end, after the GPU work
the caller queued on its own streams.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

__all__ = [
    "OFFLOAD_BYTES",
    "awaited_to_the_end",
    "on_a_gpu",
    "on_the_host",
    "to_thread_after_queued_work",
    "to_thread_to_the_end",
]

#: Host copies (or checksum passes) at least this large, or any out of a GPU, which waits for it, run on a worker
#: thread under ``publish_async`` and the consumer's async imports.
OFFLOAD_BYTES = 1 << 20


async def to_thread_to_the_end(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread; a cancelled caller still waits for it to finish.

    The copy writes into a reserved slot: the slot can only be given back
    once nothing writes into it any more.
    """
    return await awaited_to_the_end(asyncio.get_running_loop().run_in_executor(None, fn, *args))


async def awaited_to_the_end(future: asyncio.Future[Any]) -> Any:
    """``future``'s result, awaited until it is done even if the caller is cancelled meanwhile (then that is raised).

    A cancellation may land after the future finished but before this task
    resumed: it is still the caller's cancellation, and the result is dropped.
    """
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # the work failed: the caller's cancellation, if any, is still what it sees
            break
    if cancelled:
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what the caller sees
        raise asyncio.CancelledError
    return future.result()


def queued_work(tensors: list[tuple[str, torch.Tensor]]) -> tuple[Any, ...]:
    """An event on the current stream of each GPU ``tensors`` live on, recorded in the calling thread.

    A worker thread's current stream is its own (the device's default), not
    the caller's: a copy there is not ordered after an optimizer step the
    caller queued on a stream of its own, so it waits for these events first.
    """
    devices = {tensor.device for _, tensor in tensors if tensor.device.type == "cuda"}
    events = []
    for device in devices:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return tuple(events)


async def to_thread_after_queued_work(tensors: list[tuple[str, torch.Tensor]], fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread (to its end, as :func:`to_thread_to_the_end`), once the GPU work queued on
    this thread's streams for ``tensors`` is done, with those streams current there: what ``fn`` orders after
    itself on them (a device copy's event) binds the caller's later work, as it would on the caller's thread."""
    ready = queued_work(tensors)  # (recorded here: the caller's streams are this thread's)
    streams = callers_streams(tensors)

    def after() -> Any:
        for event in ready:
            event.synchronize()
        with contextlib.ExitStack() as current:
            for stream in streams:
                current.enter_context(torch.cuda.stream(stream))
            return fn(*args)

    return await to_thread_to_the_end(after)


def callers_streams(tensors: list[tuple[str, torch.Tensor]]) -> list[Any]:
    """The calling thread's current stream on each GPU ``tensors`` live on (a worker thread's would be the
    device's default: a copy's ``wait_event`` there leaves the caller's stream free to overwrite the sources)."""
    devices = {tensor.device for _, tensor in tensors if tensor.device.type == "cuda"}
    return [torch.cuda.current_stream(device) for device in devices]


def on_the_host(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether a device copy of ``tensors`` reads host memory (a pageable copy holds its thread until done)."""
    return any(tensor.device.type == "cpu" for _, tensor in tensors)


def on_a_gpu(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether a host copy of ``tensors`` waits for a GPU (its copy out of device memory synchronizes)."""
    return any(tensor.device.type == "cuda" for _, tensor in tensors)
