"""msgpack encoding of messages: plain values, tensors, dataclasses and handles.

Large tensors travel as separate zero-copy frames, small ones inline; a
dataclass travels as its class's qualified name and the values of all its
fields (those its constructor does not take too); a port or an actor mesh
as its registered handle state.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import msgpack
import torch

from .._shared._errors import EncodeError
from . import _refs
from ._buffers import DTYPE_NAMES, tensor_buffer
from ._code import CODE_ENV, code_allowed, is_code, pickle_code, pickle_object, refusal
from ._dataclasses import required_init_only
from ._ext import (
    EXT_CODE,
    EXT_DATACLASS,
    EXT_DTYPE,
    EXT_HANDLE,
    EXT_OBJECT,
    EXT_TENSOR,
    EXT_TUPLE,
    INLINE_TENSOR_BYTES,
    MAX_DEPTH,
    TUPLE_EXT8,
    ext,
    ext_header,
    handle_of_type,
)

__all__ = ["Encoder"]


class Encoder:
    """Encodes values; collects out-of-band tensor frames and encoded handles.

    One encoder per process is reused: call :meth:`reset` between messages
    that go into different zmq messages.
    """

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.handles: list[Any] = []
        self._depth = 0
        self._busy = False
        self._packers: list[msgpack.Packer] = []
        self._dataclass_refs: dict[type, tuple[str, tuple[str, ...]]] = {}
        self._top = self._packer()
        self._packers.append(msgpack.Packer(default=self._default, use_bin_type=True, strict_types=True))

    def reset(self) -> None:
        # Fresh lists only when used: callers keep the previous message's lists.
        if self.frames:
            self.frames = []
        if self.handles:
            self.handles = []

    def _packer(self) -> msgpack.Packer:
        while len(self._packers) <= self._depth:
            self._packers.append(msgpack.Packer(default=self._default, use_bin_type=True, strict_types=True))
        return self._packers[self._depth]

    @property
    def busy(self) -> bool:
        """Whether an encode is under way here: code a value runs as it is encoded (a handle's state, a pid
        callback that ships a port) must encode what it sends with another encoder, not this one's packers
        (mid-pack) and lists (the outer message's)."""
        return self._busy

    def encode(self, obj: Any) -> bytes:
        """Pack ``obj``; tensor frames and handles accumulate on this encoder."""
        if self._depth:
            return self._encode(obj)
        self._busy = True
        try:
            return self._encode(obj)
        finally:
            self._busy = False

    def _encode(self, obj: Any) -> bytes:
        depth = self._depth
        try:
            if depth:
                return self._packer().pack(obj)  # type: ignore[no-any-return]
            if type(obj) is tuple:  # a top-level tuple (the common port message): no round trip through default
                self._depth = 1
                inner = self._packers[1].pack(list(obj))
                self._depth = 0
                size = len(inner)
                return (TUPLE_EXT8[size] if size < 256 else ext_header(EXT_TUPLE, size)) + inner  # type: ignore[no-any-return]
            return self._top.pack(obj)  # type: ignore[no-any-return]
        except EncodeError:
            self._depth = depth
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            self._depth = depth
            raise EncodeError(f"cannot encode value: {exc}") from exc
        except BaseException:  # a value's own pickling code raised (objects travel pickled with the switch)
            self._depth = depth
            raise

    def _nested(self, obj: Any) -> bytes:
        if self._depth >= MAX_DEPTH:
            raise EncodeError(f"value nests deeper than {MAX_DEPTH} levels")
        self._depth += 1
        try:
            return self._packer().pack(obj)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1

    def _default(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is tuple:  # the hot path: small tuples in port messages
            depth = self._depth + 1
            if depth < len(self._packers) and depth <= MAX_DEPTH:
                self._depth = depth
                try:
                    return ext(EXT_TUPLE, self._packers[depth].pack(list(obj)))
                finally:
                    self._depth = depth - 1
            return ext(EXT_TUPLE, self._nested(list(obj)))
        if isinstance(obj, torch.Tensor):
            return ext(EXT_TENSOR, self._nested(self._tensor(obj)))
        handle = handle_of_type(cls)
        if handle is not None:
            self.handles.append(obj)
            return ext(EXT_HANDLE, self._nested([handle.kind, handle.to_state(obj)]))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return ext(EXT_DATACLASS, self._nested(self._dataclass(obj)))
        if isinstance(obj, torch.dtype):
            name = DTYPE_NAMES.get(obj)
            if name is None:
                raise EncodeError(f"dtype {obj} is not supported")
            return ext(EXT_DTYPE, name.encode())
        # Subclasses of plain containers (OrderedDict state_dicts, torch.Size,
        # named tuples) travel as their base type.
        if isinstance(obj, tuple):
            return ext(EXT_TUPLE, self._nested(list(obj)))
        if isinstance(obj, dict):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        # The base types' own conversions: a str or int enum member travels as its value (str() of one is
        # "Colour.RED"; a subclass may override __int__ or __float__ too).
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, int):
            return int.__index__(obj)
        if isinstance(obj, float):
            return float.__float__(obj)
        if isinstance(obj, str):
            return str.__str__(obj)
        if is_code(obj):  # a function, lambda, closure, method, partial or class
            if code_allowed():
                return ext(EXT_CODE, pickle_code(obj))
            raise refusal(obj)
        if code_allowed():  # the session lets code travel: an object with no record of its own goes pickled
            return ext(EXT_OBJECT, pickle_object(obj))
        raise EncodeError(
            f"cannot send a value of type {cls.__module__}.{cls.__qualname__}: "
            "use plain values, tensors, dataclasses, ports or actor meshes "
            f"(or let objects travel pickled: {CODE_ENV}=1, in a session whose processes all trust each other)"
        )

    def _dataclass(self, obj: Any) -> list[Any]:
        cls = type(obj)
        info = self._dataclass_refs.get(cls)
        if info is None:
            try:
                ref = _refs.qualified_name(cls)
            except TypeError as exc:
                raise EncodeError(str(exc)) from None
            if "<locals>" in ref:
                raise EncodeError(f"dataclass {ref} is defined inside a function; receivers cannot find it")
            needed = required_init_only(cls)
            if needed is not None:
                raise EncodeError(
                    f"cannot send {ref}: its init-only value {needed!r} (an InitVar) has no default and the instance "
                    "does not keep it, so a receiver cannot rebuild it; give it a default, or make it a field"
                )
            names = tuple(f.name for f in dataclasses.fields(obj))
            info = self._dataclass_refs[cls] = (ref, names)
        ref, names = info
        try:
            return [ref, [getattr(obj, name) for name in names]]
        except AttributeError as exc:  # an init=False field nothing ever set
            raise EncodeError(f"cannot send {ref}: {exc}") from None

    def _tensor(self, tensor: torch.Tensor) -> list[Any]:
        dtype = DTYPE_NAMES.get(tensor.dtype)
        if not tensor.is_cpu or tensor.layout is not torch.strided or tensor.is_quantized or dtype is None:
            raise EncodeError(_unsendable(tensor))
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():  # (a conjugate's imaginary part views the real storage with its sign bit set)
            tensor = tensor.resolve_neg()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        nbytes = tensor.nbytes
        if nbytes <= INLINE_TENSOR_BYTES:
            data: Any = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        else:
            data = len(self.frames)
            self.frames.append(tensor_buffer(tensor.detach(), nbytes))
        return [dtype, list(tensor.shape), data]


def _unsendable(tensor: torch.Tensor) -> str:
    if not tensor.is_cpu:
        kind = tensor.device.type
        return f"a {kind} tensor cannot travel through a socket; move it to the CPU or publish it with actors.weights"
    if tensor.layout is not torch.strided or tensor.is_quantized:
        return f"tensors with layout {tensor.layout} are not supported"
    return f"tensor dtype {tensor.dtype} is not supported"
