"""Deterministic inputs per rank and numpy references for the collective tests.

Every rank can build every other rank's input, so each rank computes the expected
result of a collective locally and compares it with what spmd gave it.
"""

from __future__ import annotations

import functools

import numpy as np

REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"]
PREMUL_FACTOR = 0.5


def family(dt: np.dtype) -> str:
    if dt == np.bool_:
        return "bool"
    if dt.name == "bfloat16" or dt == np.float16:
        return "half"
    return {"i": "int", "u": "uint", "f": "float", "c": "complex"}[dt.kind]


def supported(dt: np.dtype, opname: str) -> bool:
    """The documented dtype/op rules (see spmd.ReduceOp), written out independently."""
    fam = family(dt)
    if fam == "bool":
        return opname not in ("AVG", "PREMUL_SUM")
    if fam in ("int", "uint"):
        return opname != "PREMUL_SUM"
    if opname in ("BAND", "BOR", "BXOR"):
        return False
    if fam == "complex" and opname in ("MIN", "MAX"):
        return False
    return True


def make(rank: int, shape, dt, opname: str = "SUM", salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small exact values, 1..3 for products (no overflow)."""
    dt = np.dtype(dt)
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.int64) + 7 * salt
    fam = family(dt)
    if fam == "bool":
        v = (i + rank) % 3 == 0
    elif opname == "PRODUCT":
        v = (i + rank) % 3 + 1
        if fam == "complex":
            v = v + 1j * ((i + rank) % 2)
    else:
        v = (3 * i + 5 * rank) % 11
        if fam != "uint":
            v = v - 5
        if fam == "complex":
            v = v + 1j * (((i + 2 * rank) % 5) - 2)
    return np.asarray(v).astype(dt).reshape(shape)


def _wide(dt: np.dtype):
    fam = family(dt)
    return {"bool": np.bool_, "int": np.int64, "uint": np.uint64, "half": np.float64,
            "float": np.float64, "complex": np.complex128}[fam]


def reduce_ref(arrays: list, opname: str, dt) -> np.ndarray:
    dt = np.dtype(dt)
    fam = family(dt)
    stack = np.stack([a.astype(_wide(dt)) for a in arrays])
    n = len(arrays)
    if fam == "bool":
        any_, all_ = stack.any(0), stack.all(0)
        res = {"SUM": any_, "MAX": any_, "BOR": any_, "PRODUCT": all_, "MIN": all_, "BAND": all_,
               "BXOR": functools.reduce(np.logical_xor, stack)}[opname]
        return np.asarray(res).astype(dt)
    if opname == "SUM":
        res = stack.sum(0)
    elif opname == "PRODUCT":
        res = stack.prod(0)
    elif opname == "MIN":
        res = stack.min(0)
    elif opname == "MAX":
        res = stack.max(0)
    elif opname == "BAND":
        res = np.bitwise_and.reduce(stack, 0)
    elif opname == "BOR":
        res = np.bitwise_or.reduce(stack, 0)
    elif opname == "BXOR":
        res = np.bitwise_xor.reduce(stack, 0)
    elif opname == "AVG":
        s = stack.sum(0)
        if fam == "int":
            res = np.sign(s) * (np.abs(s) // n)  # truncation toward zero, like NCCL
        elif fam == "uint":
            res = s // n
        else:
            res = s / n
    elif opname == "PREMUL_SUM":
        res = (stack * PREMUL_FACTOR).sum(0)
    else:
        raise ValueError(opname)
    return np.asarray(res).astype(dt)


def assert_equal(got: np.ndarray, expect: np.ndarray, opname: str = "") -> None:
    """Exact for integers and bool; a few ulps for floats (AVG divides once)."""
    assert got.dtype == expect.dtype, (got.dtype, expect.dtype)
    assert got.shape == expect.shape, (got.shape, expect.shape)
    fam = family(got.dtype)
    if fam in ("bool", "int", "uint"):
        np.testing.assert_array_equal(got, expect)
        return
    rtol = {"half": 1e-2, "float": 1e-6, "complex": 1e-6}[fam]
    if got.dtype in (np.float64, np.complex128):
        rtol = 1e-12
    wide = np.complex128 if fam == "complex" else np.float64
    np.testing.assert_allclose(got.astype(wide), expect.astype(wide), rtol=rtol, atol=0,
                               err_msg=opname)


LAYOUTS = ["contig", "strided", "scalar", "empty"]


def buffer(layout: str, dt, fill=0):
    """(array to pass, base it views, mask of base elements the array covers)."""
    dt = np.dtype(dt)
    if layout == "contig":
        base = np.full((3, 5), fill, dtype=dt)
        return base, base, np.ones(base.shape, bool)
    if layout == "strided":
        base = np.full((3, 10), fill, dtype=dt)
        mask = np.zeros(base.shape, bool)
        mask[:, ::2] = True
        return base[:, ::2], base, mask
    if layout == "scalar":
        base = np.full((), fill, dtype=dt)
        return base, base, np.ones((), bool)
    if layout == "empty":
        base = np.full((0,), fill, dtype=dt)
        return base, base, np.ones((0,), bool)
    raise ValueError(layout)


def shape_of(layout: str):
    return {"contig": (3, 5), "strided": (3, 5), "scalar": (), "empty": (0,)}[layout]
