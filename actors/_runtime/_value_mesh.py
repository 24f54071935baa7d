"""``ValueMesh``, ``Point`` and ``Extent``: results laid out over a mesh's shape.

A mesh has an *extent*: named dimensions with sizes, e.g. ``{"gpus": 4}``;
ranks number its points in row-major order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, TypeVar

from .._shared._errors import DecodeError
from .._wire._ext import register_handle

R = TypeVar("R")

__all__ = ["Extent", "Point", "Shaped", "ValueMesh", "split_extent"]


def coordinates(rank: int, extent: Mapping[str, int]) -> dict[str, int]:
    """Row-major coordinates of ``rank`` within ``extent``."""
    coords: dict[str, int] = {}
    for dim, size in reversed(list(extent.items())):
        coords[dim] = rank % size
        rank //= size
    return dict(reversed(list(coords.items())))


def _index(dim: str, value: object) -> int:
    """A coordinate as an int (any integer type: numpy's too), or ``TypeError`` naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{dim}={value!r}: a coordinate is an integer or a slice")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{dim}={value!r}: a coordinate is an integer or a slice") from None


def rank_of(coords: Mapping[str, int], extent: Mapping[str, int]) -> int:
    rank = 0
    for dim, size in extent.items():
        index = _index(dim, coords[dim])
        if not 0 <= index < size:
            raise IndexError(f"{dim}={index} is outside 0..{size - 1}")
        rank = rank * size + index
    return rank


def select(extent: Mapping[str, int], coords: Mapping[str, int | slice]) -> tuple[list[int], dict[str, int]]:
    """The ranks of ``extent`` at ``coords`` and the extent they form (an index drops its dimension)."""
    unknown = set(coords) - set(extent)
    if unknown:  # a TypeError, as Monarch's slice() raises: a keyword the mesh does not take
        raise TypeError(f"unknown dimension(s) {sorted(unknown)}; mesh has {list(extent)}")
    ranges: dict[str, list[int]] = {}
    kept: dict[str, int] = {}
    for dim, size in extent.items():
        sel = coords.get(dim, slice(None))
        if isinstance(sel, slice):
            step = None if sel.step is None else _index(dim, sel.step)
            if step is not None and step < 1:
                raise ValueError(f"{dim}={sel!r}: a mesh slice keeps its ranks' order, so its step is positive")
            ranges[dim] = list(range(size))[sel]
            kept[dim] = len(ranges[dim])
        else:
            index = _index(dim, sel)
            if not 0 <= index < size:  # (as in Monarch: a negative index does not count from the end)
                raise IndexError(f"{dim}={index} is outside 0..{size - 1}")
            ranges[dim] = [index]
    chosen = {dim: set(indices) for dim, indices in ranges.items()}
    ranks = [
        r for r in range(math.prod(extent.values())) if all(c in chosen[d] for d, c in coordinates(r, extent).items())
    ]
    return ranks, kept


def flattened(extent: Mapping[str, int], dim: str) -> dict[str, int]:
    """``extent`` as one dimension named ``dim`` (row-major order is kept)."""
    if not isinstance(dim, str) or not dim:
        raise TypeError(f"flatten() takes a dimension name, not {dim!r}")
    return {dim: math.prod(extent.values())}


def split_extent(extent: Mapping[str, int], changes: Mapping[str, object]) -> dict[str, int]:
    """``extent`` with dimensions split into several (Monarch's ``split``): ranks keep their row-major order.

    ``changes`` maps an existing dimension to the names it becomes (a
    sequence, e.g. ``host=("dp", "pp")``), and a new name to its size
    (``pp=4``); in each split, at most one new size is left out, inferred.
    A split of one name is a rename.
    """
    splits: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for key, value in changes.items():
        if key in extent:
            if isinstance(value, str) or not isinstance(value, Sequence) or not value:
                raise ValueError(f"{key}={value!r}: an existing dimension splits into a sequence of new names")
            if not all(isinstance(name, str) and name for name in value):
                raise ValueError(f"{key}={value!r}: the new dimensions' names are non-empty strs")
            splits[key] = list(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: {key!r} is no dimension of {list(extent)}, so it is a new one's size")
        else:
            sizes[key] = value
    result: dict[str, int] = {}
    for dim, size in extent.items():
        names = splits.get(dim, [dim])
        unknown = [name for name in names if name not in sizes]
        if len(unknown) > 1:
            raise ValueError(f"{dim} -> {tuple(names)}: give the size of all but one of {tuple(unknown)}")
        known = math.prod(sizes[name] for name in names if name in sizes)
        if unknown:
            sizes[unknown[0]], left = divmod(size, known)
            if left:
                raise ValueError(
                    f"dimension {dim!r} of size {size} cannot split into {tuple(names)}: {known} does not divide it"
                )
        elif known != size:
            raise ValueError(f"dimension {dim!r} of size {size} cannot split into sizes that multiply to {known}")
        for name in names:
            if name in result:
                raise ValueError(f"dimension {name!r} appears twice")
            result[name] = sizes.pop(name)
    if sizes:
        raise ValueError(f"sizes given for no split's dimension: {sorted(sizes)}")
    return result


class Extent(dict[str, int]):
    """A mesh's shape: its dimensions' labels and sizes, in order (Monarch's ``Extent(labels, sizes)``).

    A ``dict`` of each dimension's size too, so code that compares, copies
    or JSON-dumps a mesh's extent as the plain dict it once was still works.
    """

    __slots__ = ()

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]) -> None:
        labels, sizes = list(labels), list(sizes)
        if len(labels) != len(sizes) or len(set(labels)) != len(labels):
            raise ValueError(f"an extent needs distinct labels, one per size: {labels!r}, {sizes!r}")
        if any(type(size) is not int or size < 0 for size in sizes):
            raise ValueError(f"an extent's sizes are non-negative ints, not {sizes!r}")
        super().__init__(zip(labels, sizes, strict=True))

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> Extent:
        """The extent whose dimensions and sizes ``sizes`` maps, in its order."""
        return cls(list(sizes), list(sizes.values()))

    @property
    def labels(self) -> list[str]:
        return list(self)

    @property
    def sizes(self) -> list[int]:
        return list(self.values())

    @property
    def nelements(self) -> int:
        """How many points the mesh has."""
        return math.prod(self.values())

    def __repr__(self) -> str:
        return f"Extent({self.labels!r}, {self.sizes!r})"

    def __str__(self) -> str:
        return str(dict(self))


def _size_of(extent: Mapping[str, int], dims: str | Sequence[str] | None) -> int:
    if dims is None:
        return math.prod(extent.values())
    if isinstance(dims, str):
        if dims not in extent:
            raise KeyError(f"no dimension {dims!r}; the mesh has {list(extent)}")
        return extent[dims]
    return math.prod(_size_of(extent, dim) for dim in dims)


class Shaped:
    """What every mesh says of its shape, as Monarch's meshes do: ``extent``, ``sizes``, ``size(dims)``."""

    __slots__ = ()

    _extent: dict[str, int]  # its dimensions and their sizes, in order (each mesh keeps its own)

    @property
    def extent(self) -> Extent:
        """The mesh's shape (a mapping of its dimensions to their sizes, with ``labels`` and ``sizes``)."""
        return Extent.of(self._extent)

    @property
    def sizes(self) -> dict[str, int]:
        """Each dimension's size."""
        return dict(self._extent)

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """How many points: in all, or along ``dim`` (or the product along several)."""
        return _size_of(self._extent, dim)


class Point(Shaped, Mapping[str, int]):
    """One position in a mesh: its ``rank`` and its coordinates by dimension (the mesh's shape: ``extent``,
    ``size(label)``)."""

    __slots__ = ("_coords", "_extent", "rank")

    def __init__(self, rank: int, extent: Mapping[str, int]) -> None:
        self.rank = rank
        self._extent = dict(extent)
        self._coords = coordinates(rank, self._extent)

    def __getitem__(self, dim: str) -> int:
        return self._coords[dim]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        return f"Point(rank={self.rank}, {self._coords})"

    def __str__(self) -> str:
        """Monarch's form: ``{'hosts': 0/1, 'gpus': 1/2}`` (coordinate/size per dimension)."""
        inner = ", ".join(f"{dim!r}: {self._coords[dim]}/{size}" for dim, size in self._extent.items())
        return "{" + inner + "}"


class ValueMesh(Shaped, Generic[R]):
    """One value per actor of a mesh, e.g. the results of ``endpoint.call()``."""

    __slots__ = ("_extent", "_values")

    def __init__(self, extent: Mapping[str, int], values: list[R]) -> None:
        self._extent = dict(extent)
        self._values = values

    def get(self, rank: int) -> R:
        """The value at position ``rank`` of this mesh (row-major, from 0); outside it, ``ValueError`` as in
        Monarch (a negative rank does not count from the end)."""
        index = _index("rank", rank)
        if not 0 <= index < len(self._values):
            raise ValueError(f"rank {index} is outside this mesh's 0..{len(self._values) - 1}")
        return self._values[index]

    def item(self, **coords: int) -> R:
        """The value at ``coords`` (no coordinates needed for a mesh of one)."""
        if not coords:
            if len(self._values) != 1:
                raise ValueError(f"item() without coordinates needs a mesh of one, not {len(self._values)}")
            return self._values[0]
        missing = set(self._extent) - set(coords)
        extra = set(coords) - set(self._extent)
        if missing or extra:
            raise KeyError(f"expected coordinates for {sorted(self._extent)}, got {sorted(coords)}")
        return self._values[rank_of(coords, self._extent)]

    def slice(self, **coords: int | slice) -> ValueMesh[R]:
        """The values at ``coords`` (an index drops its dimension, a slice keeps it)."""
        ranks, extent = select(self._extent, coords)
        return ValueMesh(extent, [self._values[r] for r in ranks])

    def flatten(self, dim: str) -> ValueMesh[R]:
        """The same values along one dimension named ``dim``."""
        return ValueMesh(flattened(self._extent, dim), list(self._values))

    def split(self, **changes: object) -> ValueMesh[R]:
        """The same values with dimensions split (:func:`split_extent`: ``split(host=("dp", "pp"), pp=2)``)."""
        return ValueMesh(split_extent(self._extent, changes), list(self._values))

    def rename(self, **names: str) -> ValueMesh[R]:
        """The same values with dimensions renamed (``rename(host="dp")``)."""
        return self.split(**{old: (new,) for old, new in names.items()})

    def items(self) -> Iterator[tuple[Point, R]]:
        for rank, value in enumerate(self._values):
            yield Point(rank, self._extent), value

    def values(self) -> list[R]:
        """The values in rank order, as a list (Monarch's: ``sum(v)`` then ``len(v)`` both read it)."""
        return list(self._values)

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, rank: int) -> R:
        return self._values[rank]

    def __repr__(self) -> str:
        return f"ValueMesh({self._extent}, {self._values!r})"


def extent_from_wire(value: object, what: str) -> dict[str, int]:
    """An extent sent as ``[(dim, size), ...]`` (shared by points, actor meshes and proc meshes)."""
    if type(value) is not list or not all(
        type(e) is tuple and len(e) == 2 and type(e[0]) is str and type(e[1]) is int for e in value
    ):
        raise DecodeError(f"malformed {what} extent")
    return dict(value)


def _point_state(point: Point) -> list[object]:
    return [point.rank, list(point._extent.items())]


def _point_from_state(state: object) -> Point:
    if type(state) is not list or len(state) != 2 or type(state[0]) is not int:
        raise DecodeError("malformed point")
    return Point(state[0], extent_from_wire(state[1], "point"))


register_handle("point", Point, _point_state, _point_from_state)


def _extent_state(extent: Extent) -> list[object]:
    return list(extent.items())


def _extent_from_state(state: object) -> Extent:
    return Extent.of(extent_from_wire(state, "sent"))


def _value_mesh_state(mesh: ValueMesh[object]) -> list[object]:
    return [list(mesh._extent.items()), mesh._values]


def _value_mesh_from_state(state: object) -> ValueMesh[object]:
    if type(state) is not list or len(state) != 2 or type(state[1]) is not list:
        raise DecodeError("malformed value mesh")
    extent = extent_from_wire(state[0], "value mesh")
    if math.prod(extent.values()) != len(state[1]):
        raise DecodeError(f"a value mesh of extent {extent} holds {len(state[1])} values")
    return ValueMesh(extent, state[1])


register_handle("extent", Extent, _extent_state, _extent_from_state)
register_handle("value_mesh", ValueMesh, _value_mesh_state, _value_mesh_from_state)
