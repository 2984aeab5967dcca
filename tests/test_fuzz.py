"""Fuzzing of arguments: invalid calls raise the documented type on every rank, never
hang, never crash, never touch the arrays passed in.

Every rank draws the same examples (hypothesis, derandomized) and makes the same
call: a valid call for the op with one or two faults injected, each fault with the
exception type the docs promise for it (TypeError for a wrong type, ValueError for a
wrong value).  After each call: every rank raised one of the injected faults' types
and the same one as the other ranks; the arrays it was given are unchanged; and a
real all_reduce proves no rank started communicating (a stray collective would make
it return a wrong sum or time out).
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

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


def _bad_array(draw):
    return draw(st.sampled_from(NOT_ARRAYS + BAD_DTYPES))


def _root_faults(draw, n, arg):
    """(kwargs update, type) for a bad root given as ``arg`` (global) / ``group_arg``."""
    kind = draw(st.sampled_from(["range", "type", "both", "group_range", "group_type"]))
    if kind == "range":
        return {arg: draw(st.sampled_from([n, n + 3, -1, 10**9]))}, V
    if kind == "type":
        return {arg: draw(st.sampled_from(["0", 1.5, True, [0]]))}, T
    if kind == "both":
        return {arg: 0, f"group_{arg}": 0}, V
    if kind == "group_range":
        return {arg: None, f"group_{arg}": draw(st.sampled_from([n, -1, 99]))}, V
    return {arg: None, f"group_{arg}": draw(st.sampled_from(["0", 0.0, False]))}, T


def _op_faults(draw, dtype):
    """(value, type) of a bad reduce op for arrays of ``dtype``."""
    import spmd

    floating = np.dtype(dtype).kind == "f"
    # PREMUL_SUM without a factor: a wrong value for floats; integers refuse the op (type).
    choices = [(o, T) for o in BAD_OPS_T] + [(spmd.ReduceOp.PREMUL_SUM, V if floating else T)]
    if floating:
        choices.append((spmd.ReduceOp.BAND, T))
    return draw(st.sampled_from(choices))


OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
       "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "barrier",
       "isend", "irecv", "send", "all_gather_object", "broadcast_object_list", "new_group"]


def _case(draw, spmd, n, rank):
    """Return (function, kwargs, expected types, arrays that must stay unchanged)."""
    op = draw(st.sampled_from(OPS))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.int32, np.int64]))
    k = draw(st.integers(1, 5))
    x = np.arange(k, dtype=dtype)
    faults: list[tuple[dict, type]] = []
    pick = draw(st.integers(1, 2))  # how many faults to inject

    def fault(*options):
        faults.append(draw(st.sampled_from(options))())

    if op == "all_reduce":
        kw = {"tensor": x}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: ({"op": (o := _op_faults(draw, dtype))[0]}, o[1]),
                  lambda: ({"group": draw(st.sampled_from(BAD_GROUPS))}, T))
    elif op == "broadcast":
        kw = {"tensor": x, "src": 0}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: _root_faults(draw, n, "src"),
                  lambda: ({"src": None}, V))
    elif op == "reduce":
        kw = {"tensor": x, "dst": 0}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: _root_faults(draw, n, "dst"),
                  lambda: ({"op": (o := _op_faults(draw, dtype))[0]}, o[1]))
    elif op == "all_gather":
        kw = {"tensor_list": [np.empty(k, dtype) for _ in range(n)], "tensor": x}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
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
                  lambda: ({"input_tensor": _bad_array(draw)}, T))
    elif op == "reduce_scatter_tensor":
        kw = {"output": np.empty(k, dtype), "input": np.ones(n * k, dtype)}
        for _ in range(pick):
            fault(lambda: ({"input": np.ones(n * k + 1, dtype)}, V),
                  lambda: ({"output": np.empty(k, np.complex64)}, T),
                  lambda: ({"output": _bad_array(draw)}, T),
                  lambda: ({"op": (o := _op_faults(draw, dtype))[0]}, o[1]))
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
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: _root_faults(draw, n, "dst"))
    elif op == "scatter":
        kw = {"tensor": np.empty(k, dtype), "src": 0,
              "scatter_list": [np.ones(k, dtype) for _ in range(n)] if rank == 0 else None}
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: ({"tensor": _read_only(x)}, V),
                  lambda: _root_faults(draw, n, "src"))
    elif op == "barrier":
        kw = {}
        faults.append(({"group": draw(st.sampled_from(BAD_GROUPS))}, T))
    elif op in ("isend", "irecv", "send"):
        peer = "src" if op == "irecv" else "dst"
        kw = {"tensor": x, peer: (rank + 1) % n}
        if n == 1:  # the only peer is this rank itself
            faults.append(({}, V))
        for _ in range(pick):
            fault(lambda: ({"tensor": _bad_array(draw)}, T),
                  lambda: ({peer: rank}, V),
                  lambda: ({peer: draw(st.sampled_from([n, -2, 10**6]))}, V),
                  lambda: ({"tag": draw(st.sampled_from([-1, 2**40]))}, V),
                  lambda: ({"tag": draw(st.sampled_from(["1", 1.0, None]))}, T))
    elif op == "all_gather_object":
        kw = {"object_list": [None] * n, "obj": {"k": k}}
        faults.append(draw(st.sampled_from([({"object_list": (None,) * n}, T),
                                            ({"object_list": [None] * (n + 1)}, V)])))
    elif op == "broadcast_object_list":
        kw = {"object_list": [k], "src": 0}
        for _ in range(pick):
            fault(lambda: ({"object_list": "abc"}, T),
                  lambda: _root_faults(draw, n, "src"))
    else:  # new_group
        kw = {"ranks": list(range(n))}
        faults.append(draw(st.sampled_from([({"ranks": [0, n]}, V), ({"ranks": [0, 0]}, V),
                                            ({"ranks": [0, "1"]}, T), ({"ranks": 3}, T),
                                            ({"ranks": [-1]}, V)])))
    expected = set()
    for update, exc in faults:
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


@settings(derandomize=True, database=None, deadline=None, max_examples=250,
          # No shrinking: ranks must stay in lockstep, and a shrink that goes a different
          # way on one rank would leave the others in a collective it never calls.
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_invalid_arguments_raise_everywhere_and_change_nothing(dist, data):
    n, rank = dist.get_world_size(), dist.get_rank()
    fn, kw, expected, arrays = _case(data.draw, dist, n, rank)
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
    elif not all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f") for a, b in zip(arrays, before)):
        problem = f"{fn.__name__} changed an array it was given before raising"
    # Every rank agrees on the verdict, so a failure fails (and shrinks) on every rank
    # alike instead of leaving the others in a different example.
    verdicts = [None] * n
    dist.all_gather_object(verdicts, (type(raised).__name__, problem))
    _count[0] += 1
    check = np.array([_count[0]], np.int64)
    dist.all_reduce(check)  # no rank left a collective half-started
    assert check[0] == n * _count[0]
    bad = {r: v for r, v in enumerate(verdicts) if v[1] is not None}
    assert not bad, bad
    assert len({v[0] for v in verdicts}) == 1, f"ranks raised different types: {verdicts}"
