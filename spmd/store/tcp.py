"""TCPStore: a store served over TCP by daemon threads of the master process.

Wire protocol (all integers unsigned 32-bit big-endian): every message is
``length, body``; a body is one code byte followed by any number of fields, each
``length, bytes``.  Requests carry an opcode; replies carry a status (OK, TIMEOUT
with the missing keys, or ERROR with a message).  Numbers (amounts, timeouts,
counts) travel as decimal ASCII.  The first request on a connection must be HELLO
with the protocol magic and the token; the server answers ERROR "token rejected"
and hangs up if the token does not match, or OK with the largest request it takes
(a field older clients ignore).  Blocking requests (GET, WAIT, MGET) carry their
timeout and wait in the server's thread for that client.

The server is built so that a stranger on the network cannot stall or starve it.  One
thread runs a selector over the listening socket and the connections that have not
yet authenticated: it reads their HELLO without blocking, at most
``_HANDSHAKE_LIMIT`` bytes of it, and drops a connection that has not finished it
by one deadline for the whole handshake (not per read).  At most
``_MAX_UNAUTHENTICATED`` such connections are held; a new one evicts the oldest,
since a real client sends its HELLO the moment it connects while an idle stranger
only ages (refusing newcomers instead would let a few idle connections, renewed at
each deadline, lock every worker out).  Running out of descriptors on accept gives
back the oldest unauthenticated connection, or pauses accepting briefly, and is
reported once; it never stops the server.  A client that authenticated gets a thread
of its own, as its blocking requests need, and requests up to ``max_message_size``.
"""

from __future__ import annotations

import errno
import hmac
import numbers
import selectors
import socket
import struct
import threading
import time
import warnings

from spmd.core.errors import DistNetworkError, DistStoreError
from spmd.core.timeouts import to_seconds
from spmd.core.typing import Timeout
from spmd.store.base import DEFAULT_TIMEOUT, HashStore, Store

__all__ = ["DEFAULT_MAX_MESSAGE_SIZE", "TCPStore"]

_MAGIC = b"spmd-tcpstore-1"
_U32 = struct.Struct("!I")
(_HELLO, _SET, _GET, _ADD, _CAS, _WAIT, _CHECK, _DELETE, _NUMKEYS, _MGET, _MSET) = range(11)
_OP_NAMES = {_SET: "set", _GET: "get", _ADD: "add", _CAS: "compare_set", _WAIT: "wait",
             _CHECK: "check", _DELETE: "delete_key", _NUMKEYS: "num_keys",
             _MGET: "multi_get", _MSET: "multi_set"}
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_TOKEN_REJECTED = b"token rejected"

DEFAULT_MAX_MESSAGE_SIZE = 1 << 30  # bytes of one request from an authenticated client
_MAX_TOKEN = 2048                   # bytes; so that a HELLO always fits _HANDSHAKE_LIMIT
_HANDSHAKE_LIMIT = 4096             # bytes a client may announce before its token is checked
_MAX_UNAUTHENTICATED = 64           # connections held while they have not sent their HELLO
_HANDSHAKE_TIMEOUT_MAX = 10.0       # s; the default handshake deadline is the store timeout, capped
_ACCEPT_BATCH = 64                  # accepts per wake-up, so pending handshakes are read in between
_ACCEPT_PAUSE = 0.1                 # s without accepting when descriptors ran out
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def _pack(code: int, fields) -> bytes:
    parts = [bytes([code])]
    for f in fields:
        parts += [_U32.pack(len(f)), f]
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


class _MessageTooLarge(ValueError):
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


def _parse(body: bytes):
    """Split a message body into (code, fields).  ValueError if it is malformed."""
    n = len(body)
    if n == 0:
        raise ValueError("empty message")
    fields, off = [], 1
    while off < n:
        if off + 4 > n:
            raise ValueError("truncated field header")
        (size,) = _U32.unpack_from(body, off)
        off += 4
        if off + size > n:
            raise ValueError("truncated field")
        fields.append(body[off : off + size])
        off += size
    return body[0], fields


def _recv_msg(sock: socket.socket, limit: int | None = None):
    """Read one message; return (code, fields).

    Raises:
        _MessageTooLarge: the announced length is over `limit` (nothing more is read).
        ValueError: the message is malformed.
    """
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if limit is not None and n > limit:
        raise _MessageTooLarge(n, limit)
    return _parse(_recv_exact(sock, n))


def _keys(fields) -> list:
    return [f.decode("utf-8") for f in fields]


# ----------------------------------------------------------------------------- server
class _Handshake:
    """A connection that has not authenticated yet: what it sent so far, its deadline."""

    __slots__ = ("sock", "deadline", "buf", "size")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.buf = bytearray()
        self.size = -1  # the announced body length, once its 4 bytes are in


class _Server:
    """The master's server: a selector thread for handshakes, a thread per client after."""

    def __init__(self, address, family, token: bytes | None, handshake_timeout: float,
                 max_message_size: int):
        self.backend = HashStore()
        self.token = token
        self.handshake_timeout = handshake_timeout
        self.max_message_size = max_message_size
        self.cond = threading.Condition()
        self.joined = 0  # clients that passed the handshake
        self.sessions: set = set()  # their sockets, to wake their threads at close
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

    # ------------------------------------------------------------------ selector thread
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
                (h.size,) = _U32.unpack(h.buf)
                if not 0 < h.size <= _HANDSHAKE_LIMIT:
                    self._drop(h, f"handshake message of {h.size} bytes refused: at most "
                                  f"{_HANDSHAKE_LIMIT} before the token is checked".encode())
                    return
            elif len(h.buf) == 4 + h.size:
                self._authenticate(h)
                return

    def _authenticate(self, h: _Handshake) -> None:
        try:
            code, fields = _parse(bytes(h.buf[4:]))
        except ValueError:
            code, fields = -1, []
        if code != _HELLO or len(fields) != 2 or fields[0] != _MAGIC:
            self._drop(h, b"protocol mismatch: not an spmd TCPStore client")
            return
        if self.token is not None and not hmac.compare_digest(fields[1], self.token):
            self._drop(h, _TOKEN_REJECTED)
            return
        self._forget(h)
        sock = h.sock
        with self.cond:
            self.sessions.add(sock)
        try:
            sock.setblocking(True)
            threading.Thread(target=self._session, args=(sock,), daemon=True,
                             name=f"spmd-tcpstore-{self.port}-client").start()
        except (OSError, RuntimeError):  # no thread to be had: this client cannot be served
            with self.cond:
                self.sessions.discard(sock)
            sock.close()

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
                h.sock.send(_pack(_ERROR, [reason]))  # small: fits the empty send buffer
            except OSError:
                pass
        h.sock.close()

    # ------------------------------------------------------------------ client threads
    def _session(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                self.joined += 1
                self.cond.notify_all()
            sock.sendall(_pack(_OK, [str(self.max_message_size).encode()]))
            while True:
                try:
                    code, fields = _recv_msg(sock, self.max_message_size)
                except _MessageTooLarge as e:
                    sock.sendall(_pack(_ERROR, [
                        f"request of {e.size} bytes refused: this server's max_message_size "
                        f"is {e.limit} bytes".encode()]))
                    sock.shutdown(socket.SHUT_WR)  # the stream is out of step: hang up
                    return
                status, out = self.dispatch(code, fields)
                sock.sendall(_pack(status, out))
        except (OSError, ValueError):
            pass  # the client left or sent garbage: drop the connection
        finally:
            with self.cond:
                self.sessions.discard(sock)
            sock.close()

    def dispatch(self, code: int, f: list):
        """Run one request on the backend; return (status, fields)."""
        b = self.backend
        try:
            if code == _SET:
                b._set(f[0].decode(), f[1])
                return _OK, []
            if code == _GET:
                value = b._get(f[0].decode(), to_seconds(float(f[1]), "get"))
                return (_OK, [value]) if value is not None else (_TIMEOUT, [f[0]])
            if code == _ADD:
                return _OK, [str(b._add(f[0].decode(), int(f[1]))).encode()]
            if code == _CAS:
                return _OK, [b._compare_set(f[0].decode(), f[1], f[2])]
            if code == _WAIT:
                missing = b._wait(_keys(f[1:]), to_seconds(float(f[0]), "wait"))
                return (_TIMEOUT, [k.encode() for k in missing]) if missing else (_OK, [])
            if code == _CHECK:
                return _OK, [b"1" if b._check(_keys(f)) else b"0"]
            if code == _DELETE:
                return _OK, [b"1" if b._delete_key(f[0].decode()) else b"0"]
            if code == _NUMKEYS:
                return _OK, [str(b._num_keys()).encode()]
            if code == _MGET:
                values, missing = b._multi_get(_keys(f[1:]), to_seconds(float(f[0]), "multi_get"))
                return (_TIMEOUT, [k.encode() for k in missing]) if missing else (_OK, values)
            if code == _MSET:
                b._multi_set(_keys(f[0::2]), f[1::2])
                return _OK, []
            return _ERROR, [f"unknown request code {code}".encode()]
        except DistStoreError as e:
            return _ERROR, [str(e).encode()]
        except (IndexError, ValueError, TypeError) as e:
            return _ERROR, [f"malformed request: {e}".encode()]

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self.thread.start()

    def handshakes_pending(self) -> int:
        """Connections that have not authenticated yet (read by tests and diagnoses)."""
        return len(self._handshakes)

    def stop(self) -> None:
        """Stop accepting, drop pending handshakes, wake and disconnect every client thread."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the selector thread has ended and closed it
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            self.thread.join(10)  # it closes the listening socket as it ends
        with self.cond:
            sessions = list(self.sessions)
        for s in sessions:  # wake client threads and tell their clients
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ----------------------------------------------------------------------------- client
class TCPStore(Store):
    """A store held by a server in the master process and reached over TCP.

    The master (``is_master=True``) starts the server in a daemon thread, bound to
    exactly `host_name` (use ``"0.0.0.0"`` or ``"::"`` only if you mean all
    interfaces), and also connects to it as a client.  Other processes connect
    to `host_name`:`port`, retrying until the timeout.  The server lives as long
    as the master's store object: :meth:`close` (or garbage collection) on the
    master stops it, and every client then gets DistNetworkError on its next
    request.  Requests from threads sharing one instance are serialised.

    Security: the traffic is not encrypted or authenticated beyond the optional
    `token`, which only keeps out accidental clients (another job on the same
    port).  Never expose a TCPStore to an untrusted network.  What a stranger who
    can reach the port cannot do: make the server read more than a few KiB before
    its token is checked, hold a connection past the handshake deadline, or keep
    workers out by opening many idle connections (see the module's docstring).
    Without a token, anyone who speaks the protocol is a client.

    Args:
        host_name: address the master binds to and clients connect to.
        port: TCP port; 0 on the master picks a free one (read it from ``port``).
        world_size: number of stores (the master's included) that will connect,
            or None if unknown.
        is_master: whether this instance runs the server.
        timeout: default timeout of the blocking operations, of connecting, and
            of waiting for workers.  A request's reply is awaited at most its own
            wait time plus ``min(timeout, 60 s)`` (at least 5 s).
        wait_for_workers: on the master, block in the constructor until
            `world_size` stores have connected.
        token: optional shared secret (bytes or str, at most 2048 bytes); the server
            rejects clients that do not present it.
        max_message_size: on the master, the largest request (in bytes) the server
            reads from an authenticated client; a larger one is answered with an
            error and the connection closed.  Clients learn it when they connect and
            refuse larger requests themselves (ValueError), keeping their connection.
        handshake_timeout: on the master, how long a new connection has to present
            the protocol magic and token, all of it (timedelta or seconds); None:
            the store timeout, at least 1 s and at most 10 s.

    Raises:
        DistNetworkError: the master cannot bind, or a client cannot connect
            within the timeout, or the connection is lost later.
        DistStoreError: the token was rejected, or the workers did not all
            connect within the timeout.
        ValueError: a request is larger than the server's ``max_message_size``.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        token: bytes | str | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        handshake_timeout: Timeout | None = None,
    ):
        super().__init__(timeout)
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._max_request: int | None = None  # the server's max_message_size, once connected
        if not isinstance(host_name, str) or not host_name:
            raise TypeError(f"TCPStore: host_name must be a non-empty str, got {host_name!r}")
        if isinstance(port, bool) or not isinstance(port, numbers.Integral):
            raise TypeError(f"TCPStore: port must be int, got {type(port).__name__}")
        if not 0 <= port <= 65535 or (port == 0 and not is_master):
            raise ValueError(f"TCPStore: invalid port {port} (0 is allowed only on the master)")
        if world_size is not None:
            if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
                raise TypeError(f"TCPStore: world_size must be int or None, got {type(world_size).__name__}")
            if world_size < 1:
                raise ValueError(f"TCPStore: world_size must be positive, got {world_size}")
            world_size = int(world_size)
        if token is not None and not isinstance(token, (bytes, str)):
            raise TypeError(f"TCPStore: token must be bytes, str or None, got {type(token).__name__}")
        token = token.encode("utf-8") if isinstance(token, str) else token
        if token is not None and len(token) > _MAX_TOKEN:
            raise ValueError(f"TCPStore: token must be at most {_MAX_TOKEN} bytes, got {len(token)}")
        if isinstance(max_message_size, bool) or not isinstance(max_message_size, numbers.Integral):
            raise TypeError(f"TCPStore: max_message_size must be int, got {type(max_message_size).__name__}")
        if max_message_size < 1:
            raise ValueError(f"TCPStore: max_message_size must be positive, got {max_message_size}")
        if handshake_timeout is None:
            handshake_s = min(max(self._timeout_s, 1.0), _HANDSHAKE_TIMEOUT_MAX)
        else:
            handshake_s = to_seconds(handshake_timeout, "TCPStore", positive=True, name="handshake_timeout")
        self._host: str = host_name
        self._port: int = int(port)
        self._world_size: int | None = world_size
        self._is_master: bool = bool(is_master)
        self._lock: threading.Lock = threading.Lock()
        if is_master:
            self._server = self._start_server(token, handshake_s, int(max_message_size))
            self._port = self._server.port
        try:
            self._sock = self._connect(token)
            if is_master and wait_for_workers and world_size is not None:
                self._wait_for_workers()
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The host name the store was created with."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one picked by the system if 0 was given)."""
        return self._port

    @property
    def world_size(self) -> int | None:
        """The expected number of stores, or None."""
        return self._world_size

    @property
    def is_master(self) -> bool:
        """Whether this instance runs the server."""
        return self._is_master

    def _where(self) -> str:
        return f"{self._host}:{self._port}"

    # ------------------------------------------------------------------ setup
    def _start_server(self, token, handshake_s: float, max_message_size: int) -> _Server:
        try:
            infos = socket.getaddrinfo(self._host, self._port, 0, socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            server = _Server(sockaddr, family, token, handshake_s, max_message_size)
        except OSError as e:
            raise DistNetworkError(f"TCPStore: cannot listen on {self._where()}: {e}") from e
        server.start()
        return server

    def _connect(self, token) -> socket.socket:
        """Connect and shake hands, retrying both until the timeout.

        A handshake is retried when the connection is lost in it: a server that
        strangers keep busy drops its oldest unauthenticated connection."""
        deadline = time.monotonic() + self._timeout_s
        delay = 0.01
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(min(left, 10.0), 0.5))
            except OSError as e:
                failure: Exception = DistNetworkError(
                    f"TCPStore: could not connect to {self._where()} within {self._timeout_s:g} s: {e}")
                cause: Exception = e
            else:
                try:
                    return self._handshake(sock, token, deadline)
                except (OSError, ValueError) as e:
                    sock.close()
                    failure = DistNetworkError(f"TCPStore: handshake with {self._where()} failed: {e}")
                    cause = e
            left = deadline - time.monotonic()
            if left <= 0:
                raise failure from cause
            time.sleep(min(delay, left))
            delay = min(2 * delay, 1.0)

    def _handshake(self, sock: socket.socket, token, deadline: float) -> socket.socket:
        """Send HELLO and read the answer; DistStoreError if the server refuses us."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(min(deadline - time.monotonic(), self._io_timeout()), 0.5))
        sock.sendall(_pack(_HELLO, [_MAGIC, token or b""]))
        status, fields = _recv_msg(sock, _HANDSHAKE_LIMIT)  # not a server's yet: read little
        if status != _OK:
            sock.close()
            msg = fields[0] if fields else b"?"
            if msg == _TOKEN_REJECTED:
                raise DistStoreError(f"TCPStore at {self._where()}: token rejected by the server")
            raise DistStoreError(f"TCPStore at {self._where()}: {msg.decode(errors='replace')}")
        if fields and fields[0].isdigit():  # servers before the limit send nothing
            self._max_request = int(fields[0])
        return sock

    def _wait_for_workers(self) -> None:
        srv, n = self._server, self._world_size
        assert srv is not None and n is not None  # called on the master, with a world size
        with srv.cond:
            ok = srv.cond.wait_for(lambda: srv.joined >= n, self._timeout_s)
            joined = srv.joined
        if not ok:
            raise DistStoreError(
                f"TCPStore at {self._where()}: timed out after {self._timeout_s:g} s "
                f"waiting for workers: {joined}/{n} joined"
            )

    def _io_timeout(self) -> float:
        return max(5.0, min(self._timeout_s, 60.0))

    # ------------------------------------------------------------------ requests
    def _request(self, code: int, fields, wait: float = 0.0):
        message = _pack(code, fields)
        limit = self._max_request
        if limit is not None and len(message) - 4 > limit:
            raise ValueError(
                f"TCPStore.{_OP_NAMES[code]}: request of {len(message) - 4} bytes is over the "
                f"max_message_size of the server at {self._where()} ({limit} bytes)")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise DistNetworkError(f"TCPStore client of {self._where()} is closed or lost its connection")
            try:
                sock.settimeout(wait + self._io_timeout())
                sock.sendall(message)
                status, out = _recv_msg(sock)
            except (OSError, ValueError) as e:
                self._sock = None  # the stream is out of step: never reuse it
                sock.close()
                raise DistNetworkError(
                    f"TCPStore: lost the connection to the server at {self._where()} "
                    f"({type(e).__name__}: {e})"
                ) from e
        if status == _ERROR:
            raise DistStoreError(f"TCPStore at {self._where()}: {out[0].decode(errors='replace')}")
        return status, out

    def _set(self, key, value):
        self._request(_SET, [key.encode(), value])

    def _get(self, key, seconds):
        status, out = self._request(_GET, [key.encode(), repr(seconds).encode()], seconds)
        return out[0] if status == _OK else None

    def _add(self, key, amount):
        return int(self._request(_ADD, [key.encode(), str(amount).encode()])[1][0])

    def _compare_set(self, key, expected, desired):
        return self._request(_CAS, [key.encode(), expected, desired])[1][0]

    def _wait(self, keys, seconds):
        status, out = self._request(_WAIT, [repr(seconds).encode()] + [k.encode() for k in keys], seconds)
        return [] if status == _OK else _keys(out)

    def _check(self, keys):
        return self._request(_CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def _delete_key(self, key):
        return self._request(_DELETE, [key.encode()])[1][0] == b"1"

    def _num_keys(self):
        return int(self._request(_NUMKEYS, [])[1][0])

    def _multi_get(self, keys, seconds):
        status, out = self._request(_MGET, [repr(seconds).encode()] + [k.encode() for k in keys], seconds)
        return (out, []) if status == _OK else (None, _keys(out))

    def _multi_set(self, keys, values):
        fields = []
        for k, v in zip(keys, values):
            fields += [k.encode(), v]
        self._request(_MSET, fields)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Disconnect; on the master, also stop the server (clients then get errors)."""
        sock, self._sock = getattr(self, "_sock", None), None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        srv, self._server = getattr(self, "_server", None), None
        if srv is not None:
            srv.stop()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
