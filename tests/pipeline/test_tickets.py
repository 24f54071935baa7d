"""The ticket ledger that makes ``--max-staleness`` hold: a rollout is granted for the step that trains it."""

from __future__ import annotations

import pytest

from pipeline.roles import Tickets


def test_tickets_go_round_robin_with_their_oldest_allowed_version():
    tickets: Tickets[str] = Tickets(generators=2, credits=4, staleness=1)
    assert tickets.grant() == [0, 1, 2, 3]
    assert [tickets.owner(t) for t in range(4)] == [0, 1, 0, 1]
    assert [tickets.min_version(t) for t in range(4)] == [0, 0, 1, 2]
    assert tickets.grant() == [], "no credit left until a rollout is trained"


def test_a_credit_comes_back_when_a_rollout_is_trained_not_when_it_arrives():
    tickets: Tickets[str] = Tickets(generators=2, credits=2, staleness=0)
    tickets.grant()
    assert tickets.arrived(0, "r0")
    assert tickets.grant() == [], "arrived is not trained"
    assert tickets.next_ready() == "r0"
    tickets.trained()
    assert tickets.grant() == [2]


def test_rollouts_are_trained_in_ticket_order():
    tickets: Tickets[str] = Tickets(generators=2, credits=3, staleness=2)
    tickets.grant()
    assert tickets.arrived(1, "r1") and tickets.next_ready() is None, "ticket 0 comes first"
    assert tickets.waiting() == 1
    assert tickets.arrived(0, "r0") and tickets.next_ready() == "r0"
    tickets.trained()
    assert tickets.next_ready() == "r1"


def test_the_lag_of_every_trained_rollout_is_within_the_bound():
    """Simulated: generators draw with exactly their ticket's oldest allowed version, the worst case."""
    for staleness in range(4):
        tickets: Tickets[int] = Tickets(generators=3, credits=6, staleness=staleness)
        version = 0
        lags = []
        for _ in range(50):
            for ticket in tickets.grant():
                needed = tickets.min_version(ticket)
                if needed <= version:  # drawable now, with the oldest version allowed
                    tickets.arrived(ticket, needed)
            while (drawn := tickets.next_ready()) is None:  # the rest wait for their version to be published
                ready = [t for t in tickets.open if tickets.min_version(t) <= version]
                assert ready, "deadlock: the next ticket can never be drawn"
                tickets.arrived(ready[0], tickets.min_version(ready[0]))
            lags.append(version - drawn)
            version += 1
            tickets.trained()
        assert max(lags) == staleness and min(lags) >= 0


def test_weights_go_to_the_generators_whose_tickets_need_them():
    tickets: Tickets[str] = Tickets(generators=2, credits=4, staleness=1)
    opened = tickets.grant()
    assert [tickets.needs_weights(t, version=0) for t in opened] == [True, True, False, False]
    tickets.sent(0, 0)
    tickets.sent(1, 0)
    assert tickets.lacking(0) == []
    assert tickets.lacking(1) == [0], "ticket 2 (generator 0) may be drawn from version 1"
    tickets.sent(0, 1)
    assert tickets.lacking(2) == [1]
    assert tickets.lacking(1) == []


def test_a_restarted_generator_gets_its_open_tickets_again_and_duplicates_are_refused():
    tickets: Tickets[str] = Tickets(generators=2, credits=4, staleness=1)
    tickets.grant()
    tickets.sent(0, 0)
    assert tickets.arrived(0, "r0")
    assert tickets.restarted(0) == [2], "ticket 0 arrived; ticket 2 must be drawn again"
    assert tickets.needs_weights(2, version=1), "it restarted without weights"
    assert tickets.arrived(2, "new r2") and not tickets.arrived(2, "old r2"), "the second copy is dropped"
    assert not tickets.arrived(7, "never granted")


def test_grants_stop_at_the_last_step_and_resume_from_a_checkpointed_one():
    tickets: Tickets[str] = Tickets(generators=2, credits=4, staleness=1, first=98)
    assert tickets.grant(limit=100) == [98, 99]
    assert tickets.min_version(98) == 97


def test_impossible_ledgers_are_refused():
    with pytest.raises(ValueError, match="staleness >= 0"):
        Tickets(generators=2, credits=2, staleness=-1)


async def test_a_restarted_generator_gets_its_open_tickets_before_any_new_one():
    """Its re-grants wait for the weights (a publish holds them); a ticket the next step opens for it needs none
    yet, and went out first: the generator, taking grants in order, then waited for a version only the older
    ticket could bring about (ten minutes, then a failure). The trainer's grants go out one batch at a time."""
    import asyncio
    import types

    from pipeline.roles import Trainer

    class GrantPort:
        def __init__(self) -> None:
            self.tickets: list[int] = []

        def send(self, grant: object) -> None:
            self.tickets.append(grant.ticket)  # type: ignore[attr-defined]

    trainer = Trainer.__new__(Trainer)
    trainer.config = types.SimpleNamespace(steps=100)  # type: ignore[assignment]
    trainer.tickets = Tickets(generators=2, credits=6, staleness=2)
    trainer.routes = types.SimpleNamespace(transport_of=lambda generator: "shm")  # type: ignore[assignment]
    trainer.version = 0
    trainer._weights, trainer._granting = asyncio.Lock(), asyncio.Lock()

    async def publish(transport: str) -> None:
        return None  # (a manifest: its contents do not matter here)

    trainer._publish = publish  # type: ignore[method-assign]
    trainer.grants = [GrantPort(), GrantPort()]  # type: ignore[list-item]
    await trainer.grant_open_tickets()
    assert [port.tickets for port in trainer.grants] == [[0, 2, 4], [1, 3, 5]]  # type: ignore[attr-defined]
    tickets = trainer.tickets
    for ticket in (0, 1):  # both arrive; generator 1 dies after sending ticket 1
        assert tickets.arrived(ticket, f"r{ticket}")
    tickets.next_ready()
    tickets.trained()
    trainer.version = 1
    await trainer.grant_open_tickets()  # ticket 6, generator 0's
    restarted = GrantPort()
    async with trainer._weights:  # a publish in progress
        rejoining = asyncio.ensure_future(trainer.generator_restarted(1, restarted))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # (one turn: it waits for the weights to re-grant ticket 3)
        tickets.next_ready()
        tickets.trained()
        trainer.version = 2
        opening = asyncio.ensure_future(trainer.grant_open_tickets())  # ticket 7, generator 1's: needs no weights
        await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(rejoining, opening), 10)
    assert restarted.tickets == [3, 5, 7], "a generator's grants go out in ticket order"
