"""What each rank of :func:`spmd.spawn` runs: ``python -m spmd.spawn.child``.

The MPI library's launcher starts it (``mpiexec -n N python -m spmd.spawn.child``) in
the environment the caller chose: the caller's, its ``env=`` and the address and token
of the caller's socket (:mod:`spmd.spawn.protocol`).  Importing this module initialises
MPI (the ranks' ``MPI.COMM_WORLD`` is the spawned job); :func:`main` then connects to
the caller, reports the rank and its pid (HELLO), receives the job (the caller's
``sys.path``, its main script, the pickled ``fn`` and ``args``), runs ``fn(rank,
*args)`` with spmd initialised, and reports the return value or the exception with its
traceback text (RESULT).

A listener thread reads the connection while ``fn`` runs.  STOP (another rank failed,
the job timed out) becomes a SIGINT to the main thread: a KeyboardInterrupt that spmd's
waits (Python polling loops) and ``time.sleep`` see within milliseconds, so the rank
leaves a collective its peers will never finish.  (Code that blocks in C without
checking signals does not see it; the caller kills such a rank after a grace period.)
The connection ending means the caller is gone: the rank exits at once rather than
linger with nobody to report to.
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import signal
import socket
import sys
import threading
import traceback
import types
from typing import Any

from mpi4py import MPI

from spmd.runtime.world import destroy_process_group, init_process_group
from spmd.spawn.protocol import (
    ADDRESS_VAR,
    HELLO,
    JOB,
    RESULT,
    STOP,
    TOKEN_VAR,
    frame,
    recv_frame,
)

__all__ = ["main"]

# Exit statuses: started by hand rather than by spawn; the caller went away.
_NOT_SPAWNED, _CALLER_GONE = 2, 3


def _dumps(obj) -> bytes:
    try:
        import cloudpickle  # optional: closures and lambdas among return values too
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _Listener(threading.Thread):
    """Reads the caller's connection while ``fn`` runs: STOP interrupts the main thread,
    the connection's end ends the process."""

    def __init__(self, conn: socket.socket):
        super().__init__(name="spmd-spawn-listener", daemon=True)
        self.conn = conn
        main_ident = threading.main_thread().ident
        assert main_ident is not None  # the main thread is running
        self.main_ident = main_ident
        self.stopped = threading.Event()
        self.done = threading.Event()   # fn has returned or raised: nothing to interrupt

    def run(self) -> None:
        while True:
            try:
                message = recv_frame(self.conn)
            except OSError:
                message = None
            if message is None:
                if not self.done.is_set():
                    # The caller is gone: end now, skipping exit handlers (MPI_Finalize)
                    # that would wait for peers stuck in fn.
                    os._exit(_CALLER_GONE)
                return
            if message[0] == STOP and not self.done.is_set():
                self.stopped.set()
                # A real signal to the main thread also wakes it from sleep() and other
                # blocking system calls, which _thread.interrupt_main() would not.
                signal.pthread_kill(self.main_ident, signal.SIGINT)


def _load_main(path: str) -> None:
    """Import the caller's main script as ``__mp_main__`` (as multiprocessing's spawn does)
    so plain pickles that name ``__main__.fn`` resolve; the script's
    ``if __name__ == "__main__":`` block does not run."""
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
    """Give the functions of the caller's main script ``path`` that came by value (fn,
    what it calls, the methods of its classes, callables among the args) their file
    back, so that tracebacks name the script's file and lines as in the caller."""
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


def _run(rank: int, job: dict, listener: _Listener) -> tuple:
    """Load what ``fn`` needs, run ``fn(rank, *args)`` with spmd initialised; the reply."""
    sys.path[:0] = job["path"]
    if job["main"]:
        _load_main(job["main"])
    fn, args = pickle.loads(job["payload"])
    if job["main_file"]:
        _name_main_code([fn, *args], job["main_file"])
    init_process_group()
    try:
        value = fn(rank, *args)
    finally:
        listener.done.set()
        destroy_process_group()
    return ("ok", _dumps(value))


def _connect() -> socket.socket:
    """The connection to the caller, from the address and token in the environment (taken
    out of it: fn and what it starts are no part of this job's plumbing)."""
    address, token = os.environ.pop(ADDRESS_VAR, None), os.environ.pop(TOKEN_VAR, None)
    if not address or not token:
        sys.stderr.write(f"spmd.spawn.child: {ADDRESS_VAR} and {TOKEN_VAR} are not set; this "
                         "module is what spmd.spawn's ranks run, not a program of its own\n")
        raise SystemExit(_NOT_SPAWNED)
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=60)
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    world = MPI.COMM_WORLD
    hello = {"token": token, "rank": world.Get_rank(), "size": world.Get_size(),
             "pid": os.getpid(), "host": socket.gethostname()}
    step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")
    if os.environ.get("SLURM_JOB_ID") and step:  # srun's: the caller cancels it to end the job
        hello["step"] = f"{os.environ['SLURM_JOB_ID']}.{step}"
    conn.sendall(frame(HELLO, json.dumps(hello).encode()))
    return conn


def main() -> None:
    """Run one spawned rank; every outcome goes back to the caller."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # STOP arrives as SIGINT
    conn = _connect()
    message = recv_frame(conn)
    if message is None or message[0] != JOB:
        os._exit(_CALLER_GONE)  # the caller ended the job before it began
    listener = _Listener(conn)
    listener.start()
    try:
        reply = _run(MPI.COMM_WORLD.Get_rank(), pickle.loads(message[1]), listener)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        if listener.stopped.is_set() and isinstance(exc, KeyboardInterrupt):
            reply = ("stopped", "KeyboardInterrupt", "stopped by the caller", "")
        else:
            reply = ("error", type(exc).__qualname__, str(exc), traceback.format_exc())
    listener.done.set()
    conn.sendall(frame(RESULT, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)))
    # Tells the caller nothing more comes, and ends the listener's read.
    conn.shutdown(socket.SHUT_RDWR)
    conn.close()


if __name__ == "__main__":
    try:
        main()
    except (KeyboardInterrupt, OSError):
        # A STOP that came as fn ended, or a caller gone mid-reply: the caller has
        # ended the job and wants nothing more from this rank.
        os._exit(_CALLER_GONE)
