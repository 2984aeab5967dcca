"""spmd's public callables take torch.distributed's parameters.

For every name of ``spmd.__all__`` that torch.distributed also has and whose torch
signature ``inspect`` can read: same parameter names in the same order, same kinds
(positional-only, keyword-only, ...) and same defaults (ReduceOp defaults compared by
op name).  torch-private parameters (names starting with ``_``) are ignored;
annotations are not compared.  Plain pytest; skipped without torch.
"""

from __future__ import annotations

import inspect

import pytest

torch_dist = pytest.importorskip("torch.distributed", reason="torch is not installed")

import spmd  # noqa: E402

_EMPTY = inspect.Parameter.empty


def _shared_names() -> list[str]:
    # Classes bound from C++ (ProcessGroup, ReduceOp, Work, errors) have no signature
    # inspect can read; they are left out rather than skipped.
    return [n for n in spmd.__all__
            if callable(getattr(spmd, n)) and callable(getattr(torch_dist, n, None))
            and _signature(getattr(torch_dist, n)) is not None]


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and pybind11 classes have none
        return None


def _default(value) -> str:
    if value is _EMPTY:
        return "<required>"
    kind = type(value).__qualname__
    if "ReduceOp" in kind or "RedOpType" in kind:
        return f"ReduceOp.{getattr(value, 'name', value)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"{kind}({value!r})"


def _params(sig) -> list[tuple[str, str, str]]:
    return [(p.name, p.kind.name, _default(p.default))
            for p in sig.parameters.values() if not p.name.startswith("_")]


def _differences(ours, theirs) -> list[str]:
    out = []
    names_o, names_t = [p[0] for p in ours], [p[0] for p in theirs]
    if names_o != names_t:
        out.append(f"parameter names/order: spmd {names_o} != torch {names_t}")
        missing = [n for n in names_t if n not in names_o]
        extra = [n for n in names_o if n not in names_t]
        if missing:
            out.append(f"missing in spmd: {missing}")
        if extra:
            out.append(f"only in spmd: {extra}")
    torch_by_name = {p[0]: p for p in theirs}
    for name, kind, default in ours:
        t = torch_by_name.get(name)
        if t is None:
            continue
        if kind != t[1]:
            out.append(f"{name}: kind spmd {kind} != torch {t[1]}")
        if default != t[2]:
            out.append(f"{name}: default spmd {default} != torch {t[2]}")
    return out


NAMES = _shared_names()


def test_some_names_are_compared():
    assert len(NAMES) > 30, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_signature_matches_torch(name):
    theirs = _signature(getattr(torch_dist, name))
    ours = _signature(getattr(spmd, name))
    assert ours is not None, f"spmd.{name} has no signature inspect can read, torch's is {theirs}"
    diffs = _differences(_params(ours), _params(theirs))
    assert not diffs, (f"spmd.{name}{ours} differs from torch.distributed.{name}{theirs}:\n  "
                       + "\n  ".join(diffs))
