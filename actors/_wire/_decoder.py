"""msgpack decoding of messages, within fixed limits.

Decoding builds only plain values, tensors, registered handles (ports,
meshes) and instances of dataclasses whose class is already loaded in this
process. It never imports a module and never unpickles. Every decode is
bounded in size and depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgpack
import torch

from .._shared._errors import DecodeError
from . import _refs
from ._brief import brief
from ._buffers import DTYPES, ITEMSIZE, tensor_over
from ._code import unpickle_code, unpickle_object
from ._dataclasses import init_only_values
from ._ext import (
    EXT_CODE,
    EXT_DATACLASS,
    EXT_DTYPE,
    EXT_HANDLE,
    EXT_OBJECT,
    EXT_TENSOR,
    EXT_TUPLE,
    MAX_DEPTH,
    MAX_PAYLOAD_BYTES,
    handle_of_kind,
)
from ._records import ErrorRecord, Kind, Undecodable

__all__ = ["Decoder", "WholeBatch"]


_unpackb = msgpack.unpackb

#: Extension records nested one in another (each decoded from its own copy of its bytes) may hold this many times
#: their payload's bytes at once, plus :data:`NESTED_BYTES_SPARE` (a large value five levels deep, a dataclass in
#: tuples, holds five).
NESTED_BYTES_FACTOR = 8
NESTED_BYTES_SPARE = 1 << 20
#: The dataclass plans a decoder keeps, by the name a record gave (emptied when full: a program has a few dozen).
MAX_CLASS_PLANS = 1024


class WholeBatch(NamedTuple):
    """A batch decoded in one pass, entry ``j`` of each list describing its ``j``-th record.

    The batch framing puts two uints before each record (its buffer-frame
    count and its encoded size); they are taken apart here, once, so that
    no reader indexes the flat stream. A size that is not its record's
    encoded size is None here; ``frame_counts[j]`` must be 0 (no buffer
    frames) and ``sizes[j]`` an int, which the dispatcher checks per record.
    """

    frame_counts: list[Any]
    sizes: list[Any]
    records: list[Any]
    rest: int  # where the records this pass could not decode begin (the payload's size: none)


class Decoder:
    """Decodes payloads produced by :class:`Encoder`, within fixed limits."""

    def __init__(self, max_payload: int = MAX_PAYLOAD_BYTES) -> None:
        self.max_payload = max_payload
        self._frames: list[Any] = []
        self._depth = 0
        #: Bytes of the extension records being decoded, one inside another (msgpack hands each its own copy),
        #: and how many they may hold for the payload at hand (:meth:`_start`).
        self._held = 0
        self._budget = 0
        self._classes: dict[str, _DataclassPlan] = {}
        self._hook = self._ext_hook

    def _unpacker(self, size: int) -> msgpack.Unpacker:
        limit = max(size, 1)
        return msgpack.Unpacker(
            ext_hook=self._ext_hook,
            raw=False,
            strict_map_key=False,
            max_buffer_size=limit,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=limit,
        )

    def decode_stream(self, payload: Any, frames: list[Any] | None = None) -> Iterator[Any]:
        """Yield every value packed back to back in ``payload``."""
        size = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        if size > self.max_payload:
            raise DecodeError(f"payload of {size} bytes exceeds the {self.max_payload}-byte limit")
        self._frames = frames or []
        self._start(size)
        unpacker = self._unpacker(size)
        try:
            unpacker.feed(payload)
            yield from unpacker
            if unpacker.tell() != size:
                raise DecodeError(f"truncated payload: {size - unpacker.tell()} bytes left undecoded")
        except DecodeError:
            raise
        except Exception as exc:  # whatever building a value raised (a dataclass's own check, torch): bad input
            raise DecodeError(f"malformed payload: {type(exc).__name__}: {exc}") from None
        finally:
            self._frames = []

    def decode_batch(self, payload: Any, frames: list[Any]) -> Iterator[tuple[Any, list[Any], int]]:
        """Yield ``(message, its frames, its size in bytes)`` for each message of a batch.

        Each message is preceded by its frame count and byte length, so one
        that cannot be decoded is yielded as a :class:`DecodeError` instance
        and the rest of the batch still arrives. Broken framing raises.
        """
        view = payload if isinstance(payload, memoryview) else memoryview(payload)
        size = view.nbytes
        if size > self.max_payload:
            raise DecodeError(f"payload of {size} bytes exceeds the {self.max_payload}-byte limit")
        position = 0
        offset = 0
        try:
            while position < size:
                count, position = _read_uint(view, position)
                length, position = _read_uint(view, position)
                end = position + length
                if end > size or count > len(frames) - offset:
                    raise DecodeError("batch framing runs past the end of the message")
                if count:
                    run = frames[offset : offset + count]
                    offset += count
                    nbytes = length
                    for frame in run:
                        nbytes += len(frame)
                else:
                    run = _NO_FRAMES
                    nbytes = length
                self._frames = run
                self._start(length)
                try:
                    message = msgpack.unpackb(
                        view[position:end], ext_hook=self._ext_hook, raw=False, strict_map_key=False
                    )
                except Exception as exc:  # one bad record, however it failed, is that record's loss alone
                    error = (
                        exc
                        if isinstance(exc, DecodeError)
                        else DecodeError(f"malformed message: {type(exc).__name__}: {exc}")
                    )
                    message = _failed_answer(view[position:end], error) or error
                position = end
                yield message, run, nbytes
            if offset != len(frames):
                raise DecodeError(f"{len(frames) - offset} buffer frames left unclaimed")
        finally:
            self._frames = []

    def decode_whole(self, payload: Any) -> WholeBatch | None:
        """A batch without buffer frames decoded in one pass, as far as it goes; None if it is too large.

        The batch framing is itself msgpack (two uints before each record), so
        one unpacker walks it at C speed. At any doubt, a malformed record or a
        framing mismatch, the pass stops after the last whole record:
        ``rest`` says where the caller takes the per-record path
        (:meth:`decode_batch`), which isolates the bad record and delivers the
        rest. The records before it are not decoded again (a dataclass's
        ``__post_init__``, a handle's rebuilding, run once).
        """
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if size > self.max_payload:
            return None
        self._frames = _NO_FRAMES
        self._start(size)
        unpacker = self._unpacker(size)
        items: list[Any] = []
        whole = 0  # the bytes of the records taken whole so far
        start = 0  # where the record being read begins
        try:
            unpacker.feed(payload)
            for item in unpacker:
                items.append(item)
                phase = len(items) % 3
                if phase == 2:
                    start = unpacker.tell()
                elif phase == 0:
                    whole, size = unpacker.tell(), items[-2]
                    if type(size) is not int or size != whole - start:
                        items[-2] = None  # not the record's own size (credit is counted from it): dropped alone
        except Exception:
            pass  # (the per-record path says what is wrong, from ``whole`` on)
        finally:
            self._frames = []
        del items[len(items) - len(items) % 3 :]
        # The caller checks each record's frame count (0) and size (an int: None where it lied) as it goes.
        return WholeBatch(items[0::3], items[1::3], items[2::3], whole)

    def decode(self, payload: Any, frames: list[Any] | None = None) -> Any:
        """Decode exactly one value."""
        values = list(self.decode_stream(payload, frames))
        if len(values) != 1:
            raise DecodeError(f"expected one value, found {len(values)}")
        return values[0]

    def _start(self, size: int) -> None:
        """A payload (or record) of ``size`` bytes is decoded next: no nesting yet, and its extension records may
        hold :data:`NESTED_BYTES_FACTOR` times its bytes at once (64 levels of copies would hold 64 times)."""
        self._depth = self._held = 0
        self._budget = NESTED_BYTES_FACTOR * size + NESTED_BYTES_SPARE

    def _enter(self, data: bytes) -> None:
        if self._depth >= MAX_DEPTH:
            raise DecodeError(f"value nests deeper than {MAX_DEPTH} levels")
        held = self._held + len(data)
        if held > self._budget:
            raise DecodeError(
                f"extension records nested one in another hold {held} bytes at once, past {NESTED_BYTES_FACTOR} "
                "times their payload's"
            )
        self._depth += 1
        self._held = held

    def _nested(self, data: bytes) -> Any:
        self._enter(data)
        try:
            # unpackb bounds every length by len(data), like the stream unpacker.
            return _unpackb(data, ext_hook=self._hook, raw=False, strict_map_key=False)
        except msgpack.ExtraData:
            raise DecodeError("trailing bytes inside an extension record") from None
        except msgpack.OutOfData:
            raise DecodeError("truncated extension record") from None
        finally:
            self._depth -= 1
            self._held -= len(data)

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:  # the common case, with _nested (and _enter) inlined
            held = self._held + len(data)
            if self._depth >= MAX_DEPTH or held > self._budget:
                self._enter(data)  # (raises, saying which)
            self._depth += 1
            self._held = held
            try:
                items = _unpackb(data, ext_hook=self._hook, raw=False, strict_map_key=False)
            except (msgpack.ExtraData, msgpack.OutOfData):
                raise DecodeError("malformed tuple record") from None
            finally:
                self._depth -= 1
                self._held -= len(data)
            if type(items) is not list:
                raise DecodeError("tuple record does not hold a list")
            return tuple(items)
        if code == EXT_TENSOR:
            return self._tensor(self._nested(data))
        if code == EXT_DATACLASS:
            return self._dataclass(self._nested(data))
        if code == EXT_HANDLE:
            record = self._nested(data)
            if type(record) is not list or len(record) != 2 or type(record[0]) is not str:
                raise DecodeError("malformed handle record")
            handle = handle_of_kind(record[0])
            if handle is None:
                raise DecodeError(f"unknown handle kind {record[0]!r}")
            try:
                return handle.from_state(record[1])
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"malformed {record[0]} handle: {exc}") from None
        if code == EXT_DTYPE:
            dtype = DTYPES.get(bytes(data).decode("ascii", "replace"))
            if dtype is None:
                raise DecodeError("unknown dtype")
            return dtype
        if code == EXT_CODE:
            return unpickle_code(bytes(data))
        if code == EXT_OBJECT:
            return unpickle_object(bytes(data))
        raise DecodeError(f"unknown extension type {code}")

    def _tensor(self, record: Any) -> torch.Tensor:
        if type(record) is not list or len(record) != 3:
            raise DecodeError("malformed tensor record")
        dtype_name, shape, data = record
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise DecodeError(f"unknown tensor dtype {dtype_name!r}")
        if type(shape) is not list or len(shape) > 32:
            raise DecodeError("malformed tensor shape")
        numel = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise DecodeError("malformed tensor shape")
            numel *= dim
        itemsize = ITEMSIZE[dtype]
        nbytes = numel * itemsize
        if type(data) is int:
            if not 0 <= data < len(self._frames):
                raise DecodeError(f"tensor refers to missing frame {data}")
            buffer = self._frames[data]
            buffer = buffer.buffer if hasattr(buffer, "buffer") else memoryview(buffer)
        elif type(data) is bytes:
            # A copy the tensor owns: a tensor over the bytes object itself would let a write change an
            # immutable object (CPython shares the one-byte ones interpreter-wide).
            buffer = bytearray(data)
        else:
            raise DecodeError("malformed tensor data")
        size = buffer.nbytes if isinstance(buffer, memoryview) else len(buffer)
        if size != nbytes:
            raise DecodeError(f"tensor of shape {shape} needs {nbytes} bytes, frame holds {size}")
        if numel == 0:
            try:
                return torch.empty(shape, dtype=dtype)
            except RuntimeError as exc:  # other dims whose strides overflow int64
                raise DecodeError(f"malformed tensor shape {brief(shape)}: {exc}") from None
        flat = tensor_over(buffer, dtype, numel)
        if type(data) is int and flat.data_ptr() % itemsize:
            # ZeroMQ may hand a frame at any address (a zero-copy receive points into its read buffer); kernels
            # assume elements are aligned (a complex128 cast over such memory crashed), so this one is copied. (An
            # inline tensor's bytearray is the allocator's memory, aligned for every dtype here.)
            aligned = torch.empty(numel, dtype=dtype)
            aligned.view(torch.uint8).copy_(tensor_over(buffer, torch.uint8, nbytes))
            flat = aligned
        return flat if len(shape) == 1 else flat.view(shape)

    def _dataclass(self, record: Any) -> Any:
        if type(record) is not list or len(record) != 2 or type(record[0]) is not str or type(record[1]) is not list:
            raise DecodeError("malformed dataclass record")
        ref, values = record
        plan = self._classes.get(ref)
        if plan is None:
            try:
                found = _refs.resolve(ref, allow_import=False)
            except LookupError as exc:
                raise DecodeError(f"refusing to build {ref}: {exc}") from None
            if not isinstance(found, type) or not dataclasses.is_dataclass(found):
                raise DecodeError(f"refusing to build {ref}: not a dataclass")
            if len(self._classes) >= MAX_CLASS_PLANS:  # (a peer may spell one class many ways: ``m:a.m.a.P``)
                self._classes.clear()
            plan = self._classes[ref] = _DataclassPlan.of(found)
        if len(values) != len(plan.names):
            raise DecodeError(f"cannot build {ref}: {len(values)} field values for {len(plan.names)} fields")
        try:
            return plan.build(values) if plan.special else plan.cls(*values)  # (most: the constructor takes all)
        except Exception as exc:  # the class's own __post_init__ refused the values
            raise DecodeError(f"cannot build {ref}: {exc}") from None


class _DataclassPlan(NamedTuple):
    """How to rebuild one dataclass from the values of all its fields, in declaration order.

    The constructor runs, so the class's own checks (``__post_init__``) see
    received values; when the class has a ``__post_init__`` or fields its
    constructor does not take, every field is then set back to the value
    sent, so the instance is the one the sender had (a ``__post_init__`` that
    rewrites a field would otherwise rewrite it twice). An init-only value
    (``InitVar``) is not kept by the instance: the constructor is called by
    keyword, the value taking its default (positionally, the fields after it
    would shift by one). A constructor of the class's own (``init=False``)
    takes what it wants: the instance is made without it, from the fields.
    """

    cls: type
    names: tuple[str, ...]
    init: tuple[int, ...]  # which fields the constructor takes
    by_keyword: bool  # some field is keyword-only, not taken by the constructor, or after an init-only value
    restore: bool
    special: bool  # by keyword or restored: else ``cls(*values)`` is the whole build
    own_init: bool  # the class wrote its own constructor: not called

    @classmethod
    def of(cls, found: type) -> _DataclassPlan:
        fields = dataclasses.fields(found)
        init = tuple(i for i, f in enumerate(fields) if f.init)
        own_init = not found.__dataclass_params__.init  # type: ignore[attr-defined]
        by_keyword = len(init) != len(fields) or any(f.kw_only for f in fields) or bool(init_only_values(found))
        restore = len(init) != len(fields) or hasattr(found, "__post_init__") or own_init
        names = tuple(f.name for f in fields)
        return cls(found, names, init, by_keyword, restore, by_keyword or restore, own_init)

    def build(self, values: list[Any]) -> Any:
        names = self.names
        if self.own_init:
            instance: Any = object.__new__(self.cls)
        elif self.by_keyword:
            instance = self.cls(**{names[i]: values[i] for i in self.init})
        else:
            instance = self.cls(*values)
        if self.restore:
            for name, value in zip(names, values, strict=True):
                object.__setattr__(instance, name, value)
        return instance


_NO_FRAMES: list[Any] = []


def _read_uint(view: memoryview, position: int) -> tuple[int, int]:
    """Read one msgpack unsigned integer (fixint, uint8/16/32) at ``position``."""
    try:
        first = view[position]
        if first < 0x80:
            return first, position + 1
        if first == 0xCC:
            return view[position + 1], position + 2
        if first == 0xCD:
            return int.from_bytes(view[position + 1 : position + 3], "big"), position + 3
        if first == 0xCE:
            return int.from_bytes(view[position + 1 : position + 5], "big"), position + 5
    except IndexError:
        raise DecodeError("truncated batch framing") from None
    raise DecodeError(f"bad batch framing byte 0x{first:02x}")


def _failed_answer(record: memoryview, error: DecodeError) -> list[Any] | None:
    """A reply or port message whose value cannot be built here, as one that says so, so that its caller or
    receiver hears why instead of waiting (and the port's sender gets its window credit back when it is taken).

    The record is read again with every extension value left out (nothing
    is loaded, nothing unpickled); other records are dropped with a log.
    """
    try:
        fields = msgpack.unpackb(record, ext_hook=lambda code, data: None, raw=False, strict_map_key=False)
    except Exception:
        return None
    if type(fields) is not list or not fields or type(fields[0]) is not int:
        return None
    if len(fields) == 3 and fields[0] == Kind.PORT and type(fields[1]) is int:
        return [int(Kind.PORT), fields[1], Undecodable(f"a message could not be decoded in this process: {error}")]
    if len(fields) != 5 or fields[0] != Kind.REPLY or type(fields[1]) is not int or type(fields[2]) is not int:
        return None
    why = ErrorRecord("DecodeError", f"the answer could not be decoded in the calling process: {error}")
    return [int(Kind.REPLY), fields[1], fields[2], False, why.to_wire()]
