"""Data-parallel training over trainer ranks: each rank trains its share of a rollout's rows, gradients summed.

Every pass's loss is its share of the whole rollout's loss (the token
normaliser is the rollout's, not the rank's: :meth:`Task.loss` with
``rows``), so the ranks' gradients summed are the one-rank gradient, and
their reports add up to the one-rank report. The weights stay whole on every
rank (``--trainer-shard ddp``). torch's ``DistributedDataParallel`` is not
used: it syncs only through its own ``forward``, which a Hugging Face model
scored body and head apart (:class:`~pipeline.models.CompletionLogps`)
never calls; one ``all_reduce`` per bucket of gradients after the rank's
passes does the same sum.

The ranks join a ``torch.distributed`` process group (gloo on CPUs, NCCL on
GPUs) through a store that rank 0 serves on an address it hands out
(:class:`Rendezvous`, :class:`GroupAddress`), not through variables the user
sets. The store has no key, so the address comes with a secret token that
travels only through the session's authenticated calls: once the group has
formed, every rank shows it, and a group that a process outside the session
joined is refused. Every collective has the group's deadline: a rank that
died makes the others fail within it rather than wait for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import os
import secrets
import socket
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in its __all__, but its documented name

from actors import bind_host

from ..tasks import LossReport

__all__ = ["COLLECTIVE_TIMEOUT", "DataParallel", "GroupAddress", "RankShare", "Rendezvous"]

#: How long a rendezvous or a collective may wait for the other ranks (seconds).
COLLECTIVE_TIMEOUT = 60.0
#: Gradients summed per all_reduce, at most (bytes).
BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class RankShare:
    """Which rows of each rollout rank ``rank`` of ``world`` trains: a contiguous block, as even as the rows allow."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world}: need 0 <= rank < world, world >= 1")

    def block(self, rows: int, within: slice | None = None) -> tuple[int, int]:
        """The [start, stop) rows of ``rows`` (of the mini-batch ``within`` them, if given) that are this rank's."""
        first, last, _ = (within or slice(None)).indices(rows)
        size = last - first
        return first + self.rank * size // self.world, first + (self.rank + 1) * size // self.world

    def passes(self, slices: list[slice], rows: int | None, within: slice | None = None) -> list[slice]:
        """This rank's part of each pass in ``slices`` (over ``rows`` rows; of a mini-batch ``within`` them): no
        pass grows, none is empty."""
        if rows is None:
            raise ValueError("the task's samples have no rows to share out: give its rows() to train on several ranks")
        start, stop = self.block(rows, within)
        mine = []
        for part in slices:
            first, last, step = part.indices(rows)
            if step != 1:
                raise ValueError(f"a micro-batch must be a contiguous range of rows, not {part}")
            first, last = max(first, start), min(last, stop)
            if first < last:
                mine.append(slice(first, last))
        return mine


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface whose IPv4 address is ``address`` (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(answer[20:24]) == address:
            return name
    return None


def use_interface_of(host: str) -> None:
    """Make gloo connect over ``host``'s interface (``GLOO_SOCKET_IFNAME``) unless the user chose one.

    By default gloo uses the address this machine's name resolves to, which
    on a cluster may be loopback or an address the other ranks cannot reach;
    its process-group options cannot name a device. Loopback needs nothing.
    """
    if host.startswith("127.") or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    interface = interface_of(host)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks join a group (rank 0's store) and the token that shows a rank belongs to the session."""

    host: str
    port: int
    token: bytes

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Rendezvous:
    """Rank 0's store, on ``host`` at a port the OS chose, and a new token: the :class:`GroupAddress` to hand out.

    ``host`` is the address this process serves the session on (loopback on
    one machine, its cluster address on several): nothing else is bound.
    """

    def __init__(self, host: str, world: int, timeout: float = COLLECTIVE_TIMEOUT) -> None:
        self.store = TCPStore(
            host,
            0,
            world,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        self.address = GroupAddress(host, int(self.store.port), secrets.token_bytes(16))


class DataParallel:
    """This process as rank ``share.rank`` of a process group: its share of the rows, gradients and reports summed."""

    def __init__(
        self,
        share: RankShare,
        address: GroupAddress,
        device: torch.device,
        *,
        host: str | None = None,
        rendezvous: Rendezvous | None = None,
        timeout: float = COLLECTIVE_TIMEOUT,
    ) -> None:
        """Join the group at ``address`` (rank 0 passes the :class:`Rendezvous` it serves there); waits for every rank.

        ``host`` is the address this rank's gloo connections use (by default
        its session address, rank 0's too: :func:`use_interface_of`). Raises :class:`RuntimeError`, naming the rank, when the store
        cannot be reached, the other ranks do not come within ``timeout``
        seconds, or a rank of the group cannot show the address's token.
        """
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group: one trainer rank per process")
        if (share.rank == 0) != (rendezvous is not None):
            raise ValueError("rank 0, and only rank 0, serves the rendezvous")
        deadline = datetime.timedelta(seconds=timeout)
        self.share = share
        if device.type == "cuda":  # NCCL: one GPU per rank, this process's current one, bound before the group
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            torch.cuda.set_device(device)
        self.device = device
        self._rendezvous = rendezvous  # rank 0's store lives as long as the group
        who = f"trainer rank {share.rank} of {share.world}"
        try:
            store = (
                rendezvous.store
                if rendezvous is not None
                else TCPStore(address.host, address.port, share.world, is_master=False, timeout=deadline)
            )
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "gloo":
                use_interface_of(host if host is not None else bind_host())
            bound = device if backend == "nccl" else None  # NCCL's communicator made now, on this GPU
            dist.init_process_group(
                backend, store=store, rank=share.rank, world_size=share.world, timeout=deadline, device_id=bound
            )
        except (RuntimeError, OSError) as exc:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            raise RuntimeError(
                f"{who}: the group at {address} did not form within {timeout:g} s "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r})"
            ) from exc
        strangers = self._strangers(address.token)
        if strangers:
            dist.destroy_process_group()
            raise RuntimeError(
                f"{who}: rank(s) {', '.join(map(str, strangers))} of the group at {address} did not show the "
                "session's token: a process outside the session joined the group; refused"
            )

    def _strangers(self, token: bytes) -> list[int]:
        """The ranks whose digest of the group's token differs from this rank's (a collective)."""
        digest = torch.tensor(list(hashlib.sha256(token).digest()), dtype=torch.uint8, device=self.device)
        shown = [torch.empty_like(digest) for _ in range(self.share.world)]
        dist.all_gather(shown, digest)
        return [rank for rank, other in enumerate(shown) if not torch.equal(other, digest)]

    def passes(self, slices: list[slice], rows: int | None, within: slice | None = None) -> list[slice]:
        """This rank's passes of a rollout of ``rows`` rows (a mini-batch ``within`` them) one rank would train in
        ``slices``."""
        return self.share.passes(slices, rows, within)

    def idle_passes(self, slices: list[slice], rows: int | None, within: slice | None = None) -> list[slice]:
        """Passes counted zero that this rank must run to keep in step: none, as a replica syncs only after its passes."""
        return []

    def whole_root(self) -> contextlib.AbstractContextManager[None]:
        """The policy as a whole, for code that runs it outside the loss: a replica's always is."""
        return contextlib.nullcontext()

    def sum_gradients(self, module: torch.nn.Module) -> None:
        """Every trainable parameter's gradient summed over the ranks: one some rank lacks counts as zeros there,
        one that no rank has stays None (as in one learner, whose optimizer then skips the parameter: Adam
        would move a zero gradient's parameter along its momentum)."""
        trainable = [parameter for parameter in module.parameters() if parameter.requires_grad]
        had = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32, device=self.device)
        dist.all_reduce(had)  # (the same on every rank, so every rank sums the same parameters in the same buckets)
        grads = []
        for parameter, anywhere in zip(trainable, had.tolist(), strict=True):
            if anywhere:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                grads.append(parameter.grad)
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            if bucket and (grad.dtype != bucket[0].dtype or size + grad.numel() * grad.element_size() > BUCKET_BYTES):
                self._sum(bucket)
                bucket, size = [], 0
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
        if bucket:
            self._sum(bucket)

    def _sum(self, bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([grad.reshape(-1) for grad in bucket])
        dist.all_reduce(flat)
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective: every rank calls it, and gets the same answer)."""
        count = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(count)
        return bool(count.item())

    def sum_report(self, report: LossReport | None) -> LossReport:
        """The whole rollout's report: the ranks' shares added (a rank with no rows adds nothing)."""
        mine = report if report is not None else LossReport.nothing(self.device)
        figures = mine.figures()
        flat = torch.tensor([float(mine.loss.detach()), *figures], dtype=torch.float64, device=self.device)
        dist.all_reduce(flat)
        total = flat.tolist()
        return LossReport.from_figures(torch.tensor(total[0], device=mine.loss.device), total[1:])

    def close(self) -> None:
        """Leave the group (every rank calls it)."""
        if dist.is_initialized():
            dist.destroy_process_group()
