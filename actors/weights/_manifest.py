"""The weight-update manifest, and the transports that carry its bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .._shared._errors import ManifestError, TransportBlocked
from ..tensors import TRANSPORTS, Reader, TensorSpec, Writer, distinct, probe
from ._spec_table import SpecTable

__all__ = ["WeightManifest", "available_transports", "make_reader", "make_writer"]


@dataclass(frozen=True)
class WeightManifest:
    """One complete weight update, small enough to send anywhere.

    ``handle`` is what the transport's reader needs (a segment name for
    ``shm``, a device slot's IPC handles for ``cuda-ipc``, the server's
    address and key for ``tcp``, the publishing pid for ``local``): plain
    values or a registered dataclass, so it decodes in any process.
    ``publisher_host`` is the publisher's :func:`~actors.host_id`: its pid
    means something only to consumers on the same host. ``table`` holds the
    tensors' specs as columns (:class:`SpecTable`: a few lists on the wire,
    not a record per tensor); :attr:`tensors` gives them as specs.
    """

    update_id: str
    version: int
    transport: str
    table: SpecTable
    handle: Any
    publisher_pid: int
    metadata: dict[str, Any] = field(default_factory=dict)
    publisher_host: str = ""

    def checked(self) -> WeightManifest:
        """This manifest, once its own fields have the types they must (:class:`ManifestError` if a peer's do not).

        The specs and the handle are checked where they are read (by the
        table and the transport); these are what everything else relies on:
        an id to release by, a version to order by, a pid to watch.
        """
        problems = [
            f"{name} must be {what}, not {value!r:.60}"
            for name, value, ok, what in (
                (
                    "update_id",
                    self.update_id,
                    type(self.update_id) is str and 0 < len(self.update_id) <= 256,
                    "a string of 1-256 characters",
                ),
                ("version", self.version, type(self.version) is int, "an int"),
                ("transport", self.transport, type(self.transport) is str, "a string"),
                (
                    "publisher_pid",
                    self.publisher_pid,
                    type(self.publisher_pid) is int and self.publisher_pid > 0,
                    "a positive int",
                ),
                ("metadata", self.metadata, type(self.metadata) is dict, "a dict"),
                ("publisher_host", self.publisher_host, type(self.publisher_host) is str, "a string"),
            )
            if not ok
        ]
        if problems:
            raise ManifestError(f"malformed weight manifest: {'; '.join(problems)}")
        return self

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        """The update's tensor specs, in its order (:class:`ManifestError` if its table is malformed)."""
        return self.checked_table().specs

    def checked_table(self) -> SpecTable:
        """The table, or :class:`ManifestError` if a peer sent something else in its place."""
        if type(self.table) is not SpecTable:
            raise ManifestError(f"update {self.update_id!r:.60} carries no tensor table")
        return self.table

    @property
    def total_nbytes(self) -> int:
        """The update's bytes: a tied tensor's are its twin's, counted once."""
        return sum(self.tensors[index].nbytes for index in distinct(self.tensors))

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.tensors]


def available_transports() -> dict[str, str]:
    """Each transport's status on this machine: ``"pass"`` or ``"blocked: <reason>"``."""
    return {name: "pass" if (reason := probe(name)) is None else f"blocked: {reason}" for name in TRANSPORTS}


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    reason = probe(transport)
    if reason is not None:
        raise TransportBlocked(transport, reason)


def make_writer(transport: str, options: dict[str, Any]) -> Writer:
    """The publisher side of ``transport``; ``options`` go to its constructor."""
    _check_transport(transport)
    if transport == "shm":
        from ..tensors.shm import ShmWriter

        return ShmWriter(**options)
    if transport == "cuda-ipc":
        from ..tensors.cuda_ipc import CudaIpcWriter

        return CudaIpcWriter(**options)
    if transport == "tcp":
        from ..tensors.tcp import TcpWriter

        return TcpWriter(**options)
    from ..tensors.local import LocalWriter

    if options:
        raise TypeError(f"the local transport takes no options, got {sorted(options)}")
    return LocalWriter()


def make_reader(transport: str) -> Reader:
    """The consumer side of ``transport``."""
    _check_transport(transport)
    if transport == "shm":
        from ..tensors.shm import ShmReader

        return ShmReader()
    if transport == "cuda-ipc":
        from ..tensors.cuda_ipc import CudaIpcReader

        return CudaIpcReader()
    if transport == "tcp":
        from ..tensors.tcp import TcpReader

        return TcpReader()
    from ..tensors.local import LocalReader

    return LocalReader()
