"""FileStore: a key-value store in a file on a (shared) file system, for processes."""


from __future__ import annotations

import errno
import fcntl
import numbers
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable

from spmd.core.errors import DistStoreError
from spmd.core.typing import Timeout
from spmd.store.base import DEFAULT_TIMEOUT, Store, dict_add, dict_compare_set

__all__ = ["FileStore"]


_FIELDS = struct.Struct("!BII")   # opcode, key length, value length
_RECORD = struct.Struct("!BIII")  # the fields, then the CRC-32 of fields, key and value
_OP_SET, _OP_DELETE, _OP_META = 1, 2, 3
_MAGIC = b"spmd-filestore-2\n"
_HEADER_SIZE = len(_MAGIC) + 16  # magic, then 16 random bytes naming this incarnation
_POLL_MIN, _POLL_MAX = 0.001, 0.05  # polling interval of blocking FileStore calls (s)


def _crc(op: int, key: bytes, value: bytes) -> int:
    return zlib.crc32(value, zlib.crc32(key, zlib.crc32(_FIELDS.pack(op, len(key), len(value)))))


class FileStore(Store):
    """A store kept in a file, shared by the processes that open the same path.

    The file is a header (a magic line and 16 random bytes, so that a deleted and
    recreated file is never mistaken for the old one) and then an append-only log
    of records ``(opcode u8, key length u32, value length u32, CRC-32 u32, key
    UTF-8, value)``, big-endian, the CRC over everything else of the record:
    ``SET``, ``DELETE`` and ``META`` (internal reference counters, kept apart from
    the user's keys).  Every operation opens the file (created with mode 0600,
    never through a symbolic link), takes ``fcntl.flock`` -- shared to read,
    exclusive to write -- reads only the records appended since its last visit
    into an in-memory map, and appends its own records under the exclusive lock,
    so ``add`` and ``compare_set`` are atomic across processes.  Blocking calls
    poll with a short sleep (1 ms growing to 50 ms).  Like c10d's log, the file
    only grows while it is in use.

    Every process must see the same log.  A write that fails (disk full, file
    size limit) is cut back off the file under the lock before the error is raised;
    an unfinished record at the end (its writer was killed) is skipped by readers
    and cut off by the next writer; a record whose checksum does not match is
    reported (DistStoreError), never read.  A file that is a symbolic link, not a
    regular file, owned by another user, or writable by group or others is refused:
    whoever can write it could change what the ranks read.

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

    def __init__(self, file_name: str | os.PathLike[str], world_size: int = -1,
                 timeout: Timeout = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"FileStore: file_name must be a path, got {type(file_name).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
            raise TypeError(f"FileStore: world_size must be int, got {type(world_size).__name__}")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"FileStore: world_size must be -1 or positive, got {world_size}")
        self._path: str = os.path.abspath(os.fspath(file_name))
        self._world_size = int(world_size)
        self._lock: threading.Lock = threading.Lock()  # serialises the threads that share this instance
        self._data: dict = {}
        self._meta: dict = {}
        self._pos: int = 0  # bytes of the file already applied to _data/_meta
        self._size: int = 0  # the file's size at the last refresh (more than _pos: an unfinished record)
        self._header: bytes | None = None  # header of the file those bytes came from
        self._closed: bool = False
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
            fd = self._open()
            try:
                fcntl.flock(fd, mode)
                self._refresh(fd)
                return fn(fd)
            finally:
                os.close(fd)  # also drops the flock

    def _open(self) -> int:
        """Open the file (creating it 0600), refusing one that others could write."""
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(self._path, flags, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise DistStoreError(f"FileStore: {self._path!r} is a symbolic link; a FileStore "
                                     "does not follow links (give the file's real path)") from e
            raise DistStoreError(f"FileStore: cannot open {self._path!r}: {e}") from e
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}, expected 600)"
        if problem is not None:
            os.close(fd)
            raise DistStoreError(f"FileStore: {self._path!r} {problem}; refusing a file that "
                                 "another user could change")
        return fd

    def _refresh(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER_SIZE, 0) if size else b""
        if header != self._header or size < self._pos:  # another file (or a new one): start over
            self._data.clear()
            self._meta.clear()
            self._pos, self._header = 0, None
            if size:
                if len(header) < _HEADER_SIZE or not header.startswith(_MAGIC):
                    raise DistStoreError(f"FileStore {self._path!r}: not a FileStore file "
                                         f"(expected the header {_MAGIC!r})")
                self._pos, self._header = _HEADER_SIZE, header
        chunks, pos = [], self._pos
        while pos < size:
            chunk = os.pread(fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        self._size = pos
        if chunks:
            self._pos += self._apply(b"".join(chunks))

    def _apply(self, buf: bytes) -> int:
        """Apply the complete records in `buf`; return the number of bytes used.

        An unfinished record at the end is left unread: we hold the lock, so no writer
        is adding to it (a reader waits for the next writer to cut it off)."""
        off, head = 0, _RECORD.size
        while off + head <= len(buf):
            op, klen, vlen, crc = _RECORD.unpack_from(buf, off)
            end = off + head + klen + vlen
            if end > len(buf):
                break
            key_b = buf[off + head : off + head + klen]
            value = buf[off + head + klen : end]
            if _crc(op, key_b, value) != crc or op not in (_OP_SET, _OP_DELETE, _OP_META):
                raise DistStoreError(
                    f"FileStore {self._path!r}: corrupt record at byte {self._pos + off} "
                    "(checksum mismatch); the file was changed by something other than a FileStore")
            key = key_b.decode("utf-8")
            if op == _OP_SET:
                self._data[key] = value
            elif op == _OP_DELETE:
                self._data.pop(key, None)
            else:
                self._meta[key] = value
            off = end
        return off

    def _append(self, fd: int, records: list) -> None:
        """Append records (op, key, value) to the log; caller holds LOCK_EX.

        A failed write is cut back off the file before the error goes up, so that no
        process ever reads a log that differs from this one's."""
        parts = []
        for op, key, value in records:
            k = key.encode("utf-8")
            parts += [_RECORD.pack(op, len(k), len(value), _crc(op, k, value)), k, value]
        blob = b"".join(parts)
        header = b""
        if self._header is None:  # an empty file: this write creates its identity
            header = _MAGIC + os.urandom(_HEADER_SIZE - len(_MAGIC))
        start = self._pos
        if self._size > start:  # an unfinished record whose writer is gone (we hold the lock)
            self._truncate(fd, start, "an unfinished record")
        view = memoryview(header + blob)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError as e:
            self._truncate(fd, start, "a failed write")
            keys = ", ".join(repr(key) for _, key, _ in records)
            raise DistStoreError(f"FileStore {self._path!r}: writing {keys} failed ({e}); the "
                                 "file was cut back to its last complete record") from e
        if header:
            self._header, self._pos = header, _HEADER_SIZE
        self._pos += self._apply(blob)  # we were at the end of the log
        self._size = self._pos

    def _truncate(self, fd: int, length: int, what: str) -> None:
        try:
            os.ftruncate(fd, length)
        except OSError as e:
            raise DistStoreError(f"FileStore {self._path!r}: could not cut {what} off the end of "
                                 f"the file ({e}); remove the file and start over") from e
        self._size = length

    def _entry(self, key: str) -> dict:
        """A one-entry copy of the map, for computing a new value without changing it."""
        return {key: self._data[key]} if key in self._data else {}

    def _bump_meta(self, fd: int, name: str, amount: int) -> int:
        new = dict_add({name: self._meta.get(name, b"0")}, name, amount)
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
            new = dict_add(self._entry(key), key, amount)
            self._append(fd, [(_OP_SET, key, str(new).encode("ascii"))])
            return new

        return self._locked(fcntl.LOCK_EX, op)

    def _compare_set(self, key, expected, desired):
        def op(fd):
            entry = self._entry(key)
            result = dict_compare_set(entry, key, expected, desired)
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


