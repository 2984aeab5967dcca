"""What spmd.spawn's caller and its ranks say to each other, and how it is framed.

The caller (:mod:`spmd.spawn.parent`) listens on a TCP socket of its own; each rank
(:mod:`spmd.spawn.child`) connects to it once, at start, and keeps the connection until it
ends.  The address and a random 128-bit token reach the ranks in their environment
(:data:`ADDRESS_VAR`, :data:`TOKEN_VAR`).  A connection carries frames, each a header
(:data:`HEADER`: kind, body length) and a body.

It opens with a handshake in which each end proves it knows the token without sending
it (HMAC-SHA256 of a nonce the other end chose; :func:`proof`).  Nothing either end
unpickles comes from a connection before the other end has proved it:

- rank -> caller ``CHALLENGE``: JSON ``{"nonce"}``, a fresh random nonce.
- caller -> rank ``PROOF``: JSON ``{"proof", "nonce"}``: ``proof(token, the rank's nonce,
  "caller")``, and a fresh nonce of the caller's.  A rank whose caller's proof does not
  match sends nothing more and unpickles nothing (:class:`HandshakeError`).
- rank -> caller ``HELLO``: JSON ``{"proof", "rank", "size", "pid", "host"}``, with
  ``proof(token, the caller's nonce, "rank")`` and, under srun, ``"step"`` (its SLURM job
  step, ``"123.4"``).  The caller drops a connection whose HELLO has not shown a matching
  proof within a few seconds of its arrival.
- caller -> rank ``JOB``: a pickled dict: ``path`` (the caller's ``sys.path``), ``main``
  (the caller's main script to run as ``__mp_main__``, or None), ``main_file`` (the
  caller's main script, to name its functions' code), ``payload`` (the pickled ``(fn,
  args)``).
- rank -> caller ``RESULT``: a pickled tuple, ``("ok", pickled value)``, ``("error",
  type name, message, traceback text)`` or ``("stopped", ...)`` after a STOP.
- caller -> rank ``STOP``: empty; another rank failed or the job timed out.  The rank
  raises KeyboardInterrupt in its main thread, and leaves.

The handshake authenticates the two ends; it does not encrypt or sign the frames after
it (the channel runs inside the cluster, as MPI's own traffic does).  A rank whose
connection ends before its JOB connects again (the caller sheds connections it has no
room for); one whose connection ends after it exits: the caller is gone.  A rank whose
connection ends before its RESULT died: TCP delivers what a process sent before it
ended, so a result is never lost to the rank's exit.

Constants, framing and the handshake's pieces: both sides import this without importing
the other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import socket
import struct
import time
from typing import Any

from spmd.core.errors import DistNetworkError

__all__ = ["ADDRESS_VAR", "CALLER", "CHALLENGE", "HANDSHAKE_TIMEOUT", "HEADER", "HELLO",
           "JOB", "MAX_HELLO", "PROOF", "RANK", "RESULT", "STOP", "TOKEN_VAR", "FrameReader",
           "HandshakeError", "frame", "new_nonce", "parse_json", "proof", "proof_matches",
           "rank_handshake", "recv_frame", "valid_nonce"]

ADDRESS_VAR = "SPMD_SPAWN_ADDRESS"   # host:port the caller listens on
TOKEN_VAR = "SPMD_SPAWN_TOKEN"       # the secret both ends prove they know

HEADER = struct.Struct("!BQ")        # kind, body length in bytes
HELLO, JOB, RESULT, STOP, CHALLENGE, PROOF = 1, 2, 3, 4, 5, 6
# The largest frame either end reads from a connection whose other end has not proved it
# knows the token; a HELLO is some 250 bytes.
MAX_HELLO = 4096
# How long a rank waits for its caller's proof and its job, start to end, however many
# times it connects.  The caller answers while join() serves the job, so with
# spawn(join=False) the ranks wait for join() this long.
HANDSHAKE_TIMEOUT = 300.0
CALLER, RANK = "caller", "rank"      # which end a proof is from: none is the other's
_NONCE = re.compile(r"[0-9a-f]{32}")


class HandshakeError(DistNetworkError):
    """The other end of spawn's channel did not prove it knows the job's token."""


def frame(kind: int, body: bytes = b"") -> bytes:
    """The header of a frame of ``kind`` whose body is ``body``, followed by the body."""
    return HEADER.pack(kind, len(body)) + body


def new_nonce() -> str:
    """A fresh 128-bit random nonce, in hex."""
    return secrets.token_hex(16)


def proof(token: str, nonce: str, end: str) -> str:
    """What ``end`` (:data:`CALLER` or :data:`RANK`) answers to ``nonce``: HMAC-SHA256
    keyed by the token, so only an end that knows it can answer, and the answer tells
    nothing of it; ``end`` is in the message, so an answer cannot be sent back as the
    other end's."""
    return hmac.new(token.encode(), f"{end}:{nonce}".encode(), hashlib.sha256).hexdigest()


def proof_matches(token: str, nonce: str, end: str, claimed: Any) -> bool:
    """Whether ``claimed`` is ``end``'s proof for ``nonce`` (in constant time)."""
    return isinstance(claimed, str) and hmac.compare_digest(
        claimed.encode(), proof(token, nonce, end).encode())


def parse_json(body: bytes) -> dict | None:
    """A handshake frame's JSON object, or None for anything else."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def valid_nonce(value: Any) -> bool:
    """Whether ``value`` is a nonce as :func:`new_nonce` makes them."""
    return isinstance(value, str) and _NONCE.fullmatch(value) is not None


class FrameReader:
    """Cuts the bytes a nonblocking connection delivers, in whatever pieces, into frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """Add ``data``; the frames it completed, as ``(kind, body)``."""
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buffer)
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((kind, bytes(self._buffer[HEADER.size:end])))
            del self._buffer[:end]
        return frames

    def pending(self) -> int:
        """Bytes announced or received for the frame not yet complete."""
        if len(self._buffer) < HEADER.size:
            return len(self._buffer)
        return HEADER.size + HEADER.unpack_from(self._buffer)[1]


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None) -> bytes | None:
    chunks, left = [], size
    while left:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, limit: int | None = None,
               deadline: float | None = None) -> tuple[int, bytes] | None:
    """The next frame from a blocking socket, as ``(kind, body)``; None once it is closed.

    Args:
        limit: the largest body taken; a longer one raises :class:`HandshakeError`
            before any of it is read.
        deadline: ``time.monotonic()`` by which the frame must have come, else
            ``TimeoutError``; None: no limit (and the socket's own timeout stays).
    """
    header = _recv_exactly(sock, HEADER.size, deadline)
    if header is None:
        return None
    kind, length = HEADER.unpack(header)
    if limit is not None and length > limit:
        raise HandshakeError(f"a frame of kind {kind} announces {length} bytes, more than "
                             f"the {limit} a handshake frame may have")
    body = _recv_exactly(sock, length, deadline) if length else b""
    return None if body is None else (kind, body)


def rank_handshake(sock: socket.socket, token: str, hello: dict, deadline: float) -> bool:
    """The rank's half of the handshake on a connected blocking socket: challenge the
    caller, check its proof, then send ``hello`` with the rank's own proof.

    Returns:
        True once the HELLO is sent; False when the connection ended before the caller
        answered (the caller shed it, or is ending the job: connect again).

    Raises:
        HandshakeError: the other end answered without a matching proof; nothing but the
            challenge was sent to it, and nothing it sent was unpickled.
        TimeoutError: no answer by ``deadline``.
    """
    nonce = new_nonce()
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(frame(CHALLENGE, json.dumps({"nonce": nonce}).encode()))
    answer = recv_frame(sock, limit=MAX_HELLO, deadline=deadline)
    if answer is None:
        return False
    kind, body = answer
    if kind != PROOF:
        raise HandshakeError(f"it sent a frame of kind {kind} where the proof (kind {PROOF}) "
                             "that it knows the job's token belongs")
    reply = parse_json(body)
    if reply is None or not proof_matches(token, nonce, CALLER, reply.get("proof")):
        raise HandshakeError("its proof that it knows the job's token does not match")
    if not valid_nonce(reply.get("nonce")):
        raise HandshakeError("its challenge is not a 128-bit nonce in hex")
    message = {**hello, "proof": proof(token, reply["nonce"], RANK)}
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(frame(HELLO, json.dumps(message).encode()))
    return True
