"""The public API is annotated and ships its types (PEP 561).

Every callable of ``spmd.__all__`` (and of the public modules' ``__all__``), and every
public method of their classes, annotates each parameter and its return.  Plain pytest,
no MPI job: annotations are read with ``inspect``, not evaluated.
"""

from __future__ import annotations

import inspect
import pathlib
import types
import typing

import spmd

# Public modules reachable from ``spmd`` whose own ``__all__`` is API too.
MODULES = ["coalescing", "comms_log", "futures", "mpmd", "parallel_state", "persistent",
           "store", "topology", "trace"]
# Dunders that are API (the others are Python's protocol and say nothing new).
DUNDERS = {"__init__", "__enter__", "__exit__", "__call__", "__getitem__"}


def _gaps(obj, name: str) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    out = [f"{name}: parameter {p.name!r}" for p in sig.parameters.values()
           if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
        out.append(f"{name}: return")
    return out


def _class_gaps(cls: type, name: str) -> list[str]:
    out = []
    for attr, member in vars(cls).items():
        if attr.startswith("_") and attr not in DUNDERS:
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property):
            member = member.fget
        if inspect.isfunction(member):
            out += _gaps(member, f"{name}.{attr}")
    return out


def _public_objects():
    seen = set()
    sources = [(spmd, "spmd")] + [(getattr(spmd, m), f"spmd.{m}") for m in MODULES]
    for module, prefix in sources:
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType) or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield obj, f"{prefix}.{attr}"


def test_public_api_is_annotated():
    gaps, checked = [], 0
    for obj, name in _public_objects():
        if inspect.isclass(obj):
            if obj.__module__.startswith("spmd"):
                gaps += _class_gaps(obj, name)
                checked += 1
        elif callable(obj):
            gaps += _gaps(obj, name)
            checked += 1
    assert checked > 100, checked
    assert not gaps, "unannotated public API:\n  " + "\n  ".join(gaps)


def test_annotations_resolve_at_run_time():
    # typing.get_type_hints (used by docs tools and runtime checkers) finds every name.
    failures, checked = [], 0
    for obj, name in _public_objects():
        if inspect.isclass(obj):
            if not obj.__module__.startswith("spmd"):
                continue
            members = [(m.__func__ if isinstance(m, (staticmethod, classmethod)) else
                        m.fget if isinstance(m, property) else m, f"{name}.{a}")
                       for a, m in vars(obj).items()]
        else:
            members = [(obj, name)]
        for fn, label in members:
            # Functions spmd wrote: a NamedTuple's __new__ is the standard library's,
            # made where builtins are not visible, so its hints never resolve.
            if not inspect.isfunction(fn) or not (fn.__module__ or "").startswith("spmd."):
                continue
            checked += 1
            try:
                typing.get_type_hints(fn)
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                failures.append(f"{label}: {type(exc).__name__}: {exc}")
    assert checked > 300, checked
    assert not failures, "\n  ".join(failures)


def test_the_checker_sees_a_gap():
    def f(x, y: int = 0):
        return x

    assert _gaps(f, "f") == ["f: parameter 'x'", "f: return"]


def test_py_typed_is_shipped():
    assert (pathlib.Path(spmd.__file__).parent / "py.typed").is_file()


def test_future_constructor_is_torchs():
    # torch.futures.Future() takes no arguments; the producer hooks are not in it.
    assert list(inspect.signature(spmd.Future).parameters) == []
    fut = spmd.Future()
    fut.set_result(3)
    assert fut.wait() == 3 and fut.done()
