"""Lifelines between the controller and node hosts (no Ray needed: both ends in this process)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from harness import wait_for

from actors._processes._lifeline import Lifelines, hold

GUARD = 10.0  # a guard against hangs, never a synchronisation


@pytest.fixture
def lifelines():
    lines = Lifelines("127.0.0.1")
    yield lines
    lines.close()


def reporter() -> tuple[list[tuple[int, str]], threading.Event, object]:
    lost: list[tuple[int, str]] = []
    seen = threading.Event()

    def on_lost(index: int, why: str) -> None:
        lost.append((index, why))
        seen.set()

    return lost, seen, on_lost


def test_a_node_whose_line_closes_is_reported_lost_with_its_index(lifelines):
    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    cut_0 = hold(lifelines.address, lifelines.key, 0, lambda why: None)
    cut_3 = hold(lifelines.address, lifelines.key, 3, lambda why: None)
    cut_3()  # as when the node host's process dies: the kernel closes its end
    assert seen.wait(GUARD)
    assert lost == [(3, "its lifeline to the controller closed")]
    cut_0()


def test_losses_before_anyone_watches_are_kept_and_reported(lifelines):
    cut = hold(lifelines.address, lifelines.key, 1, lambda why: None)
    cut()
    lost, _, on_lost = reporter()
    assert wait_for(lambda: lifelines._early, timeout=GUARD)  # type: ignore[attr-defined]
    lifelines.watch(on_lost)
    assert lost == [(1, "its lifeline to the controller closed")]


def test_a_line_without_the_key_counts_for_nothing(lifelines):
    """An impostor cannot pass as a node, and its leaving loses no node."""
    lost, seen, on_lost = reporter()
    lifelines.watch(on_lost)
    cut = hold(lifelines.address, os.urandom(32), 0, lambda why: None)
    cut()
    real = hold(lifelines.address, lifelines.key, 2, lambda why: None)
    real()
    assert seen.wait(GUARD)
    assert lost == [(2, "its lifeline to the controller closed")]


def test_the_node_side_hears_when_the_controller_goes():
    lines = Lifelines("127.0.0.1")
    gone = threading.Event()
    why: list[str] = []

    def on_lost(reason: str) -> None:
        why.append(reason)
        gone.set()

    cut = hold(lines.address, lines.key, 0, on_lost)
    lines.close()  # as when the controller dies
    assert gone.wait(GUARD)
    assert why == ["the controller's lifeline closed"]
    cut()


def test_a_closer_called_first_means_no_report():
    lines = Lifelines("127.0.0.1")
    reported: list[str] = []
    cut = hold(lines.address, lines.key, 0, reported.append)
    cut()
    lines.close()
    assert reported == []


def test_an_unreachable_controller_fails_the_node_host_at_once():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        hold(("127.0.0.1", port), os.urandom(32), 0, lambda why: None)
