"""A slot's tensors made once per layout: a publisher sends the same layout every update, and making a view per
tensor — hundreds of tensor operations, each microseconds on a GPU — was most of a small update's fixed cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import TensorSpec

__all__ = ["SlotViews"]


class SlotViews:
    """The views of one slot's storage for its ``keep`` most recent layouts.

    ``of(specs, make)`` gives the tensors ``specs`` describe, made by ``make``
    (one spec to one view) the first time a layout is seen in this slot and
    the same tensors after that. A reader passes ``check``, run on a layout
    it has not seen: a layout this slot already checked and made is the same
    values, so it is neither checked nor made again. The views live as long
    as the slot's storage does (its owner holds this), and a slot that grows
    is a new slot.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._made: dict[tuple[TensorSpec, ...], list[torch.Tensor]] = {}
        # the last specs asked for, held (so its id stays its own), and their views: a consumer passes the same
        # tuple while the layout holds, and hashing 145 specs each update was most of this lookup's time
        self._last: tuple[Sequence[TensorSpec], list[torch.Tensor]] | None = None

    def of(
        self,
        specs: Sequence[TensorSpec],
        make: Callable[[TensorSpec], torch.Tensor],
        check: Callable[[], object] | None = None,
    ) -> list[torch.Tensor]:
        last = self._last
        if last is not None and last[0] is specs and isinstance(specs, tuple):
            return last[1]
        key = tuple(specs)
        try:
            made = self._made.get(key)
        except TypeError:  # a malformed spec (an unhashable field): the check refuses it
            made, key = None, ()
        if made is not None:
            self._last = (specs, made)
            return made
        if check is not None:
            check()
        views = [make(spec) for spec in specs]
        if key:
            if len(self._made) >= self.keep:
                del self._made[next(iter(self._made))]
            self._made[key] = views
            self._last = (specs, views)
        return views

    def clear(self) -> None:
        self._made.clear()
        self._last = None
