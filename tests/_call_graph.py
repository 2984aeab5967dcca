"""Which of spmd's files call which during one call: the data path of an op should go
down through its layers, each file calling only into files below it, never back into a
file that called it (a callback, a mixin or a method moved out of its class)."""

from __future__ import annotations

import inspect
import os
import sys

import spmd

ROOT = os.path.dirname(spmd.__file__)


def file_calls(fn) -> set[tuple[str, str]]:
    """(caller, callee) pairs of spmd files (relative to the package) during ``fn()``.

    Left out: resumed generators (a scheduler resuming an op's steps runs code the
    engine defined, as an event loop runs coroutines, without calling into its file);
    calls from core/ into the layers above, which are dispatches through the interfaces
    core defines (the wait loop testing a Work subclass, the flight recorder asking a
    device's end event); and the test double of the device (spmd/testing).
    """
    edges: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        code = frame.f_code
        if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE):
            return
        callee, caller = code.co_filename, frame.f_back.f_code.co_filename
        if callee != caller and callee.startswith(ROOT) and caller.startswith(ROOT):
            a, b = os.path.relpath(caller, ROOT), os.path.relpath(callee, ROOT)
            upcall = a.startswith("core/") and not b.startswith("core/")
            if not upcall and not a.startswith("testing") and not b.startswith("testing"):
                edges.add((a, b))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return edges


def cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    """One cycle of the file graph (a list of files, first == last), or None."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in list(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def calls_in(call) -> tuple[list[str], list[str]]:
    """The Python frames of spmd's package that ``call()`` runs (``file:function``,
    relative to the package) and the C functions called from them, in order
    (``sys.setprofile`` sees every frame and C call: a count that holds on every
    machine)."""
    root = ROOT + os.sep
    frames: list[str] = []
    c_calls: list[str] = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        if event == "call":
            frames.append(f"{path[len(root):]}:{frame.f_code.co_name}")
        elif event == "c_call":
            c_calls.append(arg.__name__)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return frames, c_calls
