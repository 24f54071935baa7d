"""The wire codec: round trips, zero-copy tensors, and refusal of hostile input."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import Derived, Item, Keyworded, NeedsScale, Renamed, Scaled, Triple

from actors import DecodeError, EncodeError
from actors._wire._codec import EXT_DATACLASS, EXT_TENSOR, EXT_TUPLE, MAX_DEPTH, Decoder, Encoder


class Colour(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 2


def roundtrip(value):
    enc = Encoder()
    data = enc.encode(value)
    frames = [bytes(f) for f in enc.frames]
    return Decoder().decode(data, frames)


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(st.text() | st.integers(min_value=-1000, max_value=1000), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_values_roundtrip_exactly(value):
    assert roundtrip(value) == value
    assert type(roundtrip(value)) is type(value)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(
        [torch.float32, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool, torch.bfloat16, torch.float16]
    ),
    st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3),
)
def test_tensor_roundtrip_any_dtype_and_shape(dtype, shape):
    t = (torch.rand(shape) * 100).to(dtype)
    out = roundtrip(t)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_nan_float_roundtrips():
    assert math.isnan(roundtrip(float("nan")))


def test_large_tensor_travels_as_zero_copy_frame():
    t = torch.arange(100_000, dtype=torch.float32)
    enc = Encoder()
    data = enc.encode({"w": t})
    assert len(data) < 200, "large tensor bytes must not be inside the payload"
    assert len(enc.frames) == 1 and enc.frames[0].nbytes == t.numel() * 4
    frame = bytearray(enc.frames[0])
    out = Decoder().decode(data, [frame])["w"]
    assert torch.equal(out, t)
    frame[0:4] = b"\x00\x00\x80\x3f"  # 1.0f: the tensor is a view over the frame, not a copy
    assert out[0].item() == 1.0


def test_noncontiguous_and_views_are_sent_by_value():
    base = torch.arange(24.0).reshape(4, 6)
    for t in (base.t(), base[:, 1::2], base[2:], base.expand(2, 4, 6)):
        assert torch.equal(roundtrip(t), t)


def test_state_dict_and_module_types():
    sd = torch.nn.Linear(3, 2).state_dict()
    assert isinstance(sd, OrderedDict)
    out = roundtrip(sd)
    assert list(out) == list(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
    assert roundtrip(torch.Size([2, 3])) == (2, 3)
    assert roundtrip(torch.float16) is torch.float16


def test_tensor_with_grad_is_detached():
    t = torch.ones(3, requires_grad=True) * 2
    out = roundtrip(t)
    assert not out.requires_grad and torch.equal(out, t.detach())


def test_dataclasses_rebuilt_as_real_instances():
    item = Item(7, torch.ones(3))
    out = roundtrip([item, Triple(torch.zeros(1), torch.ones(2), torch.arange(3))])
    assert isinstance(out[0], Item) and out[0].seq == 7 and torch.equal(out[0].payload, item.payload)
    assert isinstance(out[1], Triple) and torch.equal(out[1].c, torch.arange(3))


def test_keyword_only_dataclasses_roundtrip():
    assert roundtrip(Keyworded(name="a", size=3)) == Keyworded(name="a", size=3)


def test_a_dataclass_arrives_as_it_was_sent_not_as_its_post_init_would_remake_it():
    sent = Derived(3)
    assert (sent.raw, sent.doubled) == (4, 8)
    out = roundtrip(sent)
    assert type(out) is Derived and (out.raw, out.doubled) == (4, 8)


def test_a_dataclass_with_an_init_only_value_or_its_own_constructor_arrives_as_it_was_sent():
    """An ``InitVar`` is a constructor argument, not a field: the fields after it were passed in its place, so
    ``Scaled([1, 2], label=7)`` arrived with ``label`` 0, silently; a class's own constructor was called with the
    fields (a ``DecodeError`` at best). One whose init-only value has no default is refused at the sender."""
    out = roundtrip(Scaled([1, 2], 3.0, label=7))
    assert type(out) is Scaled and (out.tokens, out.label) == ([1, 2], 7)
    renamed = roundtrip(Renamed("a b c"))
    assert type(renamed) is Renamed and renamed.words == ["a", "b", "c"]
    with pytest.raises(EncodeError, match=r"cannot send .*NeedsScale: its init-only value 'scale' .* has no default"):
        Encoder().encode(NeedsScale([1], 2.0))


def test_an_unsupported_dtype_is_an_encode_error_and_a_negated_view_travels_with_its_sign():
    """A dtype with no name on the wire (``float8_e4m3fn``, ``uint16``) raised ``KeyError`` past the sender's
    ``EncodeError`` handling (a once-port stayed marked used, its receiver waiting for good); a complex tensor's
    conjugate's imaginary part (a view with the negative bit) arrived with the sign lost."""
    for dtype in (torch.float8_e4m3fn, torch.uint16):
        with pytest.raises(EncodeError, match=f"dtype {dtype} is not supported"):
            Encoder().encode({"dtype": dtype})
    imaginary = torch.tensor([1 + 2j, 3 - 4j]).conj().imag
    assert imaginary.is_neg() and torch.equal(roundtrip(imaginary), torch.tensor([-2.0, 4.0]))


def test_a_dataclass_record_with_the_wrong_number_of_fields_is_a_decode_error():
    for values in (["a", 1, 2], ["a"]):
        record = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Keyworded", values]))
        with pytest.raises(DecodeError, match="Keyworded"):
            Decoder().decode(msgpack.packb(record))


def test_enum_members_travel_as_their_values():
    assert roundtrip(Colour.RED) == "red" and type(roundtrip(Colour.RED)) is str
    assert roundtrip(Level.HIGH) == 2 and type(roundtrip(Level.HIGH)) is int
    assert roundtrip({Colour.RED: [Level.HIGH]}) == {"red": [2]}


def test_a_small_received_tensor_owns_its_memory():
    """Writing to a tensor that arrived inline must not write into a bytes object (CPython shares 1-byte ones)."""
    out = roundtrip(torch.tensor([7], dtype=torch.uint8))
    out.add_(1)
    assert bytes([7])[0] == 7 and out.item() == 8
    wide = roundtrip(torch.arange(64, dtype=torch.int64))
    wide.mul_(2)
    assert wide[3].item() == 6


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64, torch.int32])
def test_a_tensor_over_a_misaligned_frame_is_aligned_before_use(dtype):
    """ZeroMQ may hand a frame at any address; kernels that assume alignment must never see it (complex128 casts
    crashed the process)."""
    sent = torch.randn(3000).to(dtype) if not dtype.is_complex else torch.randn(3000, dtype=dtype)
    enc = Encoder()
    data = enc.encode(sent)
    frame = memoryview(b"x" + bytes(enc.frames[0]))[1:]
    out = Decoder().decode(data, [frame])
    assert out.data_ptr() % dtype.itemsize == 0
    assert torch.equal(out, sent)
    cast = torch.float32 if not dtype.is_complex else torch.complex64
    assert torch.equal(out.to(cast), sent.to(cast))
    assert torch.equal(out.real if dtype.is_complex else out, sent.real if dtype.is_complex else sent)


def test_unsupported_values_raise_encode_error():
    with pytest.raises(EncodeError, match="object"):
        Encoder().encode(object())
    with pytest.raises(EncodeError):
        Encoder().encode({1, 2})
    with pytest.raises(EncodeError):
        Encoder().encode(2**70)
    with pytest.raises(TypeError):  # EncodeError is a TypeError too
        Encoder().encode(lambda: 1)


def test_local_dataclass_refused_at_sender():
    @dataclasses.dataclass
    class Local:
        x: int

    with pytest.raises(EncodeError, match="inside a function"):
        Encoder().encode(Local(1))


def test_encode_depth_limit():
    value: object = 1
    for _ in range(MAX_DEPTH + 5):
        value = (value,)
    with pytest.raises(EncodeError, match="deeper"):
        Encoder().encode(value)


def _ext(code, inner):
    return msgpack.ExtType(code, msgpack.packb(inner, use_bin_type=True))


def test_dataclass_of_unloaded_module_is_refused_without_import():
    import sys

    data = msgpack.packb(_ext(EXT_DATACLASS, ["surely_not_loaded_mod:Thing", [1]]))
    with pytest.raises(DecodeError, match="not loaded"):
        Decoder().decode(data)
    assert "surely_not_loaded_mod" not in sys.modules


@pytest.mark.parametrize(
    "ref",
    ["os:system", "builtins:eval", "subprocess:Popen", "collections:OrderedDict", "support:Echo", "malformed"],
)
def test_non_dataclass_types_are_refused(ref):
    data = msgpack.packb(_ext(EXT_DATACLASS, [ref, ["echo pwned"]]))
    with pytest.raises(DecodeError, match=r"refusing|malformed"):
        Decoder().decode(data)


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb(_ext(EXT_TENSOR, ["float32", [10], 0])),  # refers to a missing frame
        msgpack.packb(_ext(EXT_TENSOR, ["float32", [10], b"\x00" * 8])),  # truncated bytes
        msgpack.packb(_ext(EXT_TENSOR, ["pickle", [1], b"\x00"])),  # unknown dtype
        msgpack.packb(_ext(EXT_TENSOR, ["float32", [-1], b""])),  # negative dim
        msgpack.packb(_ext(EXT_TENSOR, ["float32", [2**40, 2**40], 0])),  # absurd size
        msgpack.packb(_ext(EXT_TUPLE, {"not": "a list"})),
        msgpack.packb(msgpack.ExtType(99, b"")),  # unknown ext type
        msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\xc1")),  # invalid msgpack inside an ext
        msgpack.packb([1, 2, 3])[:-1],  # truncated payload
        b"\xdd\xff\xff\xff\xff",  # array declaring 4 billion items
        b"\xdb\xff\xff\xff\xff",  # string declaring 4 GiB
        b"\x91" * 5000 + b"\xc0",  # nesting far beyond any limit
        msgpack.packb(1) + b"\xc1",  # trailing garbage
    ],
)
def test_malformed_payloads_raise_decode_error(payload):
    with pytest.raises(DecodeError):
        Decoder().decode(payload)


def test_nested_ext_depth_is_bounded():
    value = msgpack.packb(1)
    for _ in range(MAX_DEPTH + 2):
        value = msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\x91" + value))
    with pytest.raises(DecodeError, match=r"deeper|malformed"):
        Decoder().decode(value)


def test_payload_size_limit():
    with pytest.raises(DecodeError, match="limit"):
        Decoder(max_payload=16).decode(msgpack.packb("x" * 100))


def test_frame_size_mismatch_is_refused():
    enc = Encoder()
    data = enc.encode(torch.zeros(10_000))
    with pytest.raises(DecodeError, match="needs"):
        Decoder().decode(data, [b"\x00" * 10])


def test_cuda_tensors_are_refused_with_advice():
    fake = torch.empty(0, device="meta")
    with pytest.raises(EncodeError, match="socket"):
        Encoder().encode(fake)


def test_a_header_claiming_an_impossible_pid_is_refused():
    from actors._wire._records import PID_MAX, PROTOCOL_VERSION, Header

    for pid in (0, -3, PID_MAX + 1):
        with pytest.raises(DecodeError, match="bad header"):
            Header.decode(msgpack.packb([PROTOCOL_VERSION, "ipc:///x.sock", pid]))


def test_a_header_of_another_protocol_version_says_so():
    """A peer running another version of the package is told apart from garbage in the log."""
    from actors._wire._records import PROTOCOL_VERSION, Header

    with pytest.raises(DecodeError, match=f"protocol version {PROTOCOL_VERSION + 1}.*speaks {PROTOCOL_VERSION}"):
        Header.decode(msgpack.packb([PROTOCOL_VERSION + 1, "ipc:///x.sock", 5]))


def test_an_attach_naming_a_pid_that_cannot_exist_is_refused():
    """A port's receiver watches the pid an ATTACH names: one outside Linux's range is malformed, not a holder that
    cannot be watched (which the receiver would count as gone)."""
    from actors._wire._records import PID_MAX, Attach, Kind

    assert Attach.from_wire([Kind.ATTACH, 3, 42, "ipc:///x.sock"]) == Attach(3, 42, "ipc:///x.sock")
    for pid in (0, -1, PID_MAX + 1, 2**40):
        with pytest.raises(DecodeError, match="malformed ATTACH"):
            Attach.from_wire([Kind.ATTACH, 3, pid, "ipc:///x.sock"])
    for fields in ([Kind.ATTACH, 3, 42], [Kind.ATTACH, 3, 42, 7]):  # the holder's address: a str, always there
        with pytest.raises(DecodeError):
            Attach.from_wire(fields)


def test_a_malformed_records_error_says_it_briefly_however_deep_or_large_the_record():
    """The message showed ``repr(record)`` cut to 80 characters, built whole first: a header frame of nested
    lists 1,000 deep was a ``RecursionError`` past the inbox's decode-error handling, and 50 MB of bytes made a
    200 MB string before it was cut."""
    from actors._wire._records import Header, Kind, decode_record

    with pytest.raises(DecodeError, match=r"bad header \[\[\[…\]\]\]"):
        Header.decode(b"\x91" * 1000 + b"\xc0")
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    for fields in ([int(Kind.CREDIT), deep], [int(Kind.CREDIT), b"\0" * 50_000_000, "x" * 10_000], deep, [deep]):
        with pytest.raises(DecodeError) as info:
            decode_record(fields)
        assert len(str(info.value)) < 200, str(info.value)[:300]
    with pytest.raises(DecodeError, match=r"malformed CREDIT record: \[\d+, <50000000 bytes>, 'x{40}'…\]"):
        decode_record([int(Kind.CREDIT), b"\0" * 50_000_000, "x" * 10_000])


def test_a_call_whose_response_port_is_not_a_port_is_refused():
    from actors._wire._records import Call, Kind

    with pytest.raises(DecodeError, match="malformed CALL"):
        Call.from_wire([Kind.CALL, 1, "a", "m", "ipc:///x.sock", 1, 0, b"", 7, 0, None])


def test_send_refuses_a_port_that_is_not_one_at_the_sender():
    """A response port that is not a ``Port`` is refused where the call arrives, the whole call dropped: refused
    at the sender now, with a ``TypeError``, instead of a call that silently never runs."""
    from actors import send
    from actors._meshes._actor_mesh import ActorMesh

    mesh = ActorMesh("m", "tests:Sends", {"send": None, "add": None}, {}, [], None)
    with pytest.raises(TypeError, match=r"send\(port=...\) takes a Port \(from Channel.open\(\)\), not ActorMesh"):
        send(mesh.add, (1,), port=mesh)


def test_a_call_whose_response_port_is_a_mesh_with_a_send_endpoint_is_refused():
    """The response port was checked by duck typing (a callable ``send``): an actor mesh with an endpoint named
    ``send`` passed, and each answer then raised and was logged with a stack trace, outside the drop log."""
    from actors import Channel
    from actors._meshes._actor_mesh import ActorMesh
    from actors._wire._records import Call, Kind

    mesh = ActorMesh("m", "tests:Sends", {"send": None}, {}, [], None)  # (as a peer's handle decodes)
    assert callable(getattr(mesh, "send", None))
    with pytest.raises(DecodeError, match="malformed CALL"):
        Call.from_wire([Kind.CALL, 1, "a", "m", "ipc:///x.sock", 1, 0, b"", mesh, 0, None])
    port, _ = Channel.open(int)
    assert Call.from_wire([Kind.CALL, 1, "a", "m", "ipc:///x.sock", 1, 0, b"", port, 0, None]).port is port


@pytest.mark.parametrize(
    "position, extent",
    [
        (-1, None),
        (2, {"gpus": 2}),
        (0, {"gpus": 0}),
        (0, {"gpus": "2"}),
        (0, {1: 2}),
        (0, [2]),
        ("0", None),
        (0, {f"d{i}": 1 for i in range(17)}),
    ],
)
def test_a_call_whose_place_in_its_mesh_is_not_one_is_refused(position, extent):
    """A call's place in the mesh it came through (Monarch's ``message_rank``) must lie in that mesh."""
    from actors._wire._records import Call, Kind

    with pytest.raises(DecodeError, match="malformed CALL"):
        Call.from_wire([Kind.CALL, 1, "a", "m", "ipc:///x.sock", 1, 0, b"", None, position, extent])
    assert Call.from_wire([Kind.CALL, 1, "a", "m", "ipc:///x.sock", 1, 3, b"", None, 1, {"a": 1, "b": 2}]).position == 1


def test_a_reply_or_port_message_whose_value_cannot_be_built_says_so_and_other_records_stay_errors():
    """The caller hears why (instead of waiting for an answer that was dropped), and so does a port's receiver
    (its queue gets an ``Undecodable`` in the value's place); nothing in the value is loaded."""
    from actors._wire._records import ErrorRecord, Kind, Reply, Undecodable, record_prefix

    missing = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["no_such_module:Thing", [1]]))
    records = [
        msgpack.packb([int(Kind.REPLY), 7, 1, True, {"x": missing}]),
        msgpack.packb([int(Kind.PORT), 3, missing]),
        msgpack.packb([int(Kind.CALL), 3, missing]),
    ]
    batch = b"".join(record_prefix(0, len(r)) + r for r in records)
    (reply, _, _), (port, _, _), (other, _, _) = list(Decoder().decode_batch(batch, []))
    answer = Reply.from_wire(reply)
    assert (answer.call_id, answer.rank, answer.ok) == (7, 1, False)
    assert isinstance(answer.value, ErrorRecord) and answer.value.type_name == "DecodeError"
    assert "could not be decoded in the calling process" in answer.value.message
    assert "no_such_module" in answer.value.message
    assert port[:2] == [int(Kind.PORT), 3] and type(port[2]) is Undecodable and "no_such_module" in port[2].reason
    assert isinstance(other, DecodeError)


def test_a_record_that_fails_in_any_way_is_isolated_and_the_rest_of_the_batch_arrives():
    """A dataclass check raising RuntimeError, or a tensor shape whose strides overflow, is one bad record."""
    from support import Fragile

    from actors._wire._records import Kind, record_prefix

    fragile = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Fragile", [-1]]))
    overflow = msgpack.ExtType(EXT_TENSOR, msgpack.packb(["float32", [0, 2**63 - 1, 2**63 - 1], b""]))
    records = [
        msgpack.packb([int(Kind.PORT), 3, fragile]),
        msgpack.packb([int(Kind.PORT), 3, overflow]),
        msgpack.packb([int(Kind.PORT), 3, msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Fragile", [2]]))]),
    ]
    batch = b"".join(record_prefix(0, len(r)) + r for r in records)
    got = [message for message, _, _ in Decoder().decode_batch(batch, [])]
    assert "negative" in got[0][2].reason and "overflow" in got[1][2].reason.lower(), got[:2]
    assert got[2] == [int(Kind.PORT), 3, Fragile(2)]
    for bad in (fragile, overflow):
        with pytest.raises(DecodeError):
            Decoder().decode(msgpack.packb(bad))


@contextlib.contextmanager
def wired_inbox(tmp_path: Any, learn_sender: Any = None, credit: Any = None) -> Iterator[types.SimpleNamespace]:
    """An inbox on a PULL socket, a PUSH into it, and its PORT records routed to one open receiver's ``state``;
    ``send(values)`` pushes one batch of PORT records to it from the peer ``peer``."""
    import zmq

    from actors._shared._liveness import ProcRef
    from actors._transport._inbox_pump import DropLog, Inbox
    from actors._transport._receivers import Receivers
    from actors._wire._records import PROTOCOL_VERSION, PortMessage, record_prefix

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind(f"ipc://{tmp_path}/inbox.sock")
        push.connect(f"ipc://{tmp_path}/inbox.sock")
        wired = types.SimpleNamespace(pull=pull, peer=f"ipc://{tmp_path}/peer.sock", drops=DropLog())
        wired.inbox = Inbox(pull, str(tmp_path), "ipc://own", learn_sender or (lambda header: None), wired.drops)
        wired.receivers = Receivers(
            1,
            lambda pid: True,
            credit or (lambda *credit: None),
            wired.drops,
            lambda address, pid: ProcRef(address, pid),
        )
        wired.state = wired.receivers.open(False)
        wired.inbox.on(PortMessage, wired.receivers.on_port_message, raw=True, run=wired.receivers.deliver_run)
        header = msgpack.packb([PROTOCOL_VERSION, wired.peer, 42])

        def send(records: list[bytes]) -> None:
            push.send_multipart([header, b"".join(record_prefix(0, len(r)) + r for r in records)])

        wired.send = send
        yield wired
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def test_an_inbox_batch_whose_record_kind_is_a_tensor_is_dropped_and_the_rest_delivered(tmp_path):
    """``fields[0] == Kind.PORT`` on a decoded tensor would raise (or be a tensor): records are checked by type."""
    from actors._wire._records import Kind

    with wired_inbox(tmp_path) as wired:
        port_id = wired.state.port_id
        tensor = msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", [2], b"\x00" * 16]))
        wired.send(
            [
                msgpack.packb([int(Kind.PORT), port_id, "first"]),
                msgpack.packb([tensor, port_id, "bad"]),
                msgpack.packb([int(Kind.PORT), tensor, "bad"]),
                msgpack.packb([int(Kind.PORT), port_id, "last"]),
            ]
        )
        assert wired.pull.poll(10_000)
        wired.inbox.pump()
        assert [value for value, _, _ in wired.state.queue] == ["first", "last"]
        assert wired.drops.count == 2


def test_a_batch_that_fails_part_way_builds_each_record_before_the_failure_once(tmp_path):
    """The one-pass decode of a batch gave up on its first bad record and the batch was decoded again from its
    start, record by record: every record before the bad one was built twice (its ``__post_init__`` run twice, a
    handle rebuilt twice, an object unpickled twice). The per-record path takes over where the one pass stopped."""
    from support import Counted

    from actors._wire._records import Kind, Undecodable

    counted = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Counted", [5]]))
    missing = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["no_such_module:Thing", [1]]))
    Counted.built.clear()
    with wired_inbox(tmp_path) as wired:
        port_id = wired.state.port_id
        wired.send([msgpack.packb([int(Kind.PORT), port_id, value]) for value in (counted, missing, "last")])
        assert wired.pull.poll(10_000)
        wired.inbox.pump()
        values = [value for value, _, _ in wired.state.queue]
    assert Counted.built == [5], "built once"
    assert values[0].value == 5 and type(values[1]) is Undecodable and values[2] == "last"


def test_an_inbox_batch_whose_framing_holds_a_tensor_drops_those_records_and_delivers_the_rest(tmp_path):
    """A frame count or size that is a tensor (the framing is msgpack too) is bad framing for its record alone."""

    from actors._wire._records import Kind, record_prefix

    with wired_inbox(tmp_path) as wired:
        port_id = wired.state.port_id
        tensor = msgpack.packb(msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", [2], b"\x00" * 16])))
        first, bad, last = (msgpack.packb([int(Kind.PORT), port_id, v]) for v in ("first", "bad", "last"))
        payload = b"".join(
            (
                record_prefix(0, len(first)) + first,
                tensor + msgpack.packb(len(bad)) + bad,  # a tensor as its frame count
                b"\x00" + tensor + bad,  # a tensor as its size
                record_prefix(0, len(last)) + last,
            )
        )
        pump_framed(wired, tmp_path, payload)
        assert [value for value, _, _ in wired.state.queue] == ["first", "last"]
        assert wired.drops.count == 2


def pump_framed(wired: Any, tmp_path: Any, payload: bytes) -> None:
    """Send ``payload`` (a batch framed by the test) to the wired inbox from its peer, and pump it in."""
    import zmq

    from actors._wire._records import PROTOCOL_VERSION

    push = wired.pull.context.socket(zmq.PUSH)
    try:
        push.connect(f"ipc://{tmp_path}/inbox.sock")
        push.send_multipart([msgpack.packb([PROTOCOL_VERSION, wired.peer, 42]), payload])
        assert wired.pull.poll(10_000)
        wired.inbox.pump()
    finally:
        push.close(linger=0)


def test_resolving_a_name_never_runs_a_modules_getattr():
    """A lazy module's ``__getattr__`` may import (torch's does): decoding must not trigger it."""
    import sys
    import types

    from actors._wire._refs import resolve

    calls: list[str] = []
    lazy = types.ModuleType("actors_test_lazy_module")

    def module_getattr(name: str) -> object:
        calls.append(name)
        return dataclasses.make_dataclass(name, [("x", int)])

    lazy.__getattr__ = module_getattr  # type: ignore[method-assign]
    lazy.Present = Item  # type: ignore[attr-defined]
    sys.modules[lazy.__name__] = lazy
    try:
        with pytest.raises(LookupError, match="has no 'Hidden'"):
            resolve("actors_test_lazy_module:Hidden")
        assert resolve("actors_test_lazy_module:Present") is Item
        assert calls == []
    finally:
        del sys.modules[lazy.__name__]


def test_a_port_message_that_cannot_be_built_here_is_credited_and_its_receiver_told(tmp_path):
    """Dropped with a log, it gave no credit back (4,096 of them, or one of 64 MiB, closed its sender's window for
    good) and its receiver waited on; now receiving it raises ``DecodeError`` and its credit flows as any other's."""
    from support import Fragile

    from actors._runtime._port import PortReceiver
    from actors._transport._flow import CREDIT_MESSAGES
    from actors._wire._records import Kind, Undecodable

    credits: list[tuple[Any, int, int, int]] = []
    with wired_inbox(tmp_path, credit=lambda *credit: credits.append(credit)) as wired:
        state = wired.state
        fragile = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Fragile", [-1]]))
        sound = msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["support:Fragile", [2]]))
        records = [msgpack.packb([int(Kind.PORT), state.port_id, fragile])] * CREDIT_MESSAGES
        wired.send([*records, msgpack.packb([int(Kind.PORT), state.port_id, sound])])
        assert wired.pull.poll(10_000)
        wired.inbox.pump()
        assert wired.drops.count == 0 and len(state.queue) == CREDIT_MESSAGES + 1
        assert all(type(value) is Undecodable for value, _, _ in list(state.queue)[:-1])
        # what a receiver does with them: each raises, and their credit goes back once a batch is consumed
        receiver = PortReceiver.__new__(PortReceiver)
        receiver._rt, receiver._state = types.SimpleNamespace(receivers=wired.receivers), state  # type: ignore[assignment]
        for _ in range(CREDIT_MESSAGES):
            with pytest.raises(DecodeError, match="negative"):
                receiver._take()
        assert credits and credits[0][:3] == ((wired.peer, 42), state.port_id, CREDIT_MESSAGES)
        assert receiver._take_ready() == [Fragile(2)]


def test_a_pump_called_again_while_it_handles_a_message_leaves_the_rest_in_order(tmp_path):
    """Learning a new sender can end in a nested pump (its pid already gone: its exit pumps the inbox to take in
    what it sent). The nested pump handled the sender's later batch first: its ``None`` arrived before the data."""
    from actors._wire._records import Kind

    nested: list[Any] = []
    with wired_inbox(tmp_path, learn_sender=lambda header: nested[0].pump()) as wired:
        nested.append(wired.inbox)
        for values in ([1, 2], [3, None]):
            wired.send([msgpack.packb([int(Kind.PORT), wired.state.port_id, value]) for value in values])
        while len(wired.state.queue) < 4:
            assert wired.pull.poll(10_000)
            wired.inbox.pump()
        assert [value for value, _, _ in wired.state.queue] == [1, 2, 3, None]


class Nosy:
    """A handle whose state, as it is taken, has a message of its own encoded (as a pid lookup in an actor mesh's
    state runs the callback that ships a port to that process)."""

    def __init__(self) -> None:
        self.sent: tuple[bytes, list[bytes]] | None = None


def _nosy_state(nosy: Nosy) -> int:
    from actors._runtime._core import runtime

    enc = runtime().encoder_now()
    enc.reset()
    data = enc.encode(["inner", torch.ones(2000)])  # (a frame of its own)
    nosy.sent = (data, [bytes(frame) for frame in enc.frames])
    return 7


def test_a_message_encoded_while_another_is_encoded_gets_an_encoder_of_its_own():
    """The process's one encoder was asked for the inner message mid-way through the outer one: its packer was the
    one packing (the inner bytes came out behind the outer's first half, the outer lost that half) and its reset
    took the outer message's frames and handles away."""
    from actors._runtime._core import runtime
    from actors._wire._codec import register_handle

    register_handle("test-nosy", Nosy, _nosy_state, lambda state: ("nosy", state))
    enc = runtime().encoder_now()
    enc.reset()
    nosy = Nosy()
    data = enc.encode(["outer", nosy, torch.zeros(3000)])
    frames = [bytes(frame) for frame in enc.frames]
    assert len(frames) == 1 and enc.handles == [nosy] and not enc.busy
    outer = Decoder().decode(data, frames)
    assert outer[:2] == ["outer", ("nosy", 7)] and torch.equal(outer[2], torch.zeros(3000))
    assert nosy.sent is not None
    inner = Decoder().decode(*nosy.sent)
    assert inner[0] == "inner" and torch.equal(inner[1], torch.ones(2000))


def test_a_batch_record_whose_size_lies_is_dropped_alone_and_credit_stays_encodable(tmp_path):
    """The one-pass decode took each record's size from the framing on trust: a size of -2**63 (or 2**64 - 1) went
    into the port's credit count, whose ``Credit`` then could not be encoded: the receive that was due to credit
    raised ``EncodeError`` after taking its value, and a closing receiver stopped crediting the other senders.
    A size that is not the record's own drops that record alone."""

    from actors._wire._records import Kind, record_prefix

    credits: list[tuple[Any, int, int, int]] = []
    with wired_inbox(tmp_path, credit=lambda *credit: credits.append(credit)) as wired:
        port_id = wired.state.port_id
        first, low, high, last = (msgpack.packb([int(Kind.PORT), port_id, v]) for v in (1, 2, 3, None))
        payload = b"".join(
            (
                record_prefix(0, len(first)) + first,
                b"\x00" + msgpack.packb(-(2**63)) + low,
                b"\x00" + msgpack.packb(2**64 - 1) + high,
                b"\x00" + msgpack.packb(len(last) + 1) + last,  # off by one: a lie too, dropped
                record_prefix(0, len(last)) + last,
            )
        )
        pump_framed(wired, tmp_path, payload)
        assert [(value, size) for value, _, size in wired.state.queue] == [(1, len(first)), (None, len(last))]
        assert wired.drops.count == 3


@dataclasses.dataclass
class Spelled:
    value: int


#: This module as an attribute of itself: ``Spelled`` can be named ``test_codec:ITSELF.ITSELF.Spelled`` and so on.
ITSELF = sys.modules[__name__]


def test_the_dataclass_plans_a_decoder_keeps_stay_bounded_however_many_ways_a_class_is_named():
    """Plans were kept by the name a record gave, for the decoder's life (an inbox's: the process's): a peer naming
    one class through a module that is its own attribute, a new spelling each time, grew the table without end."""
    from actors._wire import _decoder
    from actors._wire._decoder import Decoder

    decoder = Decoder()
    for depth in range(_decoder.MAX_CLASS_PLANS + 200):
        ref = f"{__name__}:{'ITSELF.' * depth}Spelled"
        payload = msgpack.packb(msgpack.ExtType(EXT_DATACLASS, msgpack.packb([ref, [depth]])))
        assert decoder.decode(payload) == Spelled(depth)
    assert len(decoder._classes) <= _decoder.MAX_CLASS_PLANS


def nested_tuples(levels: int, size: int) -> bytes:
    """A value ``levels`` tuples deep around ``size`` bytes, as the wire carries it."""
    body = msgpack.packb([b"x" * size])
    for _ in range(levels - 1):
        body = msgpack.packb([msgpack.ExtType(EXT_TUPLE, body)])
    return msgpack.packb(msgpack.ExtType(EXT_TUPLE, body))


def test_extension_records_nested_one_in_another_may_hold_a_few_times_their_payload_not_64():
    """msgpack hands each extension record a copy of its bytes, alive while the records inside it decode: 64
    tuples one in another around a large value held 64 copies at once (a 1 GiB payload, 64 GiB). They may hold
    eight times their payload now; a value a few levels deep decodes as ever."""
    from actors._wire._decoder import Decoder

    size = 1 << 20
    assert Decoder().decode(nested_tuples(3, size)) == ((((b"x" * size),),),)
    assert len(Decoder().decode(nested_tuples(7, size))) == 1  # (seven levels: within the budget)
    with pytest.raises(DecodeError, match="nested one in another hold"):
        Decoder().decode(nested_tuples(40, size))
    small = nested_tuples(40, 100)  # deep, but small: within the spare
    value = Decoder().decode(small)
    for _ in range(40):
        (value,) = value
    assert value == b"x" * 100
