"""The NCCL engine's point-to-point operations (tags are ignored: NCCL matches by order)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from spmd.backends.nccl.work import NcclWork, _copy_into, _flat_bytes, _typed
from spmd.core.errors import located

__all__ = ["NcclPointToPoint"]


class NcclPointToPoint:
    """send, recv and batches of them for ``NCCLBackend`` (which mixes this class in:
    it provides ``_cp``, ``_nccl``, ``_grouped``, ``_work``, ``_launch``, ``_inflight``)."""

    group: Any  # the engine's group (DeviceBackend's)

    def _p2p_body(self, ops):
        cp, u8 = self._cp, self._nccl.NCCL_UINT8

        def body(comm, s):
            bufs = [_flat_bytes(cp, a) if sending else
                    (a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype)).reshape(-1).view(np.uint8)
                    for sending, a, _, _ in ops]
            with self._grouped():
                for (sending, _, peer, _), buf in zip(ops, bufs):
                    if buf.size:
                        (comm.send if sending else comm.recv)(buf.data.ptr, buf.size, u8, peer, s)
            for (sending, a, _, _), buf in zip(ops, bufs):
                if not sending:
                    _copy_into(cp, a, _typed(buf, a))
            return bufs

        return body

    def _check_peers(self, ops, op: str) -> None:
        for _, _, peer, _ in ops:
            if peer is None:
                raise located(ValueError, op, "NCCL receives need a source rank (src=None, "
                              "any source, is MPI-only)", self.group)

    def send(self, a, peer, tag):
        return self._work("send", self._p2p_body([(True, a, peer, tag)]), [a], a)

    def recv(self, a, peer, tag):
        self._check_peers([(False, a, peer, tag)], "recv")
        return self._work("recv", self._p2p_body([(False, a, peer, tag)]), [a], a, peer=peer)

    def batch_p2p(self, ops):
        self._check_peers(ops, "batch_isend_irecv")
        end, kept = self._launch("batch_isend_irecv", self._p2p_body(ops))
        works = []
        for sending, a, peer, _ in ops:
            work = NcclWork(self, end, "send" if sending else "recv", [a], (a, kept),
                            peer=None if sending else peer)
            self._inflight.append((end, (a, kept), weakref.ref(work), getattr(work, "_fr", None)))
            works.append(work)
        return works
