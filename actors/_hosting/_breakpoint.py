"""``breakpoint()`` in an actor: an actor's process reads no terminal, so pdb there would quit at once.

A worker's stdin is ``/dev/null``: the default hook would start pdb, read
end-of-file and raise ``BdbQuit`` into the endpoint, failing the call for a
line a user left in to debug. In a worker, ``breakpoint()`` therefore logs
one warning per location and returns, unless ``PYTHONBREAKPOINT`` names a
debugger (``remote_pdb.set_trace``, say, which listens on a socket) or ``0``:
then Python's own hook runs, as anywhere else.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["WorkerBreakpoints"]

_log = logging.getLogger("actors.debug")


class WorkerBreakpoints:
    """The worker's ``sys.breakpointhook``: Python's hook when ``PYTHONBREAKPOINT`` is set, else a warning."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._warned: set[tuple[str, int]] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if os.environ.get("PYTHONBREAKPOINT"):
            return sys.__breakpointhook__(*args, **kwargs)
        frame = sys._getframe(1)
        where = (frame.f_code.co_filename, frame.f_lineno)
        if where not in self._warned:
            self._warned.add(where)
            _log.warning(
                "breakpoint() at %s:%d in process %s skipped: an actor's process has no terminal for pdb "
                "(set PYTHONBREAKPOINT to a debugger that listens on a socket, e.g. remote_pdb.set_trace)",
                where[0],
                where[1],
                self._name,
            )
        return None
