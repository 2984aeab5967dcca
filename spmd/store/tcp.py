"""TCPStore: a store served over TCP by a daemon thread of the master process.

Wire protocol (all integers unsigned 32-bit big-endian): every message is
``length, body``; a body is one code byte followed by any number of fields, each
``length, bytes``.  Requests carry an opcode; replies carry a status (OK, TIMEOUT
with the missing keys, or ERROR with a message).  Numbers (amounts, timeouts,
counts) travel as decimal ASCII.  The first request on a connection must be HELLO
with the protocol magic and the token; the server answers ERROR "token rejected"
and hangs up if the token does not match.  Blocking requests (GET, WAIT, MGET)
carry their timeout and wait in the server's handler thread for that client.
"""

from __future__ import annotations

import hmac
import numbers
import socket
import socketserver
import struct
import threading
import time

from spmd.core.errors import DistNetworkError, DistStoreError
from spmd.core.timeouts import to_seconds
from spmd.core.typing import Timeout
from spmd.store.base import DEFAULT_TIMEOUT, HashStore, Store

__all__ = ["TCPStore"]

_MAGIC = b"spmd-tcpstore-1"
_U32 = struct.Struct("!I")
(_HELLO, _SET, _GET, _ADD, _CAS, _WAIT, _CHECK, _DELETE, _NUMKEYS, _MGET, _MSET) = range(11)
_OK, _TIMEOUT, _ERROR = 0, 1, 2
_TOKEN_REJECTED = b"token rejected"


def _pack(code: int, fields) -> bytes:
    parts = [bytes([code])]
    for f in fields:
        parts += [_U32.pack(len(f)), f]
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        buf += chunk
    return bytes(buf)


def _recv_msg(sock: socket.socket):
    """Read one message; return (code, fields).  ValueError if it is malformed."""
    (n,) = _U32.unpack(_recv_exact(sock, 4))
    if n == 0:
        raise ValueError("empty message")
    body = _recv_exact(sock, n)
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


def _keys(fields) -> list:
    return [f.decode("utf-8") for f in fields]


# ----------------------------------------------------------------------------- server
class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    thread: threading.Thread  # serve_forever's, set by TCPStore._start_server

    def __init__(self, address, family, token, handshake_timeout):
        self.address_family = family
        self.backend = HashStore()
        self.token = token
        self.handshake_timeout = handshake_timeout
        self.cond = threading.Condition()
        self.joined = 0  # clients that passed the handshake
        self.conns: set = set()
        super().__init__(address, _Handler)

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


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        srv, sock = self.server, self.request
        with srv.cond:
            srv.conns.add(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(srv.handshake_timeout)
            code, fields = _recv_msg(sock)
            if code != _HELLO or len(fields) != 2 or fields[0] != _MAGIC:
                sock.sendall(_pack(_ERROR, [b"protocol mismatch: not an spmd TCPStore client"]))
                return
            if srv.token is not None and not hmac.compare_digest(fields[1], srv.token):
                sock.sendall(_pack(_ERROR, [_TOKEN_REJECTED]))
                return
            sock.settimeout(None)  # clients may stay idle between requests
            with srv.cond:
                srv.joined += 1
                srv.cond.notify_all()
            sock.sendall(_pack(_OK, []))
            while True:
                code, fields = _recv_msg(sock)
                status, out = srv.dispatch(code, fields)
                sock.sendall(_pack(status, out))
        except (OSError, ValueError):
            pass  # the client left, timed out or sent garbage: drop the connection
        finally:
            with srv.cond:
                srv.conns.discard(sock)


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
    port).  Never expose a TCPStore to an untrusted network.

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
        token: optional shared secret (bytes or str); the server rejects clients
            that do not present it.

    Raises:
        DistNetworkError: the master cannot bind, or a client cannot connect
            within the timeout, or the connection is lost later.
        DistStoreError: the token was rejected, or the workers did not all
            connect within the timeout.
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
    ):
        super().__init__(timeout)
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
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
        self._host: str = host_name
        self._port: int = int(port)
        self._world_size: int | None = world_size
        self._is_master: bool = bool(is_master)
        self._lock: threading.Lock = threading.Lock()
        if is_master:
            self._server = self._start_server(token)
            self._port = self._server.server_address[1]
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
    def _start_server(self, token) -> _Server:
        try:
            infos = socket.getaddrinfo(self._host, self._port, 0, socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            server = _Server(sockaddr, family, token, max(self._timeout_s, 1.0))
        except OSError as e:
            raise DistNetworkError(f"TCPStore: cannot listen on {self._where()}: {e}") from e
        server.thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1},
            name=f"spmd-tcpstore-{server.server_address[1]}", daemon=True,
        )
        server.thread.start()
        return server

    def _connect(self, token) -> socket.socket:
        deadline = time.monotonic() + self._timeout_s
        delay = 0.01
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(min(left, 10.0), 0.5))
                break
            except OSError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistNetworkError(
                        f"TCPStore: could not connect to {self._where()} within "
                        f"{self._timeout_s:g} s: {e}"
                    ) from e
                time.sleep(min(delay, left))
                delay = min(2 * delay, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._io_timeout())
            sock.sendall(_pack(_HELLO, [_MAGIC, token or b""]))
            status, fields = _recv_msg(sock)
        except (OSError, ValueError) as e:
            sock.close()
            raise DistNetworkError(f"TCPStore: handshake with {self._where()} failed: {e}") from e
        if status != _OK:
            sock.close()
            msg = fields[0] if fields else b"?"
            if msg == _TOKEN_REJECTED:
                raise DistStoreError(f"TCPStore at {self._where()}: token rejected by the server")
            raise DistStoreError(f"TCPStore at {self._where()}: {msg.decode(errors='replace')}")
        return sock

    def _wait_for_workers(self) -> None:
        srv, n = self._server, self._world_size
        assert srv is not None  # called on the master, after _start_server
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
        with self._lock:
            sock = self._sock
            if sock is None:
                raise DistNetworkError(f"TCPStore client of {self._where()} is closed or lost its connection")
            try:
                sock.settimeout(wait + self._io_timeout())
                sock.sendall(_pack(code, fields))
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
            if threading.current_thread() is not srv.thread:  # else shutdown() deadlocks
                srv.shutdown()
            srv.server_close()
            with srv.cond:
                conns = list(srv.conns)
            for c in conns:  # wake handler threads and tell their clients
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
