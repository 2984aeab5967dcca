"""A link between two programs of an MPMD job: the MPI engine's transport over an
intercommunicator (arrays, objects, broadcasts relayed from one program to the other).

:mod:`spmd.layouts.mpmd` finds the programs and makes the intercommunicators
(:func:`spmd.new_link`); a :class:`Link` moves the data.  GPU (cupy) arrays travel as the
MPI engine moves them: MPI reads device memory where it is GPU-aware, else they are
staged through pinned host memory (:mod:`spmd.backends.staging`).
"""

from __future__ import annotations

import pickle
import time
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from spmd.backends import checked as _checked
from spmd.backends import gpu_aware_mpi as _aware
from spmd.backends.mpi.engine import check_tag
from spmd.backends.mpi.work import MPIWork
from spmd.backends.staging import Staging, use_device_pointer
from spmd.core import cuda as _gpu
from spmd.core.arrays import array_in, array_out, contiguous, is_device_array, movable
from spmd.core.context import GroupContext
from spmd.core.errors import DistTimeoutError, located
from spmd.core.optable import OPS
from spmd.core.typing import Array
from spmd.core.work import Work

__all__ = ["Link"]

_U8 = np.dtype(np.uint8)
_I64 = np.dtype(np.int64)
_OBJECT_TAG, _RELAY_TAG = 1, 2  # on a link's private intercommunicator


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), _U8)


class _LinkContext(GroupContext):
    """The link's intercommunicator as a group context, so its Works look like every other
    Work to timeouts and observers.  No ProcessGroup holds it: destroy_process_group()
    leaves it alone."""

    __slots__ = ()

    def global_rank(self, group_rank: int) -> int:
        # Work.source_rank() reports a sender through this: on a link, a remote rank.
        return group_rank


class Link:
    """A connection between two programs (an MPI intercommunicator).

    ``dst`` and ``src`` are ranks in the *other* program; ``rank()`` is this rank's rank
    in its own program.  Array methods take numpy and cupy arrays (and torch tensors)
    and honour the link's timeout like every spmd wait.
    """

    def __init__(self, comm: MPI.Intercomm, lib: MPI.Intercomm, local_comm: MPI.Intracomm,
                 local: Any, remote: Any, timeout: float):
        # local, remote: the two spmd.layouts.mpmd.Program records (name, ranks)
        self.local = local
        self.remote = remote
        # GroupContext is typed for intracommunicators; what Works, waits and free() call
        # on the link's context (Isend/Irecv, sizes, Free) an intercommunicator has as well.
        self._ctx = _LinkContext(cast(MPI.Intracomm, comm), local.ranks,
                              f"link:{local.name}-{remote.name}", timeout, "mpi", "link")
        self._comm = comm              # the same communicator, as what it is
        self._lib = lib                # objects and broadcast relays
        self._local_comm = local_comm  # this program's ranks, for fanning a broadcast out
        self._remote_size = comm.Get_remote_size()
        self._staging: Staging | None = None  # made at the first GPU array

    def rank(self) -> int:
        """This rank's rank in its own program."""
        return self._ctx.rank

    def size(self) -> int:
        """The size of this rank's program."""
        return self._ctx.size

    def remote_size(self) -> int:
        """The size of the other program."""
        return self._remote_size

    @property
    def comm(self) -> MPI.Intercomm:
        """The intercommunicator, for raw MPI (spmd's link traffic runs on it too)."""
        return self._live("comm")

    def _live(self, op: str) -> MPI.Intercomm:
        if self._ctx.comm is None:
            raise RuntimeError(f"{op}: link {self._ctx.name} was freed")
        return self._comm

    def _peer(self, peer, op: str, arg: str, any_source: bool = False) -> int:
        if peer is None and any_source:
            return MPI.ANY_SOURCE
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise located(TypeError, op, f"{arg} must be an int (a rank of program "
                          f"{self.remote.name!r}), got {type(peer).__name__}", self._ctx)
        if not 0 <= peer < self._remote_size:
            raise located(ValueError, op, f"{arg}={peer} is out of range [0, "
                          f"{self._remote_size}) (the ranks of program {self.remote.name!r})",
                          self._ctx)
        return peer

    # -- arrays ------------------------------------------------------------------

    def _stager(self, op: str) -> Staging:
        if self._staging is None:
            self._staging = Staging(_gpu.need_cupy(op, "a GPU array on a link", self._ctx))
        return self._staging

    def _device_source(self, a, op: str, collective: bool):
        """What MPI sends for device array ``a``: its memory, or a host copy."""
        stager = self._stager(op)
        if use_device_pointer(_aware.mpi_gpu_support(), a, collective):
            stager.sync()
            return movable(a)
        return stager.down(a)

    def _device_target(self, a, op: str, collective: bool):
        """(where MPI writes device array ``a``'s result, what copies it into ``a``)."""
        stager = self._stager(op)
        if use_device_pointer(_aware.mpi_gpu_support(), a, collective):
            stager.sync()
            return a, None
        h = stager.host_buffer(a)
        return h, lambda: stager.up(a, h)

    @staticmethod
    def _host_target(a):
        buf = a if a.flags.c_contiguous else np.empty(a.shape, a.dtype)
        return buf, (None if buf is a else (lambda: np.copyto(a, buf)))

    def _isend(self, tensor, dst, tag, op: str) -> Work:
        comm = self._live(op)
        peer = self._peer(dst, op, "dst")
        a, _ = array_in(tensor, op, "tensor", self._ctx)
        tag = check_tag(tag, op, self._ctx)
        if is_device_array(a):
            buf = self._device_source(a, op, collective=False)
        else:
            buf = movable(contiguous(a))
        return MPIWork([comm.Isend(buf, peer, tag)], op, self._ctx, [a], keep=(a, buf))

    def _irecv(self, tensor, src, tag, op: str) -> Work:
        comm = self._live(op)
        peer = self._peer(src, op, "src", any_source=True)
        a, _ = array_out(tensor, op, "tensor", self._ctx)
        tag = check_tag(tag, op, self._ctx)
        if is_device_array(a):
            buf, finish = self._device_target(a, op, collective=False)
        else:
            buf, finish = self._host_target(a)
        status = MPI.Status()
        req = comm.Irecv(movable(buf), peer, tag)
        return MPIWork([req], op, self._ctx, [a], finish=finish, keep=(a, buf), status=status)

    def isend(self, tensor: Array, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to rank ``dst`` of the other program; return a Work."""
        return self._isend(tensor, dst, tag, "Link.isend")

    def irecv(self, tensor: Array, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from rank ``src`` of the other program (any if
        None); ``work.source_rank()`` then gives the sender's rank in its program."""
        return self._irecv(tensor, src, tag, "Link.irecv")

    def send(self, tensor: Array, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst`` of the other program."""
        self._isend(tensor, dst, tag, "Link.send").wait()

    def recv(self, tensor: Array, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor``; return the sender's rank in the other program."""
        return self._irecv(tensor, src, tag, "Link.recv").source_rank()

    def _source(self, src, src_program, op: str) -> bool:
        """Check a broadcast's source; True if it is in this rank's program."""
        if src_program not in (self.local.name, self.remote.name):
            first, second = sorted((self.local, self.remote), key=lambda p: p.index)
            raise located(ValueError, op, f"src_program must be {first.name!r} or "
                          f"{second.name!r}, got {src_program!r}", self._ctx)
        sending = src_program == self.local.name
        size = self._ctx.size if sending else self._remote_size
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
            raise located(ValueError, op, f"src must be a rank of program {src_program!r} "
                          f"in [0, {size}), got {src!r}", self._ctx)
        return sending

    def _wait(self, req, op: str, keep=None, status=None) -> Work:
        work = MPIWork([req], op, self._ctx, None, keep=keep, status=status)
        work.wait()
        return work

    # Broadcasts go source -> rank 0 of the other program -> its ranks, not through an
    # intercommunicator Ibcast (MPICH 5.0 delivers zeros there when the root is not 0).

    def broadcast(self, tensor: Array, src: int, src_program: str) -> None:
        """Copy ``tensor`` of rank ``src`` of ``src_program`` into every rank of the other
        program.

        Every rank of both programs calls it with the same ``src`` and ``src_program``
        (and, in debug mode, a tensor of the same dtype and shape); ranks of the sending
        program other than ``src`` return at once and keep their ``tensor`` as is.
        """
        op = "Link.broadcast"
        self._live(op)
        sending = self._source(src, src_program, op)
        if sending and self._ctx.rank != src:
            if _checked.active:
                self._check(op, array_in(tensor, op, "tensor", self._ctx)[0], src, src_program)
            return
        a, _ = (array_in if sending else array_out)(tensor, op, "tensor", self._ctx)
        if _checked.active:
            self._check(op, a, src, src_program)
        if sending:
            buf = self._device_source(a, op, False) if is_device_array(a) \
                else movable(contiguous(a))
            self._wait(self._lib.Isend(buf, 0, _RELAY_TAG), op, (a, buf))
            return
        # The relay ends in a nonblocking collective (Ibcast) on this program's ranks.
        buf, finish = self._device_target(a, op, True) if is_device_array(a) \
            else self._host_target(a)
        if self._ctx.rank == 0:
            self._wait(self._lib.Irecv(movable(buf), src, _RELAY_TAG), op, buf)
        self._wait(self._local_comm.Ibcast(movable(buf), 0), op, buf)
        if finish is not None:
            finish()
        return

    def _check(self, op: str, *args) -> None:
        """Debug mode: compare this call across every rank of both programs."""
        fingerprint = OPS[op].fingerprint
        assert fingerprint is not None, f"{op} has no fingerprint in the op table"
        fields, _ = fingerprint(self._ctx, *args)
        _checked.check_link_call(self._ctx, self._local_comm, self.remote.ranks, op, fields)

    # -- objects -----------------------------------------------------------------

    def send_object(self, obj: object, dst: int) -> None:
        """Send a picklable object to rank ``dst`` of the other program."""
        op = "Link.send_object"
        self._live(op)
        peer = self._peer(dst, op, "dst")
        data = _dumps(obj)
        self._wait(self._lib.Isend(data, peer, _OBJECT_TAG), op, data)

    def _recv_bytes(self, source: int, tag: int, op: str) -> tuple[np.ndarray, int]:
        status = MPI.Status()
        start = time.monotonic()
        while True:  # a matched probe pairs the size with its own message
            msg = self._lib.Improbe(source, tag, status)
            if msg is not None:
                break
            if time.monotonic() - start > self._ctx.timeout:
                raise DistTimeoutError(f"{op}: nothing arrived within {self._ctx.timeout:.1f} s "
                                       f"[rank {self._ctx.rank}, group {self._ctx.name}]")
            time.sleep(0)
        data = np.empty(status.Get_count(MPI.BYTE), _U8)
        self._wait(msg.Irecv(data), op, data)
        return data, status.Get_source()

    def recv_object(self, src: int | None = None) -> Any:
        """Receive an object sent by :meth:`send_object` (from any rank if ``src`` is None).

        Unpickling runs code the sender chose: link only programs you trust.
        """
        op = "Link.recv_object"
        self._live(op)
        peer = self._peer(src, op, "src", any_source=True)
        data, _ = self._recv_bytes(peer, _OBJECT_TAG, op)
        return pickle.loads(data.data)

    def broadcast_object(self, obj: object, src: int, src_program: str) -> Any:
        """Every rank of the other program gets rank ``src`` of ``src_program``'s ``obj``.

        Every rank of both programs calls it with the same ``src`` and ``src_program``.

        Returns:
            The object on the receiving program; ``obj`` itself on the sending one.
        """
        op = "Link.broadcast_object"
        self._live(op)
        sending = self._source(src, src_program, op)
        if _checked.active:
            self._check(op, src, src_program)
        if sending:
            if self._ctx.rank == src:
                data = _dumps(obj)
                self._wait(self._lib.Isend(data, 0, _RELAY_TAG), op, data)
            return obj
        size = np.zeros(1, _I64)
        if self._ctx.rank == 0:
            data, _ = self._recv_bytes(src, _RELAY_TAG, op)
            size[0] = data.size
        self._wait(self._local_comm.Ibcast(size, 0), op, size)
        if self._ctx.rank != 0:
            data = np.empty(int(size[0]), _U8)
        self._wait(self._local_comm.Ibcast(data, 0), op, data)
        return pickle.loads(data.data)

    def free(self) -> None:
        """Free the link's communicators.  Every rank of both programs must call it."""
        ctx = self._ctx
        if ctx.comm is not None:
            self._lib.Free()
            self._local_comm.Free()
        _checked.free_check_comm(ctx)
        if ctx.comm is not None:
            ctx.comm.Free()
            ctx.mark_destroyed()

    def __repr__(self) -> str:
        return (f"<Link {self.local.name}({self._ctx.size}) <-> {self.remote.name}"
                f"({self._remote_size}) rank={self._ctx.rank}>")
