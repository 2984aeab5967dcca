"""What a process started by :func:`spmd.spawn` runs: report in, run ``fn``, report back.

The interpreter runs ``spmd.spawn.BOOT`` (written to a file): it reads the job file the
parent wrote (environment, ``sys.path``, working directory), applies it *before* MPI is
initialised, imports mpi4py (MPI_Init, which completes the parent's ``MPI_Comm_spawn``),
sends HELLO, imports this module and calls :func:`main`.

Messages on the intercommunicator to the parent (``MPI.Comm.Get_parent()``), all small
pickles except the payload and the result, which are the user's objects:

- child -> parent ``HELLO``: ``(rank, pid, hostname)``, right after MPI_Init (BOOT).
- parent -> child ``PAYLOAD``: the pickled ``(fn, args)``.
- child -> parent ``RESULT``: ``("ok", pickled value)`` or ``("error", type name,
  message, traceback text)``.
- parent -> child ``STOP``: another rank failed or the job timed out; a listener thread
  sends SIGINT to the main thread: a KeyboardInterrupt that spmd's waits (Python polling
  loops) and ``time.sleep`` see within milliseconds, so the rank leaves a collective its
  peers will never finish.  (Code that blocks in C without checking signals does not
  see it; the parent kills such a rank after a grace period.)
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

from mpi4py import MPI

from spmd.runtime.world import destroy_process_group, init_process_group
from spmd.spawn.protocol import PAYLOAD, RESULT, STOP

__all__ = ["main"]


def _dumps(obj) -> bytes:
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, owned by someone else
        return True
    return True


class _Listener(threading.Thread):
    """Waits for STOP from the parent, or for the parent to vanish, and then interrupts."""

    def __init__(self, parent: MPI.Intercomm, parent_pid: int):
        super().__init__(name="spmd-spawn-listener", daemon=True)
        self.parent, self.parent_pid = parent, parent_pid
        main_ident = threading.main_thread().ident
        assert main_ident is not None  # the main thread is running
        self.main_ident = main_ident
        self.stopped = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.parent.Iprobe(source=0, tag=STOP):
                self.parent.recv(source=0, tag=STOP)
                self.stopped.set()
                # A real signal to the main thread also wakes it from sleep() and other
                # blocking system calls, which interrupt_main() would not.
                signal.pthread_kill(self.main_ident, signal.SIGINT)
                return
            if not _parent_alive(self.parent_pid):
                # Nobody is left to collect a result: do not linger as an orphan.
                os._exit(3)
            time.sleep(0.02)


def _load_main(path: str) -> None:
    """Import the parent's main script as ``__mp_main__`` (as multiprocessing's spawn does)
    so plain pickles that name ``__main__.fn`` resolve; the script's
    ``if __name__ == "__main__":`` block does not run."""
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = module


# cloudpickle (3.1.3 on) names every code object it sends by value this way, instead of
# the file the code came from, so a traceback through it names no file.
_DYNAMIC_CODE = "<dynamic-code>"


def _with_filename(code: types.CodeType, path: str) -> types.CodeType:
    """``code`` and the code objects nested in it, ``<dynamic-code>`` renamed ``path``."""
    consts = tuple(_with_filename(c, path) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    changed = any(a is not b for a, b in zip(consts, code.co_consts))
    if code.co_filename == _DYNAMIC_CODE:
        return code.replace(co_filename=path, co_consts=consts)
    return code.replace(co_consts=consts) if changed else code


def _name_main_code(roots: list, path: str) -> None:
    """Give the functions of the parent's main script ``path`` that came by value (fn,
    what it calls, the methods of its classes, callables among the args) their file
    back, so that tracebacks name the script's file and lines as in the parent."""
    seen: set[int] = set()
    todo: list[Any] = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or getattr(obj, "__module__", None) != "__main__":
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            obj.__code__ = _with_filename(obj.__code__, path)
            todo.extend(obj.__globals__.values())
            todo.extend(c.cell_contents for c in obj.__closure__ or ()
                        if c.cell_contents is not c)
        elif isinstance(obj, type):
            for v in vars(obj).values():
                todo.append(v.__func__ if isinstance(v, (classmethod, staticmethod)) else v)


def _run(parent: MPI.Intercomm, job: dict, listener: _Listener):
    """Receive fn and args, run ``fn(rank, *args)`` with spmd initialised; the reply."""
    rank = MPI.COMM_WORLD.Get_rank()
    payload = parent.recv(source=0, tag=PAYLOAD)
    if job.get("main"):
        _load_main(job["main"])
    fn, args = pickle.loads(payload)
    if job.get("main_file"):
        _name_main_code([fn, *args], job["main_file"])
    init_process_group()
    try:
        value = fn(rank, *args)
    finally:
        listener.done.set()
        destroy_process_group()
    return ("ok", _dumps(value))


def main(job: dict, parent: MPI.Intercomm) -> None:
    """Run one spawned rank (HELLO already sent); every failure goes to the parent as text."""
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # STOP arrives as SIGINT
    listener = _Listener(parent, int(job["parent_pid"]))
    listener.start()
    try:
        reply = _run(parent, job, listener)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        if listener.stopped.is_set() and isinstance(exc, KeyboardInterrupt):
            reply = ("stopped", "KeyboardInterrupt", "stopped by the parent", "")
        else:
            reply = ("error", type(exc).__qualname__, str(exc), traceback.format_exc())
    try:
        listener.done.set()
        parent.send(reply, dest=0, tag=RESULT)
        parent.Disconnect()
    except KeyboardInterrupt:  # a STOP that raced with the reply: the parent has it all
        pass
