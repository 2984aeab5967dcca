"""Copies between device arrays the NCCL engine makes around NCCL's calls: NCCL moves
contiguous bytes, the arrays it is handed may be strided or of any dtype."""

from __future__ import annotations

import numpy as np

from spmd.core.arrays import bfloat16, contiguous

__all__ = ["bytes_into", "copy_into", "flat_bytes", "typed"]


def _bits(a):
    """Same-width unsigned view for copies (CuPy may lack bfloat16 kernels)."""
    return a.view(np.uint16) if bfloat16 is not None and a.dtype == bfloat16 else a


def copy_into(cp, out, src) -> None:
    """``out[...] = src`` (same dtype and size), unless they are the same array."""
    if src is out:
        return
    if src.shape != out.shape:
        src = src.reshape(out.shape)
    cp.copyto(_bits(out), _bits(src))


def flat_bytes(cp, a):
    """A contiguous array's bytes (a copy only when ``a`` is not contiguous)."""
    return contiguous(a, cp).reshape(-1).view(np.uint8)


def typed(buf_u8, like):
    """Bytes seen as an array of ``like``'s dtype and shape."""
    return buf_u8.view(like.dtype).reshape(like.shape)


def bytes_into(cp, out, src_u8) -> None:
    """Copy bytes at any offset into ``out``: straight into its bytes when it is
    contiguous, else through an aligned buffer of its dtype."""
    if not src_u8.size:
        return
    if out.flags.c_contiguous:
        out.reshape(-1).view(np.uint8)[...] = src_u8
        return
    tmp = cp.empty(out.shape, out.dtype)
    tmp.reshape(-1).view(np.uint8)[...] = src_u8
    copy_into(cp, out, tmp)
