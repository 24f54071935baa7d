"""The codec's shared vocabulary: msgpack extension codes, limits, and the registry of handle types.

Ports and actor meshes register themselves here (:func:`register_handle`)
so that both the encoder and the decoder know them without importing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

__all__ = [
    "EXT_DATACLASS",
    "EXT_DTYPE",
    "EXT_HANDLE",
    "EXT_OBJECT",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "INLINE_TENSOR_BYTES",
    "MAX_DEPTH",
    "MAX_PAYLOAD_BYTES",
    "TUPLE_EXT8",
    "ext",
    "ext_header",
    "handle_of_kind",
    "handle_of_type",
    "register_handle",
]

EXT_TUPLE = 1
EXT_TENSOR = 2
EXT_DATACLASS = 3
EXT_HANDLE = 4
EXT_DTYPE = 5
#: A function, lambda or class as cloudpickle: only in a session that opted in (``_code``).
EXT_CODE = 6
#: Any other object the codec has no record for, as cloudpickle: only in a session that opted in (``_code``).
EXT_OBJECT = 7

#: Tensors at most this many bytes travel inside the payload rather than as a frame.
INLINE_TENSOR_BYTES = 4096
#: Deepest nesting of tuples, dataclasses and handles inside one message.
MAX_DEPTH = 64
#: Largest payload frame a receiver accepts.
MAX_PAYLOAD_BYTES = 1 << 30


def ext_header(code: int, size: int) -> bytes:
    """The msgpack ext header for ``size`` bytes of extension ``code`` (ext 8/16/32 forms)."""
    if size < 1 << 8:
        return bytes((0xC7, size, code))
    if size < 1 << 16:
        return b"\xc8" + size.to_bytes(2, "big") + bytes((code,))
    return b"\xc9" + size.to_bytes(4, "big") + bytes((code,))


TUPLE_EXT8 = [ext_header(1, size) for size in range(256)]


def ext(code: int, data: bytes) -> msgpack.ExtType:
    """An ExtType without its validating Python-level constructor (our codes are valid)."""
    return tuple.__new__(msgpack.ExtType, (code, data))  # type: ignore[no-any-return]


class _Handle:
    __slots__ = ("cls", "from_state", "kind", "to_state")

    def __init__(self, kind: str, cls: type, to_state: Callable[[Any], Any], from_state: Callable[[Any], Any]):
        self.kind, self.cls, self.to_state, self.from_state = kind, cls, to_state, from_state


# The handle types (ports, actor meshes) registered by the modules that define them.
_handles_by_type: dict[type, _Handle] = {}
_handles_by_kind: dict[str, _Handle] = {}


def register_handle(kind: str, cls: type, to_state: Callable[[Any], Any], from_state: Callable[[Any], Any]) -> None:
    """Let instances of ``cls`` travel as ``to_state(obj)``, rebuilt by ``from_state``."""
    handle = _Handle(kind, cls, to_state, from_state)
    _handles_by_type[cls] = handle
    _handles_by_kind[kind] = handle


def handle_of_type(cls: type) -> _Handle | None:
    return _handles_by_type.get(cls)


def handle_of_kind(kind: str) -> _Handle | None:
    return _handles_by_kind.get(kind)
