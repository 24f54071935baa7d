"""What a dataclass's constructor takes besides its fields: the init-only values (``InitVar``).

An init-only value is a constructor argument the instance does not keep, so
it cannot travel with the fields: the receiver's constructor gives it its
default, and a dataclass with one that has none cannot be rebuilt at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["init_only_values", "required_init_only"]


def init_only_values(cls: type) -> list[Any]:
    """The ``InitVar`` pseudo-fields of dataclass ``cls``, in declaration order (``dataclasses.fields`` omits them)."""
    kind = getattr(dataclasses, "_FIELD_INITVAR", None)
    declared = getattr(cls, "__dataclass_fields__", {})
    return [f for f in declared.values() if getattr(f, "_field_type", None) is kind]


def required_init_only(cls: type) -> str | None:
    """The name of an init-only value of ``cls`` without a default (the receiver could not call the constructor)."""
    for f in init_only_values(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return str(f.name)
    return None
