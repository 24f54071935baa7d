"""The message layouts that travel between processes.

A ZeroMQ message is ``[header][payload][buffer 0..n]``. The header is msgpack
``[PROTOCOL_VERSION, sender_address, sender_pid]``. The payload is a batch:
for each message, its frame count and byte length (msgpack uints), then the
message itself. Each message's tensors refer to its own run of buffer frames,
and a message that cannot be decoded is dropped alone.

Every message is a msgpack array whose first item is its kind:

=========  =====================================================================
kind       fields after the kind
=========  =====================================================================
CALL       call_id, actor, method, reply_address, reply_pid, rank, args_blob, reply_port
REPLY      call_id, rank, ok, value (or an error record)
PORT       port_id, value
CREDIT     port_id, messages, bytes            (flow control for ports)
ATTACH     port_id, pid                         (a process now holds a sender)
CONTROL    op, argument                         (worker → owner: failure reports)
=========  =====================================================================

``args_blob`` is itself an encoded ``[args, kwargs]``: it is decoded only once
the target actor exists, so its dataclasses are loaded by then. Spawning and
stopping actors are calls to the reserved actor ``__host__`` of a process.
An error record is ``[type_name, message, traceback, spawn_failed]``.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1

CALL = 1
REPLY = 2
PORT = 3
CREDIT = 4
ATTACH = 5
CONTROL = 6

#: Number of fields (including the kind) for each message kind.
ARITY = {CALL: 9, REPLY: 5, PORT: 3, CREDIT: 4, ATTACH: 3, CONTROL: 3}

# Control operations.
OP_FAILURE = "failure"  # worker → owner: a fire-and-forget endpoint raised


def port_prefix(port_id: int) -> bytes:
    """The packed start of a PORT message for ``port_id``; the value is packed after it."""
    import msgpack

    return b"\x93" + msgpack.packb(PORT) + msgpack.packb(port_id)  # type: ignore[no-any-return]
