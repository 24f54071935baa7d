"""The trainer's weight routes: a transport per pair of hosts, one publish per version and transport."""

from __future__ import annotations

import asyncio

import torch

from pipeline.roles import Route, WeightRoutes, choose_transport


def test_generators_on_the_trainers_host_get_its_transport_and_others_tcp():
    routes = WeightRoutes("shm", slots=2)
    planned = routes.plan("a", ["a", "a", "b", "b", "a"])
    assert planned == [Route("shm", 0, 1, "a"), Route("tcp", 2, 3, "b"), Route("shm", 4, 4, "a")]
    assert [routes.transport_of(rank) for rank in range(5)] == ["shm", "shm", "tcp", "tcp", "shm"]
    assert routes.transports() == ["shm", "tcp"]
    assert [routes.next_route() for _ in range(4)] == [*planned, planned[0]]
    assert choose_transport("cuda-ipc", "a", "a") == "cuda-ipc"


async def test_asks_for_one_version_at_once_share_its_one_publish():
    """A step's round-robin publish and a restarted generator's rejoin may ask for the current version together:
    the second waits for the first's publish and gets its manifest (no second publish, no "in progress" error)."""
    routes = WeightRoutes("shm", slots=2)
    try:
        weights = {"w": torch.ones(1 << 20)}  # 4 MiB: the copy runs on a worker thread, so the two asks overlap
        first, second = await asyncio.gather(*(routes.publish_async("shm", weights, 1, {}) for _ in range(2)))
        assert first is second and first.version == 1
        assert routes.published("shm", 1) is first and routes.update_bytes == 4 << 20
        newer = await routes.publish_async("shm", {"w": torch.zeros(1 << 20)}, 2, {})
        assert newer.version == 2 and newer.update_id != first.update_id
    finally:
        routes.close()
