"""The double's ``cupy.cuda.nccl``: communicators whose ranks exchange data through files
in a directory named by the unique id, as tasks of the streams they are launched on."""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import types
import weakref
from typing import Any

import numpy as np

from spmd.core import settings
from spmd.core.dtypes import bfloat16
from spmd.testing.device_double._device import device, stream_at

__all__ = ["VERSION", "NcclCommunicator", "NcclError", "nccl"]

VERSION = 22809  # the NCCL version code the double reports (2.28.9)


class NcclError(RuntimeError):
    def __init__(self, status: int, message: str = ""):
        super().__init__(f"NCCL_ERROR ({status}): {message}" if message else f"NCCL_ERROR ({status})")
        self.status = status


class _NcclModule(types.ModuleType):
    """What spmd reads of ``cupy.cuda.nccl``."""

    available = True
    NcclError = NcclError
    (NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64,
     NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16) = range(10)
    NCCL_CHAR, NCCL_INT, NCCL_HALF, NCCL_FLOAT, NCCL_DOUBLE = 0, 2, 6, 7, 8
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)

    @staticmethod
    def get_version() -> int:
        return VERSION

    @staticmethod
    def get_build_version() -> int:
        return VERSION

    @staticmethod
    def get_unique_id() -> bytes:
        return secrets.token_bytes(128)

    @staticmethod
    def groupStart() -> None:
        _grouping().depth += 1

    @staticmethod
    def groupEnd() -> None:
        g = _grouping()
        g.depth -= 1
        if g.depth == 0:
            pending, g.pending = g.pending, []
            by_stream: dict = {}
            for stream, op in pending:
                by_stream.setdefault(stream, []).append(op)
            for stream, ops in by_stream.items():
                stream._push(_Launch(ops))  # (the double's own stream, as above)


_DTYPES: dict[int, np.dtype] = {0: np.dtype(np.int8), 1: np.dtype(np.uint8), 2: np.dtype(np.int32),
           3: np.dtype(np.uint32), 4: np.dtype(np.int64), 5: np.dtype(np.uint64),
           6: np.dtype(np.float16), 7: np.dtype(np.float32), 8: np.dtype(np.float64)}
if bfloat16 is not None:
    _DTYPES[9] = np.dtype(bfloat16)
_REDUCE = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}


def _grouping():
    g = getattr(device.local, "nccl_group", None)
    if g is None:
        g = device.local.nccl_group = types.SimpleNamespace(depth=0, pending=[])
    return g


def _memory(ptr: int, nbytes: int) -> np.ndarray:
    """The bytes at a device pointer (process memory here)."""
    if not nbytes:
        return np.empty(0, np.uint8)
    raw: Any = (ctypes.c_char * nbytes).from_address(ptr)
    return np.frombuffer(raw, np.uint8)


def _base_dir() -> str:
    return settings.read("SPMD_DEVICE_DOUBLE_DIR") or tempfile.gettempdir()


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Launch:
    """A stream task: NCCL calls launched together (one call, or a groupStart/groupEnd
    batch); done when every one is.  Calls of an aborted communicator end at once."""

    def __init__(self, ops: list):
        self.ops = ops
        self.pending = ops  # the ones not finished yet (a receive finishes once)
        self.started = False

    def __call__(self) -> bool:
        if not self.started:
            self.started = True
            for op in self.ops:
                if not op.comm._aborted:
                    op.start()
        self.pending = [op for op in self.pending if not op.comm._aborted and not op.finish()]
        if self.pending:
            return False
        collectives = [op for op in self.ops if isinstance(op, _Collective)]
        if collectives and not collectives[0].comm._aborted:
            # Every member has started these collectives, so each has finished the
            # launches before them (in stream order) and read this rank's parts of them.
            # (Not so when they ended by an abort: a slower member may still be reading
            # this rank's part of an earlier one.)
            collectives[0].comm._forget_before(min(op.seq for op in collectives))
        return True


class _Collective:
    """Every member writes its contribution; when all are there, each derives its result."""

    def __init__(self, comm, seq: int, send: tuple[int, int], result):
        self.comm, self.seq, self.send, self.result = comm, seq, send, result

    def _path(self, rank: int) -> str:
        return os.path.join(self.comm._dir, f"c{self.seq}.r{rank}")

    def start(self) -> None:
        ptr, nbytes = self.send
        _write(self._path(self.comm.rank), _memory(ptr, nbytes).tobytes())

    def finish(self) -> bool:
        paths = [self._path(r) for r in range(self.comm.n)]
        if not all(os.path.exists(p) for p in paths):
            return False
        parts = []
        for p in paths:
            with open(p, "rb") as f:
                parts.append(np.frombuffer(f.read(), np.uint8))
        self.result(parts)
        return True


class _Send:
    def __init__(self, comm, path: str, buf: tuple[int, int]):
        self.comm, self.path, self.buf = comm, path, buf

    def start(self) -> None:
        _write(self.path, _memory(*self.buf).tobytes())

    def finish(self) -> bool:
        return True


class _Recv:
    def __init__(self, comm, path: str, buf: tuple[int, int]):
        self.comm, self.path, self.buf = comm, path, buf

    def start(self) -> None:
        pass

    def finish(self) -> bool:
        if not os.path.exists(self.path):
            return False
        with open(self.path, "rb") as f:
            data = np.frombuffer(f.read(), np.uint8)
        os.unlink(self.path)
        ptr, nbytes = self.buf
        if data.size != nbytes:
            self.comm._error = f"recv of {nbytes} bytes got a send of {data.size} bytes"
            return True
        _memory(ptr, nbytes)[...] = data
        return True


def _reduced(parts: list, dtype: np.dtype, op: int, n: int) -> np.ndarray:
    arrays = [p.view(dtype) for p in parts]
    acc = arrays[0].copy()
    with np.errstate(all="ignore"):
        for a in arrays[1:]:
            _REDUCE[op](acc, a, out=acc)
        if op == 4:  # NCCL_AVG
            acc = (acc / n).astype(dtype) if dtype.kind in "fV" or dtype == bfloat16 \
                else acc // n
    return acc.view(np.uint8)


_open: weakref.WeakSet = weakref.WeakSet()  # this process's communicators not yet left


@atexit.register
def _leave_all() -> None:
    """A process that ends without destroying its communicators still leaves them, so
    the last member out removes their directory (a real NCCL frees them with the
    process; here they are files that would outlive it)."""
    for comm in list(_open):
        comm._leave()


class NcclCommunicator:
    """An NCCL communicator over the ranks that created it with the same unique id.
    Its directory goes when every member has left it: destroyed, aborted or exited."""

    def __init__(self, ndev: int, commId, rank: int):
        uid = bytes(b % 256 for b in commId) if not isinstance(commId, bytes) else commId
        self._uid = uid
        self._dir = os.path.join(_base_dir(), f"spmd-nccl-double-{uid[:12].hex()}")
        os.makedirs(self._dir, exist_ok=True)
        self.rank, self.n = int(rank), int(ndev)
        self._seq = 0
        self._written: collections.deque = collections.deque()  # seqs of files to remove
        self._sent: collections.Counter = collections.Counter()
        self._received: collections.Counter = collections.Counter()
        self._splits = 0
        self._error: str | None = None
        self._aborted = False
        self._destroyed = False
        _open.add(self)

    # -- what the engine asks ---------------------------------------------------------

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.n

    def device_id(self) -> int:
        return 0

    def check_async_error(self) -> None:
        if self._error is not None:
            raise NcclError(5, f"ncclRemoteError: {self._error}")

    def inject_error(self, message: str) -> None:
        """Make ``check_async_error`` raise from now on (a peer's failure, say)."""
        self._error = message

    def abort(self) -> None:
        self._aborted = True
        device.progress()
        self._leave()

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self._leave()

    def _leave(self) -> None:
        # Under the device's lock: no task of this process (run by any of its threads) is
        # reading or writing the directory while the last member out removes it.
        with device.lock:
            if self not in _open:
                return
            _open.discard(self)
            _write(os.path.join(self._dir, f"bye.r{self.rank}"), b"")
            if all(os.path.exists(os.path.join(self._dir, f"bye.r{r}")) for r in range(self.n)):
                shutil.rmtree(self._dir, ignore_errors=True)  # the last member out

    def commSplit(self, color: int, key: int) -> NcclCommunicator | None:
        """Collective over this communicator, blocking the host as ncclCommSplit does."""
        self._splits += 1
        tag = f"split{self._splits}"
        _write(os.path.join(self._dir, f"{tag}.r{self.rank}"), json.dumps([color, key]).encode())
        paths = [os.path.join(self._dir, f"{tag}.r{r}") for r in range(self.n)]
        device.run_until(lambda: all(os.path.exists(p) for p in paths))
        rows = []
        for r, p in enumerate(paths):
            with open(p, "rb") as f:
                c, k = json.loads(f.read())
            rows.append((c, k, r))
        if color < 0:
            return None
        members = sorted((k, r) for c, k, r in rows if c == color)
        uid = hashlib.sha512(self._uid + f"{tag}:{color}".encode()).digest() * 2
        return NcclCommunicator(len(members), uid, [r for _, r in members].index(self.rank))

    # -- operations ---------------------------------------------------------------------

    def _launch(self, stream: int, op) -> None:
        if self._aborted or self._destroyed:
            raise NcclError(4, "ncclInvalidUsage: the communicator was aborted or destroyed")
        s = stream_at(stream)
        g = _grouping()
        if g.depth:
            g.pending.append((s, op))
        else:
            s._push(_Launch([op]))  # the double's streams queue its own kernels

    def _collective(self, stream: int, send: tuple[int, int], result) -> None:
        self._seq += 1
        self._written.append(self._seq)
        self._launch(stream, _Collective(self, self._seq, send, result))

    def _forget_before(self, seq: int) -> None:
        """Remove this rank's contributions to collectives before ``seq``."""
        written = self._written
        while written and written[0] < seq:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._dir, f"c{written.popleft()}.r{self.rank}"))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        dt = _DTYPES[datatype]
        nbytes = count * dt.itemsize
        self._collective(stream, (sendbuf, nbytes), lambda parts: _memory(recvbuf, nbytes).__setitem__(
            ..., _reduced(parts, dt, op, self.n)))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream) -> None:
        dt = _DTYPES[datatype]
        nbytes = count * dt.itemsize

        def result(parts):
            if self.rank == root:
                _memory(recvbuf, nbytes)[...] = _reduced(parts, dt, op, self.n)
        self._collective(stream, (sendbuf, nbytes), result)

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream) -> None:
        nbytes = count * _DTYPES[datatype].itemsize
        self._collective(stream, (sendbuf, nbytes if self.rank == root else 0),
                         lambda parts: _memory(recvbuf, nbytes).__setitem__(..., parts[root]))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream) -> None:
        dt = _DTYPES[datatype]
        nbytes = recvcount * dt.itemsize
        lo = self.rank * nbytes
        self._collective(stream, (sendbuf, nbytes * self.n), lambda parts: _memory(
            recvbuf, nbytes).__setitem__(..., _reduced(parts, dt, op, self.n)[lo:lo + nbytes]))

    def allGather(self, sendbuf, recvbuf, sendcount, datatype, stream) -> None:
        nbytes = sendcount * _DTYPES[datatype].itemsize
        self._collective(stream, (sendbuf, nbytes), lambda parts: _memory(
            recvbuf, nbytes * self.n).__setitem__(..., np.concatenate(parts)))

    def send(self, sendbuf, count, datatype, peer, stream) -> None:
        nbytes = count * _DTYPES[datatype].itemsize
        m = self._sent[peer] = self._sent[peer] + 1
        path = os.path.join(self._dir, f"p{self.rank}-{peer}.{m}")
        self._launch(stream, _Send(self, path, (sendbuf, nbytes)))

    def recv(self, recvbuf, count, datatype, peer, stream) -> None:
        nbytes = count * _DTYPES[datatype].itemsize
        m = self._received[peer] = self._received[peer] + 1
        path = os.path.join(self._dir, f"p{peer}-{self.rank}.{m}")
        self._launch(stream, _Recv(self, path, (recvbuf, nbytes)))



nccl = _NcclModule("spmd.testing.device_double.nccl")
nccl.NcclCommunicator = NcclCommunicator  # type: ignore[attr-defined]
