"""The wire protocol of the ``tcp`` weight transport: one update per connection, raw bytes, checked.

A reader connects to the publisher's weight server and the two prove to each
other that they hold the update's key (an HMAC over fresh nonces, so the key
itself never crosses the wire); then the server sends a short reply and the
update's bytes as they lie in its staging buffer, in chunks, each with a
CRC-32 the server computed when it staged them. No msgpack and no Python
object per chunk: the reader receives straight into its tensor's memory and
checks each chunk while the next one arrives::

    server -> reader   HELLO   magic, server nonce
    reader -> server   REQUEST magic, reader nonce, MAC("get" ...), version, update id
    server -> reader   REPLY   magic, status, total bytes, chunk bytes, chunks, MAC("put" ... crcs)
                       CRCS    one little-endian uint32 per chunk
                       BYTES   the update, total bytes

The bytes are authenticated by the handshake and checked against corruption
by the CRCs; they are not encrypted (see ``docs/multihost.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from .._shared._errors import ChecksumError, WeightSyncError

__all__ = [
    "CHUNK",
    "HELLO",
    "MIN_CHUNK",
    "OK",
    "REFUSED",
    "REPLY",
    "REQUEST",
    "UNKNOWN",
    "TcpHandle",
    "chunk_crcs",
    "receive_exactly",
    "receive_verified",
    "reply_mac",
    "request_mac",
]

MAGIC = b"ACTWTCP1"
NONCE_BYTES = 16
#: Bytes per checked chunk: large enough that a CRC call costs nothing per byte, small enough to overlap.
CHUNK = 4 << 20
#: The smallest chunk a server may send in (a publisher's ``chunk``): its CRC table, read before the reply is
#: authenticated, then holds at most 4 bytes per 4 KiB (a 1-byte chunk would ask 4 bytes per byte).
MIN_CHUNK = 4096
#: Longest update id a request may name.
MAX_ID_BYTES = 200
HELLO = struct.Struct(f"<8s{NONCE_BYTES}s")
REQUEST = struct.Struct(f"<8s{NONCE_BYTES}s32sqH")  # + update id bytes
REPLY = struct.Struct("<8sBqqI32s")  # magic, status, total, chunk, chunks, MAC
#: Reply statuses.
OK, UNKNOWN, REFUSED = 0, 1, 2


@dataclass(frozen=True)
class TcpHandle:
    """Where a ``tcp`` update is served, and the key that proves a reader may have it.

    The key is per publisher, travels only inside manifests (CURVE-encrypted
    between hosts) and is never printed.
    """

    host: str
    port: int
    key: bytes = field(repr=False)


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def request_mac(key: bytes, server_nonce: bytes, reader_nonce: bytes, version: int, update_id: bytes) -> bytes:
    """The reader's proof that it holds ``key``, bound to this connection and this request."""
    message = b"get" + server_nonce + reader_nonce + struct.pack("<q", version) + update_id
    return hmac.digest(key, message, hashlib.sha256)


def reply_mac(
    key: bytes, reader_nonce: bytes, server_nonce: bytes, status: int, total: int, chunk: int, crcs: bytes
) -> bytes:
    """The server's proof that it holds ``key``, covering the reply and every chunk's CRC."""
    message = b"put" + reader_nonce + server_nonce + struct.pack("<Bqq", status, total, chunk) + crcs
    return hmac.digest(key, message, hashlib.sha256)


def chunk_crcs(data: memoryview, chunk: int) -> bytes:
    """CRC-32 of each ``chunk``-byte piece of ``data``, packed as little-endian uint32s."""
    count = -(-len(data) // chunk)
    return struct.pack(f"<{count}I", *(zlib.crc32(data[i * chunk : (i + 1) * chunk]) for i in range(count)))


def receive_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; :class:`ConnectionError` if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the weight server closed the connection after {got} of {len(view)} bytes")
        got += n


def receive_verified(
    sock: socket.socket, data: memoryview, chunk: int, crcs: bytes, checker: Executor, what: str
) -> None:
    """Receive ``data`` chunk by chunk, each checked against its CRC on ``checker`` while the next arrives."""
    expected = struct.unpack(f"<{len(crcs) // 4}I", crcs)
    pending: Future[int] | None = None
    pending_index = -1

    def check(done: Future[int] | None, index: int) -> None:
        if done is not None and done.result() != expected[index]:
            raise ChecksumError(f"{what}: chunk {index} arrived corrupted (CRC-32 mismatch)")

    for index in range(len(expected)):
        piece = data[index * chunk : (index + 1) * chunk]
        receive_exactly(sock, piece)
        check(pending, pending_index)
        pending, pending_index = checker.submit(zlib.crc32, piece), index
    check(pending, pending_index)


def check_reply(
    reply: bytes,
    key: bytes,
    reader_nonce: bytes,
    server_nonce: bytes,
    crcs_of: Callable[[int], bytes],
    most: int,
) -> tuple[int, int, int, bytes]:
    """Unpack and authenticate a reply: status, total, chunk and the CRCs (read by ``crcs_of(count)``).

    A reply offering more than ``most`` bytes (what the manifest allows) is
    refused before its CRC table is read: its sizes are not yet authenticated.
    """
    magic, status, total, chunk, count, mac = REPLY.unpack(reply)
    if magic != MAGIC:
        raise WeightSyncError("the weight server answered with something that is not this protocol")
    if status == UNKNOWN:  # (proved too: an impostor's "stale" would send the consumer waiting for a newer manifest)
        if not hmac.compare_digest(mac, reply_mac(key, reader_nonce, server_nonce, status, 0, 0, b"")):
            raise WeightSyncError("the weight server could not prove it holds the update's key; nothing was read")
        return status, 0, 0, b""
    if status != OK:  # (REFUSED: the server could not check this reader's proof; an error either way)
        return status, 0, 0, b""
    if total < 0 or chunk <= 0 or chunk > 1 << 30 or count != -(-total // chunk):
        raise WeightSyncError(f"the weight server's reply is malformed ({total} bytes in {count} chunks of {chunk})")
    if total > most:
        raise WeightSyncError(
            f"the weight server offers {total} bytes where the manifest allows at most {most}; nothing was read"
        )
    if chunk < min(total, MIN_CHUNK):
        raise WeightSyncError(
            f"the weight server's reply is malformed ({total} bytes in chunks of {chunk}; they are at least "
            f"{MIN_CHUNK}): nothing was read"
        )
    crcs = crcs_of(count)
    if not hmac.compare_digest(mac, reply_mac(key, reader_nonce, server_nonce, status, total, chunk, crcs)):
        raise WeightSyncError("the weight server could not prove it holds the update's key; nothing was read")
    return status, total, chunk, crcs
