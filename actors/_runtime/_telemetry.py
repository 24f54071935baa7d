"""Monarch's telemetry names (``span``, ``traced``, ``get_meter``), recorded as log lines and in-process counts.

Monarch exports spans and metrics through its Rust runtime and
OpenTelemetry. Here a span is timed and logged at DEBUG level on the
``actors.telemetry`` logger when it ends (its name, the running actor if
any, its duration and whether it raised); ``get_meter()`` gives
OpenTelemetry's meter when the ``opentelemetry`` package is installed, and
otherwise a meter whose instruments keep their totals in this process
(``Counter.value``), so that code written for Monarch runs and its figures
can still be read.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar, overload

from ._core import process_state
from ._parts import Part

__all__ = ["LOCAL_METER", "Instrument", "Meter", "get_meter", "span", "traced"]

log = logging.getLogger("actors.telemetry")

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def span(name: str) -> Iterator[None]:
    """Time the block as a span called ``name``; logged at DEBUG level when it ends."""
    start = time.perf_counter()
    failed = ""
    try:
        yield
    except BaseException as exc:
        failed = f", raised {type(exc).__name__}"
        raise
    finally:
        log.debug("span %s: %.3f ms%s", name, (time.perf_counter() - start) * 1000, failed)


@overload
def traced(fn: Callable[P, R]) -> Callable[P, R]: ...


@overload
def traced(*, name: str) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def traced(fn: Callable[P, R] | None = None, *, name: str | None = None) -> Any:
    """Wrap a function (sync or async) in a :func:`span` named ``name`` (default: its ``__name__``)."""

    def wrap(f: Callable[P, R]) -> Callable[P, R]:
        label = name or f.__name__
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def run_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                with span(label):
                    return await f(*args, **kwargs)  # type: ignore[misc]

            return run_async  # type: ignore[return-value]

        @functools.wraps(f)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with span(label):
                return f(*args, **kwargs)

        return run

    return wrap if fn is None else wrap(fn)


class Instrument:
    """A counter, up-down counter, histogram or gauge that keeps what it was given, in this process."""

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind
        #: The sum of everything added (counters) or the last value recorded (histograms, gauges).
        self.value: float = 0.0
        self.count = 0

    def add(self, amount: float, attributes: dict[str, Any] | None = None) -> None:
        if self.kind == "counter" and amount < 0:
            raise ValueError(f"counter {self.name!r} only goes up; use an up-down counter")
        self.value += amount
        self.count += 1

    def record(self, value: float, attributes: dict[str, Any] | None = None) -> None:
        self.value = value
        self.count += 1

    set = record


class Meter:
    """Makes instruments by name (each name one instrument), like OpenTelemetry's meter."""

    def __init__(self) -> None:
        self.instruments: dict[str, Instrument] = {}

    def _get(self, name: str, kind: str) -> Instrument:
        found = self.instruments.get(name)
        if found is None:
            found = self.instruments[name] = Instrument(name, kind)
        return found

    def create_counter(self, name: str, unit: str = "", description: str = "") -> Instrument:
        return self._get(name, "counter")

    def create_up_down_counter(self, name: str, unit: str = "", description: str = "") -> Instrument:
        return self._get(name, "up_down_counter")

    def create_histogram(self, name: str, unit: str = "", description: str = "") -> Instrument:
        return self._get(name, "histogram")

    def create_gauge(self, name: str, unit: str = "", description: str = "") -> Instrument:
        return self._get(name, "gauge")


#: Kept on the process (``process_state().parts``): its in-memory meter.
LOCAL_METER: Part[Meter] = Part("meter", Meter)


def get_meter() -> Any:
    """OpenTelemetry's meter for ``actors`` if it is installed, else this process's in-memory :class:`Meter`."""
    try:
        from opentelemetry import metrics
    except ImportError:
        return process_state().parts.get(LOCAL_METER)
    return metrics.get_meter("actors")
