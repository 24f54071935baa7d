"""An update's tensor specs as columns: the form in which a manifest carries them between processes.

A manifest with one record per tensor cost the codec a nested record each,
and a tuple record each for its shape and its stride: for a 145-tensor
model, 0.44 ms to encode and 0.47 ms to decode on a 2-core machine, most of
a manifest's trip to a consumer. As columns (one plain list per field) the
whole table packs in msgpack's own C code; the specs are rebuilt, and
checked, once, where they are read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._shared._errors import ManifestError
from ..tensors import TensorSpec, check_specs

__all__ = ["SpecMemo", "SpecTable"]


@dataclass(frozen=True)
class SpecTable:
    """Every :class:`~actors.tensors.TensorSpec` of an update, field by field, in the update's order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    strides: list[list[int]]
    nbytes: list[int]
    offsets: list[int]
    checksums: list[int | None]

    @classmethod
    def of(cls, specs: Sequence[TensorSpec]) -> SpecTable:
        """The columns of ``specs``."""
        return cls(
            [spec.name for spec in specs],
            [spec.dtype for spec in specs],
            [list(spec.shape) for spec in specs],
            [list(spec.stride) for spec in specs],
            [spec.nbytes for spec in specs],
            [spec.offset for spec in specs],
            [spec.checksum for spec in specs],
        )

    @functools.cached_property
    def specs(self) -> tuple[TensorSpec, ...]:
        """The specs, rebuilt once (a reader checks each field, as for any manifest: ``check_specs``);
        :class:`ManifestError` for columns that are not lists of one length."""
        columns = (self.names, self.dtypes, self.shapes, self.strides, self.nbytes, self.offsets, self.checksums)
        if any(type(column) is not list for column in columns) or len({len(column) for column in columns}) != 1:
            raise ManifestError("a manifest's tensor table has columns of other types or lengths")
        return tuple(
            TensorSpec(name, dtype, _dims(shape), _dims(stride), size, offset, checksum)
            for name, dtype, shape, stride, size, offset, checksum in zip(*columns, strict=True)
        )


def _dims(values: Any) -> Any:
    """A shape or stride as the tuple a spec holds (anything else is left for ``check_specs`` to refuse)."""
    return tuple(values) if type(values) is list else values


class SpecMemo:
    """The specs of the last table rebuilt, given again for an equal table.

    A publisher's updates of one model carry the same table each time;
    comparing the columns (C-level list equality, ~15 us for 145 tensors)
    costs far less than rebuilding the specs (~2 us each). Only specs that
    pass the readers' checks are kept: equality holds across number types
    (``16 == 16.0``), and a peer's malformed table kept would be given back
    for every sound one equal to it, refusing each. (An equal table of other
    number types gets the sound specs: the same numbers.)
    """

    def __init__(self) -> None:
        self._table: SpecTable | None = None
        self._specs: tuple[TensorSpec, ...] = ()

    def specs(self, table: SpecTable) -> tuple[TensorSpec, ...]:
        """``table.specs``, or the last ones if ``table`` equals the last table."""
        if table == self._table:
            return self._specs
        specs = table.specs
        try:
            check_specs(specs, 1 << 62)  # (the types and layout; each reader checks them against its slot too)
        except ManifestError:
            return specs  # not kept: the reader refuses them, and the next table is rebuilt
        self._table, self._specs = table, specs
        return specs
