"""What spmd.spawn's caller and its ranks say to each other, and how it is framed.

The caller (:mod:`spmd.spawn.parent`) listens on a TCP socket of its own; each rank
(:mod:`spmd.spawn.child`) connects to it once, at start, and keeps the connection until it
ends.  The address and a random token reach the ranks in their environment
(:data:`ADDRESS_VAR`, :data:`TOKEN_VAR`).  A connection carries frames, each a header
(:data:`HEADER`: kind, body length) and a body:

- rank -> caller ``HELLO``: JSON ``{"token", "rank", "size", "pid", "host"}`` and, under
  srun, ``"step"`` (its SLURM job step, ``"123.4"``), sent right after MPI_Init.  JSON,
  not pickle: the caller reads nothing else from a connection, and unpickles nothing
  from it, before the token matches.
- caller -> rank ``JOB``: a pickled dict: ``path`` (the caller's ``sys.path``), ``main``
  (the caller's main script to run as ``__mp_main__``, or None), ``main_file`` (the
  caller's main script, to name its functions' code), ``payload`` (the pickled ``(fn,
  args)``).
- rank -> caller ``RESULT``: a pickled tuple, ``("ok", pickled value)``, ``("error",
  type name, message, traceback text)`` or ``("stopped", ...)`` after a STOP.
- caller -> rank ``STOP``: empty; another rank failed or the job timed out.  The rank
  raises KeyboardInterrupt in its main thread, and leaves.

A rank whose connection ends before its RESULT died: TCP delivers what a process sent
before it ended, so a result is never lost to the rank's exit.  A rank whose caller's
connection ends (the caller is gone) exits at once.

Constants and framing only: both sides import this without importing the other.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["ADDRESS_VAR", "HEADER", "HELLO", "JOB", "MAX_HELLO", "RESULT", "STOP",
           "TOKEN_VAR", "FrameReader", "frame", "recv_frame"]

ADDRESS_VAR = "SPMD_SPAWN_ADDRESS"   # host:port the caller listens on
TOKEN_VAR = "SPMD_SPAWN_TOKEN"       # what a rank's HELLO must carry

HEADER = struct.Struct("!BQ")        # kind, body length in bytes
HELLO, JOB, RESULT, STOP = 1, 2, 3, 4
# The largest frame the caller reads from a connection that has not shown the token; a
# HELLO is some 150 bytes.
MAX_HELLO = 4096


def frame(kind: int, body: bytes = b"") -> bytes:
    """The header of a frame of ``kind`` whose body is ``body``, followed by the body."""
    return HEADER.pack(kind, len(body)) + body


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


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame from a blocking socket, as ``(kind, body)``; None once it is closed."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    kind, length = HEADER.unpack(header)
    body = _recv_exactly(sock, length) if length else b""
    return None if body is None else (kind, body)
