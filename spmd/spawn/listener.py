"""The caller's end of spawn's channel: its listening socket, and each connection on it,
from its accept until it proves it is a rank of the job (:mod:`spmd.spawn.protocol`).

Anybody who can reach the address can connect, so a connection is a stranger until its
HELLO carries a matching proof, and strangers are kept on a short leash:

- one that has not shown that HELLO within :data:`HELLO_WAIT` seconds of its accept is
  closed;
- at most :data:`MAX_PENDING` strangers are held; one more closes the oldest (a rank
  whose connection is closed before its job connects again, so a real rank loses at
  most a retry, while idle connections cannot pile up);
- when accept fails for want of descriptors or memory (``EMFILE``, ``ENFILE``,
  ``ENOBUFS``, ``ENOMEM``), the oldest stranger is closed to make room; with none, the
  listener is left unwatched for a while (50 ms, doubling up to 1 s; the connections
  wait in the kernel's backlog), and :meth:`Listener.trouble` says since when accepting
  has failed and why, for the job to give up with that reason.  Nothing of it reaches
  the job as an ``OSError``.

The caller reads nothing from a stranger but two small JSON frames (:data:`MAX_HELLO`),
and unpickles nothing from it.  All I/O is nonblocking; :meth:`Listener.serve` does
what is ready and hands the job the frames of its ranks.
"""

from __future__ import annotations

import errno
import json
import resource
import selectors
import socket
import time
from collections import deque

from spmd.spawn.protocol import (
    CALLER,
    CHALLENGE,
    HELLO,
    MAX_HELLO,
    PROOF,
    RANK,
    FrameReader,
    frame,
    new_nonce,
    parse_json,
    proof,
    proof_matches,
    valid_nonce,
)

__all__ = ["HELLO_WAIT", "MAX_PENDING", "Connection", "Listener"]

HELLO_WAIT = 5.0     # seconds from accept to a proved HELLO
MAX_PENDING = 64     # connections held that have not proved it yet
_ACCEPT_BURST = 32   # accepts per serve, so a flood of connections cannot starve the ranks
_PAUSE_MIN, _PAUSE_MAX = 0.05, 1.0
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Connection:
    """A connection, nonblocking: frames in, bytes queued out.  ``hello`` is the proved
    HELLO (None until then); ``rank`` is set by the job once it takes the connection."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.reader = FrameReader()
        self.outbox: deque[memoryview] = deque()
        self.deadline = deadline        # for its HELLO
        self.nonce: str | None = None   # the challenge the caller sent it
        self.hello: dict | None = None
        self.rank: int | None = None
        self.closed = False

    def receive(self) -> list[tuple[int, bytes]] | None:
        """The frames that arrived; None once the other end is closed."""
        try:
            data = self.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return None
        return self.reader.feed(data) if data else None

    def flush(self) -> None:
        """Send what the socket takes now; a peer gone drops the rest (its end says so)."""
        try:
            while self.outbox:
                sent = self.sock.send(self.outbox[0])
                if sent < len(self.outbox[0]):
                    self.outbox[0] = self.outbox[0][sent:]
                    return
                self.outbox.popleft()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.outbox.clear()


class Listener:
    """The caller's listening socket at ``host`` (port chosen by the system) and its
    connections.

    Raises:
        OSError: the socket cannot be made or bound.
    """

    def __init__(self, host: str, token: str, backlog: int, *, hello_wait: float = HELLO_WAIT,
                 max_pending: int = MAX_PENDING):
        self._token, self._hello_wait, self._max_pending = token, hello_wait, max_pending
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind((host, 0))
            self.sock.listen(backlog)
            self.sock.setblocking(False)
            self.selector = selectors.DefaultSelector()
        except OSError:
            self.sock.close()
            raise
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.selector.register(self.sock, selectors.EVENT_READ)
        self._connections: set[Connection] = set()
        self._pending: dict[Connection, None] = {}   # strangers, oldest first
        self._paused_until: float | None = None
        self._pause = _PAUSE_MIN
        self._failing_since: float | None = None
        self._failure: OSError | None = None

    # -- what the job calls ----------------------------------------------------------
    def serve(self, wait: float, admit: bool = True
              ) -> tuple[int, list[tuple[Connection, list[tuple[int, bytes]] | None]]]:
        """Accept, read and write what is ready within ``wait`` seconds.

        Args:
            admit: answer new connections' challenges; False (the job is ending): close
                them instead.

        Returns:
            The number of events served, and what came from the job's connections: for
            each, its frames (a connection's proved HELLO first, as ``(HELLO, body)``),
            or None when it ended (it is closed).
        """
        now = time.monotonic()
        self._expire(now)
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self.selector.register(self.sock, selectors.EVENT_READ)
        out: list[tuple[Connection, list[tuple[int, bytes]] | None]] = []
        events = self.selector.select(wait)
        for key, mask in events:
            if key.fileobj is self.sock:
                self._accept()
                continue
            conn: Connection = key.data
            if conn.closed:
                continue   # closed by an earlier event of this round
            if mask & selectors.EVENT_WRITE:
                conn.flush()
                if not conn.outbox:
                    self.selector.modify(conn.sock, selectors.EVENT_READ, conn)
            if mask & selectors.EVENT_READ:
                frames = conn.receive()
                if frames is None:
                    self.close(conn)
                    if conn.hello is not None:
                        out.append((conn, None))
                    continue
                if conn.hello is None:
                    frames = self._handshake(conn, frames, admit)
                    if conn.hello is None and not conn.closed \
                            and conn.reader.pending() > MAX_HELLO:
                        self.close(conn)
                if frames:
                    out.append((conn, frames))
        return len(events), out

    def send(self, conn: Connection, data: bytes) -> None:
        """Queue ``data`` to ``conn``; what the socket does not take now goes when it can."""
        conn.outbox.append(memoryview(data))
        conn.flush()
        if conn.outbox and not conn.closed:
            self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def close(self, conn: Connection) -> None:
        if not conn.closed:
            conn.closed = True
            self._connections.discard(conn)
            self._pending.pop(conn, None)
            self.selector.unregister(conn.sock)
            conn.sock.close()

    def close_all(self) -> None:
        """Close every connection, the listening socket and the selector."""
        for conn in list(self._connections):
            self.close(conn)
        self.selector.close()
        self.sock.close()

    def trouble(self) -> tuple[float, str] | None:
        """Since when (``time.monotonic()``) accepting has failed, with no connection
        accepted since, and why; None while it works."""
        if self._failing_since is None or self._failure is None:
            return None
        code = errno.errorcode.get(self._failure.errno or 0, "?")
        why = f"{str(self._failure.strerror or self._failure).lower()} ({code})"
        if self._failure.errno == errno.EMFILE:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            why += (f"; this process has all the {soft} descriptors its RLIMIT_NOFILE allows "
                    "open: close files or raise the limit (ulimit -n)")
        return self._failing_since, why

    # -- inside ----------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    continue   # that connection is gone already (ECONNABORTED, ...)
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                self._failure = exc
                if self._pending:
                    self.close(next(iter(self._pending)))   # room for the next
                    continue
                self._pause_accepting()
                return
            self._failing_since, self._failure, self._pause = None, None, _PAUSE_MIN
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            conn = Connection(sock, time.monotonic() + self._hello_wait)
            self._connections.add(conn)
            self._pending[conn] = None
            self.selector.register(sock, selectors.EVENT_READ, conn)
            if len(self._pending) > self._max_pending:
                self.close(next(iter(self._pending)))

    def _pause_accepting(self) -> None:
        """Stop watching the listening socket for a while: it stays readable while a
        connection waits that cannot be accepted, and watching it would spin."""
        self.selector.unregister(self.sock)
        self._paused_until = time.monotonic() + self._pause
        self._pause = min(self._pause * 2, _PAUSE_MAX)

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            self.close(oldest)

    def _handshake(self, conn: Connection, frames: list[tuple[int, bytes]],
                   admit: bool) -> list[tuple[int, bytes]]:
        """A stranger's frames: a CHALLENGE is answered, a HELLO whose proof matches makes
        it the job's (it and the frames after it are returned); anything else, or
        anything once the job is ending, closes it."""
        for i, (kind, body) in enumerate(frames):
            message = parse_json(body)
            if not admit or message is None:
                break
            if kind == CHALLENGE and conn.nonce is None and valid_nonce(message.get("nonce")):
                conn.nonce = new_nonce()
                self.send(conn, frame(PROOF, json.dumps({
                    "proof": proof(self._token, message["nonce"], CALLER),
                    "nonce": conn.nonce}).encode()))
            elif kind == HELLO and conn.nonce is not None and \
                    proof_matches(self._token, conn.nonce, RANK, message.get("proof")):
                conn.hello = message
                del self._pending[conn]
                return frames[i:]
            else:
                break
        else:
            return []
        self.close(conn)
        return []
