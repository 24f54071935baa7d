"""The entropy bonus's coefficient: fixed, or stepped toward a target entropy (Skywork-OR1's adaptive control).

The loss subtracts ``coef x H``, ``H`` the mean entropy of the tokens the
policy term trains, so a positive coefficient keeps the policy from
collapsing onto near-deterministic outputs. With adaptive control (TRL's
``use_adaptive_entropy``) the coefficient moves by ``delta`` after every
optimiser step, up while that step's ``H`` is at or below ``target`` and
down otherwise, within ``[low, high]``; and it is applied only while the
last step's ``H`` was at or below the target, so a policy with entropy to
spare trains with no bonus at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["EntropyControl"]


@dataclass
class EntropyControl:
    """The coefficient of the entropy bonus one learner applies, and (adaptive) its state across steps."""

    coef: float = 0.0  # the coefficient; adaptive: its current value, moved after each optimiser step
    adaptive: bool = False
    target: float = 0.2  # adaptive: the mean token entropy (nats) at or below which the bonus applies and grows
    delta: float = 0.005  # adaptive: the coefficient's step
    low: float = 0.0  # adaptive: the coefficient's bounds
    high: float = 1.0
    last_entropy: float = math.inf  # adaptive: the last step's H (none yet: above any target, so no bonus)

    @property
    def active(self) -> bool:
        """Whether the loss needs a differentiable entropy at all (a fixed 0 never does)."""
        return self.adaptive or self.coef != 0

    def applied(self) -> float:
        """The coefficient this optimiser step's loss uses."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def observe(self, entropy: float) -> None:
        """After an optimiser step whose trained tokens' mean entropy was ``entropy``: move the coefficient."""
        if not self.adaptive:
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the coefficient and the last step's entropy."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`'s values."""
        self.coef = float(state["coef"])
        self.last_entropy = float(state["last_entropy"])
