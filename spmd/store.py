"""Key-value stores with torch.distributed's (c10d) method names and semantics.

Ranks use a store to rendezvous and to exchange small pieces of data outside the
collectives.  Four kinds, all standard library only:

* :class:`HashStore` -- in one process, shared between threads;
* :class:`FileStore` -- a file on a (shared) file system, for processes;
* :class:`TCPStore` -- a server in the master process, reached over TCP
  (defined in ``spmd._tcpstore``, importable from here);
* :class:`PrefixStore` -- a namespace on top of another store.

Keys are ``str``; values are ``bytes`` (``str`` values are UTF-8 encoded).  Counters
made by :meth:`Store.add` are stored as decimal ASCII, as in c10d, so ``get`` of a
counter returns e.g. ``b"5"``.  Timeouts are ``datetime.timedelta`` or seconds; a
timeout of 0 means "do not wait" (c10d reads 0 as "wait forever").
"""

from __future__ import annotations

import fcntl
import numbers
import os
import struct
import threading
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Callable, Optional

from .errors import DistStoreError

__all__ = ["DEFAULT_TIMEOUT", "Store", "HashStore", "FileStore", "TCPStore", "PrefixStore"]

DEFAULT_TIMEOUT = timedelta(seconds=300)
_MAX_WAIT = min(threading.TIMEOUT_MAX, 1e9)  # longer waits are clamped to this


# ----------------------------------------------------------------------------- checks
def _check_key(key, method: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"{method}: key must be str, got {type(key).__name__}")
    return key


def _check_keys(keys, method: str) -> list:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"{method}: keys must be a list of str, got {type(keys).__name__}")
    return [_check_key(k, method) for k in keys]


def _check_value(value, method: str, what: str = "value") -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"{method}: {what} must be bytes or str, got {type(value).__name__}")


def _to_seconds(timeout, method: str) -> float:
    """Convert a timedelta or a number of seconds to float seconds (clamped)."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(
            f"{method}: timeout must be a datetime.timedelta or a number of seconds, "
            f"got {type(timeout).__name__}"
        )
    if not seconds >= 0:  # also catches NaN
        raise ValueError(f"{method}: timeout must be non-negative, got {timeout!r}")
    return min(seconds, _MAX_WAIT)


def _parse_counter(key: str, raw: bytes) -> int:
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise DistStoreError(
            f"add: the value of key {key!r} is not an integer: {raw[:40]!r}"
        ) from None


def _dict_add(data: dict, key: str, amount: int) -> int:
    new = _parse_counter(key, data.get(key, b"0")) + amount
    data[key] = str(new).encode("ascii")
    return new


def _dict_compare_set(data: dict, key: str, expected: bytes, desired: bytes) -> bytes:
    """c10d's compareSet on a dict: returns the value now stored (or `expected`)."""
    current = data.get(key)
    if (current is None and expected == b"") or (current is not None and current == expected):
        data[key] = desired
        return desired
    return expected if current is None else current


# ----------------------------------------------------------------------------- base
class Store:
    """Base class of the key-value stores.

    The public methods check their arguments and then call ``_``-prefixed hooks
    that the subclasses implement; waiting hooks get the timeout in seconds and
    report a timeout by returning ``None`` (or the list of missing keys).

    Args:
        timeout: default timeout of :meth:`get`, :meth:`wait` and :meth:`multi_get`.
    """

    def __init__(self, timeout=DEFAULT_TIMEOUT):
        self._timeout_s = _to_seconds(timeout, type(self).__name__)

    # ------------------------------------------------------------------ timeout
    @property
    def timeout(self) -> timedelta:
        """The default timeout of the blocking operations."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout) -> None:
        """Set the default timeout (a timedelta or seconds; ValueError if negative)."""
        self._timeout_s = _to_seconds(timeout, "set_timeout")

    def _seconds(self, timeout, method: str) -> float:
        if timeout is None:
            return self.timeout.total_seconds()
        return _to_seconds(timeout, method)

    def _timeout_error(self, method: str, keys: list, seconds: float) -> DistStoreError:
        what = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {keys!r}"
        return DistStoreError(
            f"{type(self).__name__}.{method}: timed out after {seconds:g} s waiting for {what}"
        )

    # ------------------------------------------------------------------ public API
    def set(self, key: str, value) -> None:
        """Store `value` (bytes or str) under `key`, overwriting any old value."""
        self._set(_check_key(key, "set"), _check_value(value, "set"))

    def get(self, key: str) -> bytes:
        """Return the value of `key`, waiting up to the store's timeout for it.

        Raises:
            DistStoreError: the key did not appear before the timeout.
        """
        key = _check_key(key, "get")
        seconds = self.timeout.total_seconds()
        value = self._get(key, seconds)
        if value is None:
            raise self._timeout_error("get", [key], seconds)
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer counter `key` (0 if missing); return it.

        Raises:
            DistStoreError: the key holds a value that is not a decimal integer.
        """
        key = _check_key(key, "add")
        if isinstance(amount, bool) or not isinstance(amount, numbers.Integral):
            raise TypeError(f"add: amount must be int, got {type(amount).__name__}")
        return self._add(key, int(amount))

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """Set `key` to `desired_value` if it holds `expected_value`; return the value now stored.

        As in c10d: a missing key is set only if `expected_value` is empty; when
        nothing is set, the current value is returned, or `expected_value` if the
        key is missing.
        """
        key = _check_key(key, "compare_set")
        expected = _check_value(expected_value, "compare_set", "expected_value")
        desired = _check_value(desired_value, "compare_set", "desired_value")
        return self._compare_set(key, expected, desired)

    def wait(self, keys, timeout=None) -> None:
        """Wait until all `keys` exist (timeout: timedelta or seconds; None: the store's).

        Raises:
            DistStoreError: some keys were still missing at the timeout.
        """
        keys = _check_keys(keys, "wait")
        seconds = self._seconds(timeout, "wait")
        missing = self._wait(keys, seconds)
        if missing:
            raise self._timeout_error("wait", missing, seconds)

    def check(self, keys) -> bool:
        """Return whether all `keys` exist, without waiting."""
        return self._check(_check_keys(keys, "check"))

    def delete_key(self, key: str) -> bool:
        """Delete `key`; return whether it existed."""
        return self._delete_key(_check_key(key, "delete_key"))

    def num_keys(self) -> int:
        """Return the number of keys in the store."""
        return self._num_keys()

    def multi_get(self, keys) -> list:
        """Return the values of `keys`, waiting up to the store's timeout for all of them."""
        keys = _check_keys(keys, "multi_get")
        seconds = self.timeout.total_seconds()
        values, missing = self._multi_get(keys, seconds)
        if missing:
            raise self._timeout_error("multi_get", missing, seconds)
        return values

    def multi_set(self, keys, values) -> None:
        """Set each of `keys` to the matching entry of `values`."""
        keys = _check_keys(keys, "multi_set")
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(f"multi_set: values must be a list, got {type(values).__name__}")
        values = [_check_value(v, "multi_set") for v in values]
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._multi_set(keys, values)

    def close(self) -> None:
        """Release the store's resources (a no-op for stores that have none)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str, seconds: float) -> Optional[bytes]:
        raise NotImplementedError

    def _add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise NotImplementedError

    def _wait(self, keys: list, seconds: float) -> list:
        raise NotImplementedError

    def _check(self, keys: list) -> bool:
        raise NotImplementedError

    def _delete_key(self, key: str) -> bool:
        raise NotImplementedError

    def _num_keys(self) -> int:
        raise NotImplementedError

    def _multi_get(self, keys: list, seconds: float):
        """Return ``(values, [])``, or ``(None, missing_keys)`` on timeout."""
        missing = self._wait(keys, seconds)
        if missing:
            return None, missing
        values = [self._get(k, 0.0) for k in keys]
        gone = [k for k, v in zip(keys, values) if v is None]  # deleted meanwhile
        return (None, gone) if gone else (values, [])

    def _multi_set(self, keys: list, values: list) -> None:
        for k, v in zip(keys, values):
            self._set(k, v)


# ----------------------------------------------------------------------------- HashStore
class HashStore(Store):
    """An in-process store, safe to share between threads.

    Blocking operations sleep on a condition variable that every write notifies.
    """

    def __init__(self, timeout=DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self._data: dict = {}
        self._cond = threading.Condition()

    def _set(self, key, value):
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _get(self, key, seconds):
        with self._cond:
            if self._cond.wait_for(lambda: key in self._data, seconds):
                return self._data[key]
            return None

    def _add(self, key, amount):
        with self._cond:
            new = _dict_add(self._data, key, amount)
            self._cond.notify_all()
            return new

    def _compare_set(self, key, expected, desired):
        with self._cond:
            result = _dict_compare_set(self._data, key, expected, desired)
            self._cond.notify_all()
            return result

    def _wait(self, keys, seconds):
        with self._cond:
            self._cond.wait_for(lambda: all(k in self._data for k in keys), seconds)
            return [k for k in keys if k not in self._data]

    def _check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete_key(self, key):
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self):
        with self._cond:
            return len(self._data)

    def _multi_get(self, keys, seconds):
        with self._cond:
            self._cond.wait_for(lambda: all(k in self._data for k in keys), seconds)
            missing = [k for k in keys if k not in self._data]
            return (None, missing) if missing else ([self._data[k] for k in keys], [])

    def _multi_set(self, keys, values):
        with self._cond:
            self._data.update(zip(keys, values))
            self._cond.notify_all()


# ----------------------------------------------------------------------------- FileStore
_RECORD = struct.Struct("!BII")  # opcode, key length, value length; then key, value
_OP_SET, _OP_DELETE, _OP_META = 1, 2, 3
_MAGIC = b"spmd-filestore-1\n"
_HEADER_SIZE = len(_MAGIC) + 16  # magic, then 16 random bytes naming this incarnation
_POLL_MIN, _POLL_MAX = 0.001, 0.05  # polling interval of blocking FileStore calls (s)


class FileStore(Store):
    """A store kept in a file, shared by the processes that open the same path.

    The file is a header (a magic line and 16 random bytes, so that a deleted and
    recreated file is never mistaken for the old one) and then an append-only log
    of records ``(opcode u8, key length u32, value length u32, key UTF-8, value)``,
    big-endian: ``SET``, ``DELETE`` and ``META`` (internal reference counters, kept
    apart from the user's keys).  Every
    operation opens the file (created with mode 0600), takes ``fcntl.flock`` --
    shared to read, exclusive to write -- reads only the records appended since
    its last visit into an in-memory map, and appends its own records under the
    exclusive lock, so ``add`` and ``compare_set`` are atomic across processes.
    Blocking calls poll with a short sleep (1 ms growing to 50 ms).  Like c10d's
    log, the file only grows while it is in use.

    Cleanup follows c10d: each instance counts itself in on creation; :meth:`close`
    (also run when the object is garbage collected) counts it out, and when
    `world_size` instances have closed and none is left open, the last one deletes
    the file.  With ``world_size=-1`` the file is never deleted.  Operations on a
    closed instance raise DistStoreError.  The file system must honour ``flock``
    between the processes (local file systems do; for NFS check the mount).

    Args:
        file_name: path of the file; created if missing.
        world_size: number of instances that will use the file, or -1 if unknown.
        timeout: default timeout of the blocking operations.
    """

    def __init__(self, file_name, world_size: int = -1, timeout=DEFAULT_TIMEOUT):
        super().__init__(timeout)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"FileStore: file_name must be a path, got {type(file_name).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
            raise TypeError(f"FileStore: world_size must be int, got {type(world_size).__name__}")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"FileStore: world_size must be -1 or positive, got {world_size}")
        self._path = os.path.abspath(os.fspath(file_name))
        self._world_size = int(world_size)
        self._lock = threading.Lock()  # serialises the threads that share this instance
        self._data: dict = {}
        self._meta: dict = {}
        self._pos = 0  # bytes of the file already applied to _data/_meta
        self._header = None  # header of the file those bytes came from
        self._closed = False
        try:
            self._locked(fcntl.LOCK_EX, lambda fd: self._bump_meta(fd, "refcount", 1))
        except BaseException:
            self._closed = True  # not counted in: close() must not count out
            raise

    @property
    def path(self) -> str:
        """Absolute path of the backing file."""
        return self._path

    # ------------------------------------------------------------------ log access
    def _locked(self, mode: int, fn: Callable):
        """Open the file, flock it in `mode`, catch up with the log, return fn(fd)."""
        if self._closed:
            raise DistStoreError(f"FileStore {self._path!r} is closed")
        with self._lock:
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise DistStoreError(f"FileStore: cannot open {self._path!r}: {e}") from e
            try:
                fcntl.flock(fd, mode)
                self._refresh(fd)
                return fn(fd)
            finally:
                os.close(fd)  # also drops the flock

    def _refresh(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER_SIZE, 0) if size else b""
        if header != self._header or size < self._pos:  # another file (or a new one): start over
            self._data.clear()
            self._meta.clear()
            self._pos, self._header = 0, None
            if size:
                if len(header) < _HEADER_SIZE or not header.startswith(_MAGIC):
                    raise DistStoreError(f"FileStore {self._path!r}: not a FileStore file")
                self._pos, self._header = _HEADER_SIZE, header
        chunks, pos = [], self._pos
        while pos < size:
            chunk = os.pread(fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        if chunks:
            self._pos += self._apply(b"".join(chunks))

    def _apply(self, buf: bytes) -> int:
        """Apply the complete records in `buf`; return the number of bytes used."""
        off, head = 0, _RECORD.size
        while off + head <= len(buf):
            op, klen, vlen = _RECORD.unpack_from(buf, off)
            end = off + head + klen + vlen
            if end > len(buf):
                break
            key = buf[off + head : off + head + klen].decode("utf-8")
            value = buf[off + head + klen : end]
            if op == _OP_SET:
                self._data[key] = value
            elif op == _OP_DELETE:
                self._data.pop(key, None)
            elif op == _OP_META:
                self._meta[key] = value
            else:
                raise DistStoreError(f"FileStore {self._path!r}: corrupt record at byte {self._pos + off}")
            off = end
        return off

    def _append(self, fd: int, records: list) -> None:
        """Append records (op, key, value) to the log; caller holds LOCK_EX."""
        parts = []
        for op, key, value in records:
            k = key.encode("utf-8")
            parts += [_RECORD.pack(op, len(k), len(value)), k, value]
        blob = b"".join(parts)
        header = b""
        if self._header is None:  # an empty file: this write creates its identity
            header = _MAGIC + os.urandom(_HEADER_SIZE - len(_MAGIC))
        view = memoryview(header + blob)
        while view:
            view = view[os.write(fd, view):]
        if header:
            self._header, self._pos = header, _HEADER_SIZE
        self._pos += self._apply(blob)  # we were at the end of the log

    def _entry(self, key: str) -> dict:
        """A one-entry copy of the map, for computing a new value without changing it."""
        return {key: self._data[key]} if key in self._data else {}

    def _bump_meta(self, fd: int, name: str, amount: int) -> int:
        new = _dict_add({name: self._meta.get(name, b"0")}, name, amount)
        self._append(fd, [(_OP_META, name, str(new).encode("ascii"))])
        return new

    def _poll(self, probe: Callable, seconds: float):
        """Run probe under a shared lock until it returns non-None or time runs out."""
        deadline = time.monotonic() + seconds
        delay = _POLL_MIN
        while True:
            result = self._locked(fcntl.LOCK_SH, probe)
            left = deadline - time.monotonic()
            if result is not None or left <= 0:
                return result
            time.sleep(min(delay, left))
            delay = min(2 * delay, _POLL_MAX)

    # ------------------------------------------------------------------ hooks
    def _set(self, key, value):
        self._locked(fcntl.LOCK_EX, lambda fd: self._append(fd, [(_OP_SET, key, value)]))

    def _get(self, key, seconds):
        return self._poll(lambda fd: self._data.get(key), seconds)

    def _add(self, key, amount):
        def op(fd):
            new = _dict_add(self._entry(key), key, amount)
            self._append(fd, [(_OP_SET, key, str(new).encode("ascii"))])
            return new

        return self._locked(fcntl.LOCK_EX, op)

    def _compare_set(self, key, expected, desired):
        def op(fd):
            entry = self._entry(key)
            result = _dict_compare_set(entry, key, expected, desired)
            if entry.get(key) != self._data.get(key):
                self._append(fd, [(_OP_SET, key, desired)])
            return result

        return self._locked(fcntl.LOCK_EX, op)

    def _missing(self, keys):
        return [k for k in keys if k not in self._data]

    def _wait(self, keys, seconds):
        if self._poll(lambda fd: [] if not self._missing(keys) else None, seconds) is not None:
            return []
        return self._locked(fcntl.LOCK_SH, lambda fd: self._missing(keys))

    def _check(self, keys):
        return self._locked(fcntl.LOCK_SH, lambda fd: not self._missing(keys))

    def _delete_key(self, key):
        def op(fd):
            if key not in self._data:
                return False
            self._append(fd, [(_OP_DELETE, key, b"")])
            return True

        return self._locked(fcntl.LOCK_EX, op)

    def _num_keys(self):
        return self._locked(fcntl.LOCK_SH, lambda fd: len(self._data))

    def _multi_get(self, keys, seconds):
        def probe(fd):
            return None if self._missing(keys) else [self._data[k] for k in keys]

        values = self._poll(probe, seconds)
        if values is not None:
            return values, []
        return None, self._locked(fcntl.LOCK_SH, lambda fd: self._missing(keys))

    def _multi_set(self, keys, values):
        records = [(_OP_SET, k, v) for k, v in zip(keys, values)]
        self._locked(fcntl.LOCK_EX, lambda fd: self._append(fd, records))

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Count this instance out; the last of `world_size` instances deletes the file."""
        if getattr(self, "_closed", True):
            return
        if not os.path.exists(self._path):  # removed by someone else (as in c10d)
            self._closed = True
            return

        def finish(fd):
            finished = self._bump_meta(fd, "finished", 1)
            refcount = self._bump_meta(fd, "refcount", -1)
            if refcount == 0 and 0 < self._world_size <= finished:
                try:
                    os.unlink(self._path)
                except FileNotFoundError:
                    pass

        try:
            self._locked(fcntl.LOCK_EX, finish)
        finally:
            self._closed = True

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ----------------------------------------------------------------------------- PrefixStore
class PrefixStore(Store):
    """A view of another store that prefixes every key with ``f"{prefix}/"``.

    The timeout is the underlying store's (reading or setting it here reads or sets
    it there), and :meth:`num_keys` counts all the keys of the underlying store, as
    in c10d.

    Args:
        prefix: the namespace.
        store: the underlying store (may itself be a PrefixStore).
    """

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore: prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore: store must be a Store, got {type(store).__name__}")
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The store that holds the prefixed keys."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The underlying store's default timeout."""
        return self._store.timeout

    def set_timeout(self, timeout) -> None:
        """Set the underlying store's default timeout."""
        self._store.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _unk(self, keys: list) -> list:
        n = len(self._prefix) + 1
        return [k[n:] for k in keys]

    def _set(self, key, value):
        self._store._set(self._k(key), value)

    def _get(self, key, seconds):
        return self._store._get(self._k(key), seconds)

    def _add(self, key, amount):
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys, seconds):
        return self._unk(self._store._wait([self._k(k) for k in keys], seconds))

    def _check(self, keys):
        return self._store._check([self._k(k) for k in keys])

    def _delete_key(self, key):
        return self._store._delete_key(self._k(key))

    def _num_keys(self):
        return self._store._num_keys()

    def _multi_get(self, keys, seconds):
        values, missing = self._store._multi_get([self._k(k) for k in keys], seconds)
        return values, self._unk(missing)

    def _multi_set(self, keys, values):
        self._store._multi_set([self._k(k) for k in keys], values)


def __getattr__(name: str):
    # TCPStore lives in spmd._tcpstore, which imports this module; load it lazily.
    if name == "TCPStore":
        from ._tcpstore import TCPStore

        return TCPStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
