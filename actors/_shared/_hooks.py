"""Named, typed hooks: how a part tells the parts above it that something happened, without knowing them.

A class that announces events owns a :class:`Hook` per event, named for
it (``registry.deaths``, ``inbox.handled``); whoever wants to hear calls
``connect`` with a function of the hook's signature, which mypy checks.
So who listens to what is found by the hook's name, and nothing assigns a
callback into another object's attributes. A listener that raises is
logged; it never reaches the announcer or the other listeners.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, ParamSpec

__all__ = ["Hook"]

log = logging.getLogger("actors")

P = ParamSpec("P")


class Hook(Generic[P]):
    """One event's listeners, called in the order they connected."""

    __slots__ = ("_listeners", "what")

    def __init__(self, what: str) -> None:
        #: What the event is, for the log line when a listener fails.
        self.what = what
        self._listeners: tuple[Callable[P, object], ...] = ()

    def connect(self, listener: Callable[P, object]) -> None:
        """Call ``listener`` with each later event."""
        self._listeners = (*self._listeners, listener)

    def disconnect(self, listener: Callable[P, object]) -> None:
        """Stop calling ``listener`` (a listener not connected is a ``ValueError``)."""
        listeners = list(self._listeners)
        listeners.remove(listener)
        self._listeners = tuple(listeners)

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Announce the event to every listener connected now."""
        for listener in self._listeners:
            try:
                listener(*args, **kwargs)
            except Exception:
                log.exception("a listener of %s failed", self.what)
