"""What each rank of :func:`spmd.spawn` runs: ``python -m spmd.spawn.child``.

The MPI library's launcher starts it (``mpiexec -n N python -m spmd.spawn.child``) in
the environment the caller chose: the caller's, its ``env=`` and the address and token
of the caller's socket (:mod:`spmd.spawn.protocol`).  Importing this module initialises
MPI (the ranks' ``MPI.COMM_WORLD`` is the spawned job); :func:`main` then connects to
the caller, has it prove it knows the token, proves it in turn and reports the rank and
its pid (HELLO), receives the job (the caller's ``sys.path``, its main script, the
pickled ``fn`` and ``args``), runs ``fn(rank, *args)`` with spmd initialised, and reports
the return value or the exception with its traceback text (RESULT).

Whatever listens at the address and cannot prove it knows the token gets a challenge and
nothing else, and nothing it sends is unpickled: the rank says so on stderr and exits
(status 4).  A connection the caller closes before the job came (it sheds connections
it has no room for) is made again, after a pause that doubles up to a second, for up to
``protocol.HANDSHAKE_TIMEOUT`` seconds in all; nobody listening means the caller is gone.

A listener thread reads the connection while ``fn`` runs.  STOP (another rank failed,
the job timed out) becomes a SIGINT to the main thread: a KeyboardInterrupt that spmd's
waits (Python polling loops) and ``time.sleep`` see within milliseconds, so the rank
leaves a collective its peers will never finish.  (Code that blocks in C without
checking signals does not see it; the caller kills such a rank after a grace period.)
The connection ending means the caller is gone: the rank exits at once rather than
linger with nobody to report to.
"""

from __future__ import annotations

import os
import pickle
import random
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import types
from typing import Any, NoReturn

from mpi4py import MPI

from spmd.runtime.world import destroy_process_group, init_process_group
from spmd.spawn.protocol import (
    ADDRESS_VAR,
    HANDSHAKE_TIMEOUT,
    JOB,
    RESULT,
    STOP,
    TOKEN_VAR,
    HandshakeError,
    frame,
    rank_handshake,
    recv_frame,
)

__all__ = ["main"]

# Exit statuses: started by hand rather than by spawn; the caller went away; what listens
# at the address did not prove it is the caller, or never answered.
_NOT_SPAWNED, _CALLER_GONE, _REFUSED = 2, 3, 4
_RETRY_FIRST, _RETRY_MAX = 0.05, 1.0   # seconds between connections the caller closed


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


def _leave(status: int) -> NoReturn:
    """End this rank before it has a job: no exit handlers, as MPI_Finalize would wait
    for the other ranks."""
    os._exit(status)   # the documented way to skip them


def _give_up(message: str) -> NoReturn:
    sys.stderr.write(f"spmd.spawn.child: rank {MPI.COMM_WORLD.Get_rank()} {message}\n")
    sys.stderr.flush()
    _leave(_REFUSED)


def _join_caller() -> tuple[socket.socket, bytes]:
    """The connection to the caller and the JOB's body, once each end has proved it knows
    the token (from the environment, taken out of it with the address: fn and what it
    starts are no part of this job's plumbing)."""
    address, token = os.environ.pop(ADDRESS_VAR, None), os.environ.pop(TOKEN_VAR, None)
    if not address or not token:
        sys.stderr.write(f"spmd.spawn.child: {ADDRESS_VAR} and {TOKEN_VAR} are not set; this "
                         "module is what spmd.spawn's ranks run, not a program of its own\n")
        raise SystemExit(_NOT_SPAWNED)
    host, _, port = address.rpartition(":")
    world = MPI.COMM_WORLD
    hello = {"rank": world.Get_rank(), "size": world.Get_size(), "pid": os.getpid(),
             "host": socket.gethostname()}
    step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID")
    if os.environ.get("SLURM_JOB_ID") and step:  # srun's: the caller cancels it to end the job
        hello["step"] = f"{os.environ['SLURM_JOB_ID']}.{step}"
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    pause = _RETRY_FIRST
    while True:
        try:
            conn = socket.create_connection(
                (host, int(port)), timeout=max(deadline - time.monotonic(), 1e-3))
        except ConnectionRefusedError:
            _leave(_CALLER_GONE)   # nobody listens: the caller has ended the job
        except OSError as exc:
            sys.stderr.write(f"spmd.spawn.child: cannot connect to the caller at {address}: "
                             f"{exc}\n")
            _leave(_CALLER_GONE)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if rank_handshake(conn, token, hello, deadline):
                message = recv_frame(conn, deadline=deadline)
                if message is not None:
                    if message[0] != JOB:
                        _leave(_CALLER_GONE)   # not the job: the caller is ending it
                    conn.settimeout(None)
                    return conn, message[1]
        except HandshakeError as exc:
            _give_up(f"refuses the listener at {address}: {exc}; it was sent nothing but a "
                     "challenge, and nothing it sent was unpickled")
        except TimeoutError:
            _give_up(f"gives up on the caller at {address}: no proof and job from it within "
                     f"{HANDSHAKE_TIMEOUT:.0f} s (with spawn(join=False), join() sends them)")
        except OSError:
            pass   # reset before the job came: as closed
        conn.close()
        if time.monotonic() + pause >= deadline:
            _give_up(f"gives up on the caller at {address}: it closed every connection "
                     f"before sending the job, for {HANDSHAKE_TIMEOUT:.0f} s")
        time.sleep(pause * random.uniform(0.5, 1.0))   # spread out many ranks' retries
        pause = min(2 * pause, _RETRY_MAX)


def main() -> None:
    """Run one spawned rank; every outcome goes back to the caller."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # STOP arrives as SIGINT
    conn, job = _join_caller()
    listener = _Listener(conn)
    listener.start()
    try:
        reply = _run(MPI.COMM_WORLD.Get_rank(), pickle.loads(job), listener)
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
