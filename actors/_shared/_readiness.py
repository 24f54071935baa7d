"""Whether one file descriptor is ready, for any descriptor number.

``select.select`` refuses descriptors numbered 1024 or more (``ValueError``),
which a process holding many files, sockets or device handles reaches;
``poll`` takes any.
"""

from __future__ import annotations

import math
import select
from typing import Protocol

__all__ = ["fd_ready"]


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


def fd_ready(fd: int | _HasFileno, *, write: bool = False, timeout: float = 0.0) -> bool:
    """Whether ``fd`` is readable (or, with ``write``, writable), waiting up to ``timeout`` s on this thread.

    An error or hang-up on it counts as ready, as with ``select``: the read
    or write that follows says which.
    """
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout * 1000))))
