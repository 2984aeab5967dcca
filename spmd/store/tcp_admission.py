"""Admission to the TCP store's server: the thread that lets clients in and keeps strangers out.

The server is built so that a stranger on the network cannot stall or starve it.  One
thread runs a selector over the listening socket and the connections that have not
yet authenticated: it reads their HELLO without blocking, at most ``HANDSHAKE_LIMIT``
bytes of it (``spmd.store.tcp_protocol``), and drops a connection that has not finished
it by one deadline for the whole handshake (not per read).  At most
``_MAX_UNAUTHENTICATED`` such connections are held; a new one evicts the oldest, since a
real client sends its HELLO the moment it connects while an idle stranger only ages
(refusing newcomers instead would let a few idle connections, renewed at each deadline,
lock every worker out).  Running out of descriptors on accept gives back the oldest
unauthenticated connection, or pauses accepting briefly, and is reported once; it never
stops the server.  A connection that authenticated is handed to the server (``admit``),
which gives it a thread of its own, as its blocking requests need.
"""

from __future__ import annotations

import errno
import hmac
import selectors
import socket
import threading
import time
import warnings
from collections.abc import Callable

from spmd.store.tcp_protocol import (
    ERROR,
    HANDSHAKE_LIMIT,
    HELLO,
    MAGIC,
    TOKEN_REJECTED,
    U32,
    pack,
    parse,
)

__all__: list[str] = []

_MAX_UNAUTHENTICATED = 64           # connections held while they have not sent their HELLO
_ACCEPT_BATCH = 64                  # accepts per wake-up, so pending handshakes are read in between
_ACCEPT_PAUSE = 0.1                 # s without accepting when descriptors ran out
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Handshake:
    """A connection that has not authenticated yet: what it sent so far, its deadline."""

    __slots__ = ("sock", "deadline", "buf", "size")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.size = -1  # the announced body length, once its 4 bytes are in


class Admission:
    """The listening socket and its selector thread: handshakes read, checked, and the
    authenticated connections handed to ``admit`` (blocking, in the selector thread)."""

    def __init__(self, address, family, token: bytes | None, handshake_timeout: float,
                 admit: Callable[[socket.socket], None]):
        self.token = token
        self.handshake_timeout = handshake_timeout
        self._admit = admit
        self._handshakes: dict[socket.socket, _Handshake] = {}  # in accept order: oldest first
        self._stopping = False
        self._warned_descriptors = False
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(socket.SOMAXCONN)
            self.socket.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the selector
            try:
                self._selector = selectors.DefaultSelector()
            except BaseException:
                self._wake_r.close()
                self._wake_w.close()
                raise
        except BaseException:
            self.socket.close()
            raise
        self.port: int = self.socket.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name=f"spmd-tcpstore-{self.port}",
                                       daemon=True)

    def _serve(self) -> None:
        sel = self._selector
        sel.register(self._wake_r, selectors.EVENT_READ)
        sel.register(self.socket, selectors.EVENT_READ)
        paused_until = 0.0  # accepting resumes then (descriptors ran out)
        try:
            while not self._stopping:
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    sel.register(self.socket, selectors.EVENT_READ)
                    paused_until = 0.0
                wake = [self._oldest().deadline] if self._handshakes else []
                if paused_until:
                    wake.append(paused_until)
                events = sel.select(max(0.0, min(wake) - now) if wake else None)
                for key, _ in events:
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif key.fileobj is self.socket:
                        if self._accept():
                            sel.unregister(self.socket)
                            paused_until = time.monotonic() + _ACCEPT_PAUSE
                    else:
                        h: _Handshake = key.data
                        if self._handshakes.get(h.sock) is h:  # not dropped meanwhile
                            self._read_hello(h)
                self._expire(time.monotonic())
        finally:
            for h in list(self._handshakes.values()):
                self._drop(h, None)
            sel.close()
            for s in (self.socket, self._wake_r, self._wake_w):
                s.close()

    def _accept(self) -> bool:
        """Accept what is waiting; return True to pause accepting (out of descriptors)."""
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return False
            except OSError as e:
                if e.errno not in _OUT_OF_DESCRIPTORS:
                    continue  # e.g. ECONNABORTED: that client is gone already
                self._report_descriptors(e)
                if not self._handshakes:
                    return True  # nothing of ours to give back: wait for descriptors
                self._drop(self._oldest(), b"server out of file descriptors")
                continue
            if len(self._handshakes) >= _MAX_UNAUTHENTICATED:
                self._drop(self._oldest(), b"too many connections waiting for their handshake")
            try:
                sock.setblocking(False)
                h = _Handshake(sock, time.monotonic() + self.handshake_timeout)
                self._selector.register(sock, selectors.EVENT_READ, h)
            except (OSError, ValueError):
                sock.close()
                continue
            self._handshakes[sock] = h
            self._read_hello(h)  # a real client's HELLO is usually there already
        return False

    def _oldest(self) -> _Handshake:
        return next(iter(self._handshakes.values()))

    def _report_descriptors(self, e: OSError) -> None:
        if self._warned_descriptors:
            return
        self._warned_descriptors = True
        try:
            warnings.warn(
                f"spmd TCPStore server on port {self.port}: accept failed ({e.strerror}); "
                "dropping connections that have not authenticated and pausing accepts until "
                "descriptors are free (raise the limit: ulimit -n)", RuntimeWarning, stacklevel=1)
        except Exception:
            pass  # warnings turned into errors must not stop the server

    def _read_hello(self, h: _Handshake) -> None:
        """Read what the connection sent of its HELLO; authenticate it once complete."""
        while True:
            need = 4 if h.size < 0 else 4 + h.size
            try:
                chunk = h.sock.recv(need - len(h.buf))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(h, None)
                return
            if not chunk:
                self._drop(h, None)
                return
            h.buf += chunk
            if h.size < 0:
                if len(h.buf) < 4:
                    continue
                (h.size,) = U32.unpack(h.buf)
                if not 0 < h.size <= HANDSHAKE_LIMIT:
                    self._drop(h, f"handshake message of {h.size} bytes refused: at most "
                                  f"{HANDSHAKE_LIMIT} before the token is checked".encode())
                    return
            elif len(h.buf) == 4 + h.size:
                self._authenticate(h)
                return

    def _authenticate(self, h: _Handshake) -> None:
        try:
            code, fields = parse(bytes(h.buf[4:]))
        except ValueError:
            code, fields = -1, []
        if code != HELLO or len(fields) != 2 or fields[0] != MAGIC:
            self._drop(h, b"protocol mismatch: not an spmd TCPStore client")
            return
        if self.token is not None and not hmac.compare_digest(fields[1], self.token):
            self._drop(h, TOKEN_REJECTED)
            return
        self._forget(h)
        self._admit(h.sock)

    def _expire(self, now: float) -> None:
        while self._handshakes:
            h = self._oldest()  # accept order is deadline order
            if h.deadline > now:
                return
            self._drop(h, f"handshake not completed within {self.handshake_timeout:g} s".encode())

    def _forget(self, h: _Handshake) -> None:
        del self._handshakes[h.sock]
        try:
            self._selector.unregister(h.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, h: _Handshake, reason: bytes | None) -> None:
        """Close a connection that did not authenticate, telling it why if it listens."""
        self._forget(h)
        if reason is not None:
            try:
                h.sock.send(pack(ERROR, [reason]))  # small: fits the empty send buffer
            except OSError:
                pass
        h.sock.close()

    def start(self) -> None:
        self.thread.start()

    def pending(self) -> int:
        """Connections that have not authenticated yet."""
        return len(self._handshakes)

    def stop(self) -> None:
        """Stop accepting and drop pending handshakes (the thread closes the listening
        socket as it ends)."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the selector thread has ended and closed it
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(10)
