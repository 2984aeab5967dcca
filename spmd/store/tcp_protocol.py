"""The TCP store's wire protocol: how its requests and replies are framed, and its codes.

All integers are unsigned 32-bit big-endian: every message is ``length, body``; a body
is one code byte followed by any number of fields, each ``length, bytes``.  Requests
carry an opcode; replies carry a status (OK, TIMEOUT with the missing keys, or ERROR
with a message).  Numbers (amounts, timeouts, counts) travel as decimal ASCII.  The first
request on a connection must be HELLO with the protocol magic and the token; the server
answers ERROR "token rejected" and hangs up if the token does not match, or OK with the
largest request it takes (a field older clients ignore).  Blocking requests (GET, WAIT,
MGET) carry their timeout and wait in the server's thread for that client.
"""

from __future__ import annotations

import socket
import struct

__all__: list[str] = []

MAGIC = b"spmd-tcpstore-1"
U32 = struct.Struct("!I")
(HELLO, SET, GET, ADD, CAS, WAIT, CHECK, DELETE, NUMKEYS, MGET, MSET) = range(11)
OP_NAMES = {SET: "set", GET: "get", ADD: "add", CAS: "compare_set", WAIT: "wait",
            CHECK: "check", DELETE: "delete_key", NUMKEYS: "num_keys",
            MGET: "multi_get", MSET: "multi_set"}
OK, TIMEOUT, ERROR = 0, 1, 2
TOKEN_REJECTED = b"token rejected"

MAX_TOKEN = 2048        # bytes; so that a HELLO always fits HANDSHAKE_LIMIT
HANDSHAKE_LIMIT = 4096  # bytes a client may announce before its token is checked


def pack(code: int, fields) -> bytes:
    """One message: ``code`` and ``fields``, framed."""
    parts = [bytes([code])]
    for f in fields:
        parts += [U32.pack(len(f)), f]
    body = b"".join(parts)
    return U32.pack(len(body)) + body


class MessageTooLarge(ValueError):
    """A peer announced a message longer than the reader takes."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"message of {size} bytes, at most {limit} accepted")
        self.size, self.limit = size, limit


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        buf += chunk
    return bytes(buf)


def parse(body: bytes):
    """Split a message body into (code, fields).  ValueError if it is malformed."""
    n = len(body)
    if n == 0:
        raise ValueError("empty message")
    fields, off = [], 1
    while off < n:
        if off + 4 > n:
            raise ValueError("truncated field header")
        (size,) = U32.unpack_from(body, off)
        off += 4
        if off + size > n:
            raise ValueError("truncated field")
        fields.append(body[off : off + size])
        off += size
    return body[0], fields


def recv_msg(sock: socket.socket, limit: int | None = None):
    """Read one message; return (code, fields).

    Raises:
        MessageTooLarge: the announced length is over `limit` (nothing more is read).
        ValueError: the message is malformed.
    """
    (n,) = U32.unpack(_recv_exact(sock, 4))
    if limit is not None and n > limit:
        raise MessageTooLarge(n, limit)
    return parse(_recv_exact(sock, n))


def decode_keys(fields) -> list:
    """The keys a request's fields carry (UTF-8)."""
    return [f.decode("utf-8") for f in fields]
