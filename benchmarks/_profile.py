"""Where a benchmark's step spends its time: the operators ``torch.profiler`` saw, busiest first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def python_hotspots(stats: Any, count: int, calls_of: int = 1) -> list[dict[str, Any]]:
    """The ``count`` Python functions of a ``cProfile.Profile`` that took the most own time, in ms per one of
    ``calls_of`` profiled calls (what a line-level profiler would blame)."""
    import pstats

    table = pstats.Stats(stats).stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [
        {
            "function": f"{path.rsplit('/', 2)[-1] if path != '~' else ''}:{line}({name})"[:120],
            "ms": round(own * 1e3 / calls_of, 3),
            "calls": calls // calls_of,
        }
        for (path, line, name), (_, calls, own, _, _) in rows
    ]


def top_operators(
    step: Callable[[], Any], device: torch.device, count: int, *, by: str = "device"
) -> list[dict[str, Any]]:
    """The ``count`` operators that took the most time in one call of ``step`` (self time: children not counted).

    ``by="device"`` ranks by GPU time (CPU time where ``device`` is not CUDA);
    ``by="cpu"`` by the host's time, which is what a launch-bound step spends.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    return busiest(prof, count, by="device" if cuda and by == "device" else "cpu")


def busiest(prof: Any, count: int, *, by: str = "cpu") -> list[dict[str, Any]]:
    """The ``count`` operators of a finished ``torch.profiler.profile`` that took the most self time: the
    device's (``by="device"``) or the host's (``by="cpu"``: torch operators and CUDA runtime calls)."""
    key = "self_device_time_total" if by == "device" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    return [
        {
            "op": e.key[:120],
            "ms": round(getattr(e, key) / 1e3, 2),
            "share": round(getattr(e, key) / total, 3),
            "calls": e.count,
        }
        for e in events[:count]
    ]
