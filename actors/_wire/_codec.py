"""The codec, in one import: msgpack for plain values, tensors, dataclasses and handles.

The :class:`Encoder` (``_encoder``) and :class:`Decoder` (``_decoder``) share
the extension codes, limits and handle registry of ``_ext``. Decoding builds
only plain values, tensors, registered handles (ports, meshes) and instances
of dataclasses whose class is already loaded in this process; it never
imports a module and never unpickles, and every decode is bounded in size
and depth. Large tensors travel as separate zero-copy frames; small ones
inline.
"""

from __future__ import annotations

from ._decoder import Decoder, WholeBatch
from ._encoder import Encoder
from ._ext import (
    EXT_DATACLASS,
    EXT_DTYPE,
    EXT_HANDLE,
    EXT_TENSOR,
    EXT_TUPLE,
    INLINE_TENSOR_BYTES,
    MAX_DEPTH,
    MAX_PAYLOAD_BYTES,
    register_handle,
)

__all__ = [
    "EXT_DATACLASS",
    "EXT_DTYPE",
    "EXT_HANDLE",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "INLINE_TENSOR_BYTES",
    "MAX_DEPTH",
    "MAX_PAYLOAD_BYTES",
    "Decoder",
    "Encoder",
    "WholeBatch",
    "register_handle",
]
