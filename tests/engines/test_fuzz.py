"""Fuzzing of arguments: invalid calls raise the documented type on every rank, never
hang, never crash, never touch the arrays passed in.

Each example is built from an explicit seed (one pytest case per seed) with a
``random.Random`` of that seed, and every rank builds it with the same draws, so the
ranks' examples are identical by construction: no generator that adapts to earlier
outcomes (which differ between root and non-root ranks) can send ranks down different
examples and out of lockstep.  Each case is a valid call for the op with one or two
faults injected, each fault with the exception type the docs promise for it (TypeError
for a wrong type, ValueError for a wrong value).  After each call: every rank raised one
of the injected faults' types and the same one as the other ranks; the arrays it was
given are unchanged; and a real all_reduce proves no rank started communicating (a
stray collective would make it return a wrong sum or time out).

``SPMD_FUZZ_EXAMPLES`` (default 250) sets the number of seeds; ``SPMD_FUZZ_SEED`` the
first one, to explore other examples.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import spmd

pytestmark = pytest.mark.mpi

T, V = TypeError, ValueError

# Values that are not arrays, and arrays of dtypes spmd refuses: TypeError.
NOT_ARRAYS = [[1.0, 2.0], 3, "x", None, (1, 2), {"a": 1}]
BAD_DTYPES = [np.array([1, "a"], dtype=object), np.array(["ab", "c"]),
              np.zeros(2, "datetime64[s]"), np.zeros(2, np.longdouble)]
BAD_GROUPS = [5, "WORLD", 1.5, [0]]
BAD_OPS_T = ["sum", 3, 1.5, object()]


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _bad_array(rng):
    return rng.choice(NOT_ARRAYS + BAD_DTYPES)


def _root_faults(rng, n, arg):
    """(kwargs update, type) for a bad root given as ``arg`` (global) / ``group_arg``."""
    kind = rng.choice(["range", "type", "both", "group_range", "group_type"])
    if kind == "range":
        return {arg: rng.choice([n, n + 3, -1, 10**9])}, V
    if kind == "type":
        return {arg: rng.choice(["0", 1.5, True, [0]])}, T
    if kind == "both":
        return {arg: 0, f"group_{arg}": 0}, V
    if kind == "group_range":
        return {arg: None, f"group_{arg}": rng.choice([n, -1, 99])}, V
    return {arg: None, f"group_{arg}": rng.choice(["0", 0.0, False])}, T


def _op_faults(rng, dtype):
    """(value, type) of a bad reduce op for arrays of ``dtype``."""
    floating = np.dtype(dtype).kind == "f"
    # PREMUL_SUM without a factor: a wrong value for floats; integers refuse the op (type).
    choices = [(o, T) for o in BAD_OPS_T] + [(spmd.ReduceOp.PREMUL_SUM, V if floating else T)]
    if floating:
        choices.append((spmd.ReduceOp.BAND, T))
    return rng.choice(choices)


OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
       "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "barrier",
       "isend", "irecv", "send", "all_gather_object", "broadcast_object_list", "new_group"]


def _case(rng: random.Random, n: int, rank: int):
    """Return (function, kwargs, expected types, arrays that must stay unchanged)."""
    op = rng.choice(OPS)
    dtype = rng.choice([np.float32, np.float64, np.int32, np.int64])
    k = rng.randint(1, 5)
    x = np.arange(k, dtype=dtype)
    faults: list[tuple[dict, type]] = []
    pick = rng.randint(1, 2)  # how many faults to inject

    def fault(*options):
        faults.append(rng.choice(options)())

    if op == "all_reduce":
        kw = {"tensor": x}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: ({"op": (o := _op_faults(rng, dtype))[0]}, o[1]),
                  lambda: ({"group": rng.choice(BAD_GROUPS)}, T))
    elif op == "broadcast":
        kw = {"tensor": x, "src": 0}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: _root_faults(rng, n, "src"),
                  lambda: ({"src": None}, V))
    elif op == "reduce":
        kw = {"tensor": x, "dst": 0}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: _root_faults(rng, n, "dst"),
                  lambda: ({"op": (o := _op_faults(rng, dtype))[0]}, o[1]))
    elif op == "all_gather":
        kw = {"tensor_list": [np.empty(k, dtype) for _ in range(n)], "tensor": x}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: ({"tensor_list": np.empty(k * n, dtype)}, T),
                  lambda: ({"tensor_list": [np.empty(k, dtype)] * (n + 1)}, V),
                  lambda: ({"tensor_list": [np.empty(k, np.complex64)] * n}, T),
                  lambda: ({"tensor_list": [np.empty(k + 1, dtype) for _ in range(n)]}, V))
    elif op == "all_gather_into_tensor":
        kw = {"output_tensor": np.empty(n * k, dtype), "input_tensor": x}
        for _ in range(pick):
            fault(lambda: ({"output_tensor": np.empty(n * k + 1, dtype)}, V),
                  lambda: ({"output_tensor": np.empty(n * k, np.complex128)}, T),
                  lambda: ({"output_tensor": _read_only(np.empty(n * k, dtype))}, V),
                  lambda: ({"input_tensor": _bad_array(rng)}, T))
    elif op == "reduce_scatter_tensor":
        kw = {"output": np.empty(k, dtype), "input": np.ones(n * k, dtype)}
        for _ in range(pick):
            fault(lambda: ({"input": np.ones(n * k + 1, dtype)}, V),
                  lambda: ({"output": np.empty(k, np.complex64)}, T),
                  lambda: ({"output": _bad_array(rng)}, T),
                  lambda: ({"op": (o := _op_faults(rng, dtype))[0]}, o[1]))
    elif op == "all_to_all_single":
        kw = {"output": np.empty(n * k, dtype), "input": np.ones(n * k, dtype)}
        for _ in range(pick):
            fault(lambda: ({"input_split_sizes": [k] * (n + 1)}, V),
                  lambda: ({"input_split_sizes": [-1] + [k] * (n - 1)}, V),
                  lambda: ({"output_split_sizes": [k + 1] * n}, V),
                  lambda: ({"input_split_sizes": "k"}, T),
                  lambda: ({"output": np.empty(n * k, np.complex64)}, T),
                  lambda: ({"input": np.ones((), dtype)}, V))
    elif op == "gather":
        kw = {"tensor": x, "dst": 0,
              "gather_list": [np.empty(k, dtype) for _ in range(n)] if rank == 0 else None}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: _root_faults(rng, n, "dst"))
    elif op == "scatter":
        kw = {"tensor": np.empty(k, dtype), "src": 0,
              "scatter_list": [np.ones(k, dtype) for _ in range(n)] if rank == 0 else None}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: _root_faults(rng, n, "src"))
    elif op == "barrier":
        kw = {}
        faults.append(({"group": rng.choice(BAD_GROUPS)}, T))
    elif op in ("isend", "irecv", "send"):
        peer = "src" if op == "irecv" else "dst"
        kw = {"tensor": x, peer: (rank + 1) % n}
        if n == 1:  # the only peer is this rank itself
            faults.append(({}, V))
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(rng)}, T),
                  lambda: ({peer: rank}, V),
                  lambda: ({peer: rng.choice([n, -2, 10**6])}, V),
                  lambda: ({"tag": rng.choice([-1, 2**40])}, V),
                  lambda: ({"tag": rng.choice(["1", 1.0, None])}, T))
    elif op == "all_gather_object":
        kw = {"object_list": [None] * n, "obj": {"k": k}}
        faults.append(rng.choice([({"object_list": (None,) * n}, T),
                                  ({"object_list": [None] * (n + 1)}, V)]))
    elif op == "broadcast_object_list":
        kw = {"object_list": [k], "src": 0}
        for _ in range(pick):
            fault(lambda: ({"object_list": "abc"}, T),
                  lambda: _root_faults(rng, n, "src"))
    else:  # new_group
        kw = {"ranks": list(range(n))}
        faults.append(rng.choice([({"ranks": [0, n]}, V), ({"ranks": [0, 0]}, V),
                                  ({"ranks": [0, "1"]}, T), ({"ranks": 3}, T),
                                  ({"ranks": [-1]}, V)]))
    # A fault that touches an argument an earlier fault set would overwrite or combine
    # with it (src=None after src=0, group_src=0 makes a valid call again): keep the first.
    expected, touched = set(), set()
    for update, exc in faults:
        names = {key.removeprefix("group_") for key in update}
        if names & touched:
            continue
        touched |= names
        kw.update(update)
        expected.add(exc)
    return getattr(spmd, op), kw, expected, list(_arrays(kw))


def _arrays(kw):
    for v in kw.values():
        if isinstance(v, np.ndarray) and v.dtype != object:
            yield v
        elif isinstance(v, list):
            yield from (a for a in v if isinstance(a, np.ndarray) and a.dtype != object)


_count = [0]
_FIRST_SEED = int(os.environ.get("SPMD_FUZZ_SEED", "0"))
_EXAMPLES = int(os.environ.get("SPMD_FUZZ_EXAMPLES", "250"))


@pytest.mark.parametrize("seed", range(_FIRST_SEED, _FIRST_SEED + _EXAMPLES))
def test_invalid_arguments_raise_everywhere_and_change_nothing(dist, seed):
    n, rank = dist.get_world_size(), dist.get_rank()
    fn, kw, expected, arrays = _case(random.Random(seed), n, rank)
    before = [a.copy() for a in arrays]
    try:
        fn(**kw)
    except Exception as exc:  # noqa: BLE001 - checked below
        raised = exc
    else:
        raised = None
    problem = None
    if raised is None:
        problem = f"{fn.__name__}({kw}) did not raise (expected {sorted(e.__name__ for e in expected)})"
    elif type(raised) not in expected:
        problem = (f"{fn.__name__} raised {type(raised).__name__}: {raised}; expected one of "
                   f"{sorted(e.__name__ for e in expected)}")
    # Bitwise: the np.empty outputs hold arbitrary bytes, NaN patterns included.
    elif not all(a.tobytes() == b.tobytes() for a, b in zip(arrays, before)):
        problem = f"{fn.__name__} changed an array it was given before raising"
    # Every rank agrees on the verdict, so a failure fails on every rank alike.
    verdicts = [None] * n
    dist.all_gather_object(verdicts, (type(raised).__name__, problem, fn.__name__, repr(sorted(kw))))
    _count[0] += 1
    check = np.array([_count[0]], np.int64)
    dist.all_reduce(check)  # no rank left a collective half-started
    assert check[0] == n * _count[0]
    assert len({v[2:] for v in verdicts}) == 1, f"ranks built different examples: {verdicts}"
    bad = {r: v for r, v in enumerate(verdicts) if v[1] is not None}
    assert not bad, bad
    assert len({v[0] for v in verdicts}) == 1, f"ranks raised different types: {verdicts}"
