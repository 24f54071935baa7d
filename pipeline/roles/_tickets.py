"""The trainer's ledger of granted rollouts: how ``--max-staleness`` holds by construction.

Every rollout is produced against a *ticket*: the number of the training
step that will train it. Ticket ``t`` goes to generator ``t mod N`` with a
minimum policy version ``t - K`` (K the staleness bound); the trainer trains
tickets in their order, so ticket ``t`` is trained at policy version ``t``
and its rollout, drawn with version ``t - K`` or newer, is at most K versions
behind. No rollout is generated to be dropped. At most ``credits`` tickets
are open (granted, not yet trained): training ticket ``t`` opens ``t +
credits``, so the credit comes back when a rollout is trained, not when it
arrives. A generator whose next ticket needs a version it has not been sent
gets that version when it is published (:meth:`Tickets.lacking`).

K = 0 is on-policy: each rollout is drawn with the weights of the step just
trained. A larger K lets generation overlap training by K steps.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Tickets"]

T = TypeVar("T")


class Tickets(Generic[T]):
    """Open tickets, rollouts that arrived before their turn, and the newest version sent to each generator."""

    def __init__(self, generators: int, credits: int, staleness: int, first: int = 0) -> None:
        if generators < 1 or credits < 1 or staleness < 0:
            raise ValueError(
                f"tickets need generators >= 1, credits >= 1, staleness >= 0, not {generators}, {credits}, {staleness}"
            )
        self.generators = generators
        self.credits = credits
        self.staleness = staleness
        self.next_to_train = first  # the ticket the trainer trains next (= the policy version then)
        self.next_to_grant = first
        self.open: dict[int, int] = {}  # ticket -> generator, granted and not arrived yet
        self._early: dict[int, T] = {}  # arrived before their turn
        self._sent = [-1] * generators  # newest version sent to each generator by name (grant or update)

    def owner(self, ticket: int) -> int:
        """The generator that produces ``ticket``."""
        return ticket % self.generators

    def min_version(self, ticket: int) -> int:
        """The oldest policy version ``ticket``'s rollout may be drawn with."""
        return max(0, ticket - self.staleness)

    def grant(self, limit: int | None = None) -> list[int]:
        """Open every ticket the credits allow (below ``limit``: the run's last step); the new tickets, in order."""
        opened = []
        end = self.next_to_train + self.credits
        if limit is not None:
            end = min(end, limit)
        while self.next_to_grant < end:
            ticket = self.next_to_grant
            self.open[ticket] = self.owner(ticket)
            self.next_to_grant += 1
            opened.append(ticket)
        return opened

    def needs_weights(self, ticket: int, version: int) -> bool:
        """Whether a grant of ``ticket`` made at policy ``version`` must bring the weights (its owner lacks them)."""
        needed = self.min_version(ticket)
        return needed <= version and self._sent[self.owner(ticket)] < needed

    def lacking(self, version: int) -> list[int]:
        """Generators with an open ticket that ``version`` allows and no version sent that allows it."""
        needed = [-1] * self.generators
        for ticket, generator in self.open.items():
            least = self.min_version(ticket)
            if least <= version:
                needed[generator] = max(needed[generator], least)
        return [g for g in range(self.generators) if needed[g] > self._sent[g]]

    def sent(self, generator: int, version: int) -> None:
        """``version`` went to ``generator`` (in a grant, or as a targeted update)."""
        self._sent[generator] = max(self._sent[generator], version)

    def arrived(self, ticket: int, item: T) -> bool:
        """File a rollout that arrived; False if it is not wanted (a duplicate after a restart, or unknown)."""
        if ticket not in self.open:
            return False
        del self.open[ticket]
        self._early[ticket] = item
        return True

    def next_ready(self) -> T | None:
        """The rollout of the ticket to train next, once it has arrived (None until then)."""
        return self._early.pop(self.next_to_train, None)

    def trained(self) -> None:
        """The ticket :meth:`next_ready` gave was trained: its credit comes back."""
        self.next_to_train += 1

    def restarted(self, generator: int) -> list[int]:
        """``generator`` restarted with nothing: it has no weights, and its open tickets must be produced again."""
        self._sent[generator] = -1
        return sorted(ticket for ticket, owner in self.open.items() if owner == generator)

    def waiting(self) -> int:
        """Rollouts that arrived before their turn."""
        return len(self._early)
