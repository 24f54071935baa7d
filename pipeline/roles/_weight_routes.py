"""Which transport carries the trainer's weights to each generator, chosen per pair of hosts.

A generator on the trainer's host gets the run's own transport (``shm`` or
``cuda-ipc``: shared memory, no copy over a wire); one on another host gets
``tcp``, the only one that crosses machines. Hosts are compared by
:func:`actors.host_id` (on a Ray cluster, the node). Generators on one host
form one *route*: a contiguous run of ranks the trainer sends an update to
with ``selection="choose"``, rotating over the routes step by step. Each
transport has its own publisher, and a version is published on a transport
only when a route that needs it is chosen.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from actors import WeightManifest, WeightPublisher

__all__ = ["Route", "WeightRoutes", "choose_transport"]

#: The transport for generators on other hosts.
CROSS_HOST = "tcp"


def choose_transport(local: str, trainer_host: str, generator_host: str) -> str:
    """The fastest transport that works between the two hosts: the run's own when they are one host."""
    return local if generator_host == trainer_host else CROSS_HOST


@dataclass(frozen=True)
class Route:
    """Generators ``first``..``last`` (inclusive ranks) share a host, so a transport."""

    transport: str
    first: int
    last: int
    host: str

    def describe(self) -> str:
        ranks = f"generator {self.first}" if self.first == self.last else f"generators {self.first}-{self.last}"
        where = "the trainer's host" if self.transport != CROSS_HOST else f"host {self.host[:24]}"
        return f"{ranks} ({where}): {self.transport}"


class WeightRoutes:
    """The trainer's publishers, one per transport in use, and the route each update takes."""

    def __init__(self, local: str, slots: int, dtype: torch.dtype | None = None, **options: Any) -> None:
        self.local = local
        self._slots = slots
        self._dtype = dtype  # the generators' weights: every publisher casts to it
        #: Bytes of the newest update published (its tensors, in the published dtype).
        self.update_bytes = 0
        self._options = options  # the local transport's (e.g. a cuda-ipc device)
        self._publishers: dict[str, WeightPublisher] = {}
        self._latest: dict[str, WeightManifest] = {}
        self._publishing = asyncio.Lock()  # two asks for one version (a step's and a rejoin's): one publish
        self.routes: list[Route] = []
        self._by_rank: list[str] = []
        self._turn = itertools.count()

    def plan(self, trainer_host: str, generator_hosts: list[str]) -> list[Route]:
        """Group the generators (in rank order) into routes, one per run of ranks on one host."""
        routes: list[Route] = []
        by_rank: list[str] = []
        for rank, host in enumerate(generator_hosts):
            transport = choose_transport(self.local, trainer_host, host)
            by_rank.append(transport)
            if routes and routes[-1].host == host:
                routes[-1] = Route(transport, routes[-1].first, rank, host)
            else:
                routes.append(Route(transport, rank, rank, host))
        self.routes, self._by_rank = routes, by_rank
        return routes

    def plan_local(self, generators: int) -> None:
        """Every generator on the trainer's host (the single-host run)."""
        self.plan("here", ["here"] * generators)

    def transport_of(self, rank: int) -> str:
        return self._by_rank[rank] if rank < len(self._by_rank) else self.local

    def next_route(self) -> Route:
        """The route of the next update: the routes take turns."""
        return self.routes[next(self._turn) % len(self.routes)]

    def transports(self) -> list[str]:
        """The transports the routes use (the local one before any plan), in a fixed order."""
        return sorted({route.transport for route in self.routes}) or [self.local]

    def published(self, transport: str, version: int) -> WeightManifest | None:
        """The manifest of ``version`` on ``transport`` if it is published already."""
        latest = self._latest.get(transport)
        return latest if latest is not None and latest.version == version else None

    def publisher(self, transport: str) -> WeightPublisher:
        publisher = self._publishers.get(transport)
        if publisher is None:
            options = self._options if transport == self.local else {}
            publisher = WeightPublisher(transport, slots=self._slots, dtype=self._dtype, **options)
            self._publishers[transport] = publisher
        return publisher

    def publish(
        self, transport: str, model: torch.nn.Module | dict[str, torch.Tensor], version: int, metadata: dict[str, Any]
    ) -> WeightManifest:
        """``version`` on ``transport`` (published once; later asks get the same manifest). Outside a loop."""
        latest = self._latest.get(transport)
        if latest is None or latest.version != version:
            latest = self._latest[transport] = self.publisher(transport).publish(model, version, metadata)
            self.update_bytes = latest.total_nbytes
        return latest

    async def publish_async(
        self, transport: str, model: torch.nn.Module | dict[str, torch.Tensor], version: int, metadata: dict[str, Any]
    ) -> WeightManifest:
        """:meth:`publish` on an event loop: waiting for a slot and large copies leave the loop running.

        Asks that overlap are taken in turn, so a second ask for the version
        being published gets the first's manifest.
        """
        async with self._publishing:
            latest = self._latest.get(transport)
            if latest is None or latest.version != version:
                publisher = self.publisher(transport)
                latest = self._latest[transport] = await publisher.publish_async(model, version, metadata)
                self.update_bytes = latest.total_nbytes
            return latest

    def close(self) -> None:
        for publisher in self._publishers.values():
            publisher.close()
        self._publishers.clear()
