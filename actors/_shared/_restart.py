"""Restart policies: when a proc mesh replaces a dead process, and how often it may."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["RestartBudget", "RestartMode", "RestartPolicy"]

#: ``never``: a dead process stays dead. ``on-failure``: it is replaced at its address.
RestartMode = Literal["never", "on-failure"]
RESTART_MODES: tuple[str, ...] = get_args(RestartMode)


@dataclass(frozen=True)
class RestartPolicy:
    """When a proc mesh restarts a dead process: ``on-failure``, at most ``max_restarts`` per ``period`` s."""

    restart: RestartMode = "never"
    max_restarts: int = 3
    period: float = 60.0

    def __post_init__(self) -> None:
        if self.restart not in RESTART_MODES:
            raise ValueError(f"restart must be one of {RESTART_MODES}, not {self.restart!r}")
        if type(self.max_restarts) is not int or self.max_restarts < 1:
            raise ValueError(f"max_restarts must be a positive int, not {self.max_restarts!r}")
        if not self.period > 0:
            raise ValueError(f"the restart period must be positive, not {self.period!r}")


class RestartBudget:
    """The restarts a policy still allows: a sliding window of recent restart times."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: collections.deque[float] = collections.deque()

    def take(self) -> bool:
        """Whether one more restart is allowed now (and count it if so)."""
        policy = self.policy
        if policy.restart != "on-failure":
            return False
        now = time.monotonic()
        while self._times and now - self._times[0] > policy.period:
            self._times.popleft()
        if len(self._times) >= policy.max_restarts:
            return False
        self._times.append(now)
        return True

    def give_back(self) -> None:
        """The restart last counted did not happen (no process could be started): it costs nothing."""
        if self._times:
            self._times.pop()

    def refusal(self) -> str:
        """Why the last restart was refused, for the failure record."""
        policy = self.policy
        if policy.restart != "on-failure":
            return ""
        return f"; not restarted: {policy.max_restarts} restarts within {policy.period:g}s already"
