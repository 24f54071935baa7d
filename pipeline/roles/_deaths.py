"""Which of several calls failed because its process died: a death is named before the failures it caused."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from actors import ActorDied

__all__ = ["first_death"]


def _died(call: asyncio.Future[Any]) -> bool:
    return call.done() and not call.cancelled() and isinstance(call.exception(), ActorDied)


async def first_death(calls: Sequence[asyncio.Future[Any]], grace: float) -> asyncio.Future[Any] | None:
    """The first of ``calls`` that failed with ``ActorDied``, waiting up to ``grace`` s for one; None if none did.

    A peer's death often shows first as another failure (a closed port, a
    broken collective); its own ``ActorDied`` follows a moment later.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while True:
        for call in calls:
            if _died(call):
                return call
        pending = [call for call in calls if not call.done()]
        left = deadline - loop.time()
        if not pending or left <= 0:
            return None
        await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
