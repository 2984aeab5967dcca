"""TCPStore: a store served over TCP by daemon threads of the master process.

The master's server gives each client that authenticated a thread of its own, which
serves its requests from one HashStore; blocking requests (GET, WAIT, MGET) wait in that
thread.  How messages are framed: ``spmd.store.tcp_protocol``; how connections are let
in, so that a stranger on the network cannot stall or starve the server:
``spmd.store.tcp_admission``.  An authenticated client's requests are taken up to
``max_message_size``.
"""

from __future__ import annotations

import numbers
import socket
import threading
import time

from spmd.core.errors import DistNetworkError, DistStoreError
from spmd.core.timeouts import to_seconds
from spmd.core.typing import Timeout
from spmd.store.base import DEFAULT_TIMEOUT, HashStore, Store
from spmd.store.tcp_admission import Admission
from spmd.store.tcp_protocol import (
    ADD,
    CAS,
    CHECK,
    DELETE,
    ERROR,
    GET,
    HANDSHAKE_LIMIT,
    HELLO,
    MAGIC,
    MAX_TOKEN,
    MGET,
    MSET,
    NUMKEYS,
    OK,
    OP_NAMES,
    SET,
    TIMEOUT,
    TOKEN_REJECTED,
    WAIT,
    MessageTooLarge,
    decode_keys,
    pack,
    recv_msg,
)

__all__ = ["DEFAULT_MAX_MESSAGE_SIZE", "TCPStore"]

DEFAULT_MAX_MESSAGE_SIZE = 1 << 30  # bytes of one request from an authenticated client
_HANDSHAKE_TIMEOUT_MAX = 10.0       # s; the default handshake deadline is the store timeout, capped


# ----------------------------------------------------------------------------- server
class _Server:
    """The master's server: a thread per authenticated client, serving its requests from
    one HashStore (connections come in through ``Admission``)."""

    def __init__(self, address, family, token: bytes | None, handshake_timeout: float,
                 max_message_size: int):
        self.backend = HashStore()
        self.max_message_size = max_message_size
        self.cond = threading.Condition()
        self.joined = 0  # clients that passed the handshake
        self.sessions: set = set()  # their sockets, to wake their threads at close
        self.admission = Admission(address, family, token, handshake_timeout, self._admit)
        self.socket = self.admission.socket
        self.port: int = self.admission.port

    def _admit(self, sock: socket.socket) -> None:
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

    # ------------------------------------------------------------------ client threads
    def _session(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.cond:
                self.joined += 1
                self.cond.notify_all()
            sock.sendall(pack(OK, [str(self.max_message_size).encode()]))
            while True:
                try:
                    code, fields = recv_msg(sock, self.max_message_size)
                except MessageTooLarge as e:
                    sock.sendall(pack(ERROR, [
                        f"request of {e.size} bytes refused: this server's max_message_size "
                        f"is {e.limit} bytes".encode()]))
                    sock.shutdown(socket.SHUT_WR)  # the stream is out of step: hang up
                    return
                status, out = self.dispatch(code, fields)
                sock.sendall(pack(status, out))
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
            if code == SET:
                b._set(f[0].decode(), f[1])
                return OK, []
            if code == GET:
                value = b._get(f[0].decode(), to_seconds(float(f[1]), "get"))
                return (OK, [value]) if value is not None else (TIMEOUT, [f[0]])
            if code == ADD:
                return OK, [str(b._add(f[0].decode(), int(f[1]))).encode()]
            if code == CAS:
                return OK, [b._compare_set(f[0].decode(), f[1], f[2])]
            if code == WAIT:
                missing = b._wait(decode_keys(f[1:]), to_seconds(float(f[0]), "wait"))
                return (TIMEOUT, [k.encode() for k in missing]) if missing else (OK, [])
            if code == CHECK:
                return OK, [b"1" if b._check(decode_keys(f)) else b"0"]
            if code == DELETE:
                return OK, [b"1" if b._delete_key(f[0].decode()) else b"0"]
            if code == NUMKEYS:
                return OK, [str(b._num_keys()).encode()]
            if code == MGET:
                values, missing = b._multi_get(decode_keys(f[1:]), to_seconds(float(f[0]), "multi_get"))
                return (TIMEOUT, [k.encode() for k in missing]) if missing else (OK, values)
            if code == MSET:
                b._multi_set(decode_keys(f[0::2]), f[1::2])
                return OK, []
            return ERROR, [f"unknown request code {code}".encode()]
        except DistStoreError as e:
            return ERROR, [str(e).encode()]
        except (IndexError, ValueError, TypeError) as e:
            return ERROR, [f"malformed request: {e}".encode()]

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self.admission.start()

    def handshakes_pending(self) -> int:
        """Connections that have not authenticated yet (read by tests and diagnoses)."""
        return self.admission.pending()

    def stop(self) -> None:
        """Stop accepting, drop pending handshakes, wake and disconnect every client thread."""
        self.admission.stop()
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
    workers out by opening many idle connections (see ``spmd.store.tcp_admission``).
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
        if token is not None and len(token) > MAX_TOKEN:
            raise ValueError(f"TCPStore: token must be at most {MAX_TOKEN} bytes, got {len(token)}")
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
        sock.sendall(pack(HELLO, [MAGIC, token or b""]))
        status, fields = recv_msg(sock, HANDSHAKE_LIMIT)  # not a server's yet: read little
        if status != OK:
            sock.close()
            msg = fields[0] if fields else b"?"
            if msg == TOKEN_REJECTED:
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
        message = pack(code, fields)
        limit = self._max_request
        if limit is not None and len(message) - 4 > limit:
            raise ValueError(
                f"TCPStore.{OP_NAMES[code]}: request of {len(message) - 4} bytes is over the "
                f"max_message_size of the server at {self._where()} ({limit} bytes)")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise DistNetworkError(f"TCPStore client of {self._where()} is closed or lost its connection")
            try:
                sock.settimeout(wait + self._io_timeout())
                sock.sendall(message)
                status, out = recv_msg(sock)
            except (OSError, ValueError) as e:
                self._sock = None  # the stream is out of step: never reuse it
                sock.close()
                raise DistNetworkError(
                    f"TCPStore: lost the connection to the server at {self._where()} "
                    f"({type(e).__name__}: {e})"
                ) from e
        if status == ERROR:
            raise DistStoreError(f"TCPStore at {self._where()}: {out[0].decode(errors='replace')}")
        return status, out

    def _set(self, key, value):
        self._request(SET, [key.encode(), value])

    def _get(self, key, seconds):
        status, out = self._request(GET, [key.encode(), repr(seconds).encode()], seconds)
        return out[0] if status == OK else None

    def _add(self, key, amount):
        return int(self._request(ADD, [key.encode(), str(amount).encode()])[1][0])

    def _compare_set(self, key, expected, desired):
        return self._request(CAS, [key.encode(), expected, desired])[1][0]

    def _wait(self, keys, seconds):
        status, out = self._request(WAIT, [repr(seconds).encode()] + [k.encode() for k in keys], seconds)
        return [] if status == OK else decode_keys(out)

    def _check(self, keys):
        return self._request(CHECK, [k.encode() for k in keys])[1][0] == b"1"

    def _delete_key(self, key):
        return self._request(DELETE, [key.encode()])[1][0] == b"1"

    def _num_keys(self):
        return int(self._request(NUMKEYS, [])[1][0])

    def _multi_get(self, keys, seconds):
        status, out = self._request(MGET, [repr(seconds).encode()] + [k.encode() for k in keys], seconds)
        return (out, []) if status == OK else (None, decode_keys(out))

    def _multi_set(self, keys, values):
        fields = []
        for k, v in zip(keys, values):
            fields += [k.encode(), v]
        self._request(MSET, fields)

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
