"""Start an SPMD job from plain Python or a notebook: ``spmd.spawn(fn, args, nprocs)``.

torch.multiprocessing.spawn's interface on MPI's dynamic processes.  The calling
process (a singleton: ``python``, ``ipython``, Jupyter) starts ``nprocs`` interpreters
with ``MPI.COMM_SELF.Spawn``; they share their own ``MPI.COMM_WORLD``, so in each of
them ``spmd.init_process_group()`` makes the children alone WORLD (ranks ``0..nprocs-1``)
and every spmd API works inside ``fn``.  The parent is not a member: it sends the
pickled ``(fn, args)`` over the intercommunicator, then collects each rank's return
value (or its exception's traceback text) and returns the values in rank order.

Choices, and why:

- **Pickling**: cloudpickle when it is installed (lambdas, closures, functions defined
  in a notebook or in ``__main__`` travel by value); plain pickle otherwise, where a
  function defined in the ``__main__`` of a script is found by running that script in
  each child as ``__mp_main__`` (as multiprocessing's spawn start method does, so the
  script needs its ``if __name__ == "__main__":`` guard).  A function defined in an
  interactive session without cloudpickle is refused before anything starts.
- **Launcher**: MPICH's singleton ``MPI_Comm_spawn`` runs ``mpiexec`` (Hydra) from
  ``PATH`` the first time a process spawns.  spmd finds the Hydra of the MPI library in
  use (``$SPMD_MPIEXEC``, next to ``sys.executable``, ``sys.prefix/bin``, next to the
  loaded ``libmpi``, then ``PATH``) and hands MPICH a private ``mpiexec`` that starts it
  in its own process group: Hydra ends a job whose process died of a signal by
  signalling the process group of every process it knows, the singleton included, and
  the parent (your notebook kernel) must survive that.  No Hydra found: RuntimeError
  saying what to install or set.  PATH is read at the first spawn, not at MPI_Init.
- **Environment**: ``env`` is applied in each child before MPI is initialised there,
  through a job file the parent writes into a private (0700) directory; the children
  also get the parent's ``sys.path`` and working directory.
- **Faults**: the parent never blocks in MPI while children run: it polls with
  ``Improbe`` and checks every 0.1 s that each child's process (pid reported at start)
  and the process manager are alive.  An exception in a child comes back as
  :class:`ProcessRaisedException` naming the rank, with the child's traceback text;
  the other ranks are sent STOP (a KeyboardInterrupt inside spmd's polling waits), and
  any still running after a grace period are killed.  A child that dies (SIGKILL, the
  OOM killer) is reported as :class:`ProcessExitedException` within a fraction of a
  second.  ``timeout`` bounds the whole job (:class:`spmd.DistTimeoutError`).
- **After a killed child** Hydra has ended the process manager of the parent, and MPI
  cannot start one again in this process: later spawns raise RuntimeError asking to
  restart the interpreter (kernel).  Exceptions and timeouts whose ranks stop when
  asked do not cost that.
- **Inside an mpiexec/srun job** of more than one rank, spawn refuses (RuntimeError):
  the ranks already are the SPMD job, call ``fn`` directly.  A job of one rank spawns
  through its launcher's process manager.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spmd.core.errors import DistError, DistTimeoutError
from spmd.core.launch import SINGLETON, find_hydra, launch_info
from spmd.core.timeouts import to_seconds
from spmd.spawn.protocol import BOOT, HELLO, PAYLOAD, RESULT, STOP

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
    "spawn",
]

# Each child runs ``python BOOTFILE JOBFILE`` (BOOTFILE holds this text, in the private
# directory; Hydra's spawn command cannot carry newlines): the job's environment and
# sys.path are in place before mpi4py initialises MPI (which completes the parent's
# spawn), and the rank reports its pid before the slower import of spmd, so the parent
# can watch it from the start.
_GRACE = 3.0      # seconds STOPped ranks get to leave before they are killed
_CHECK = 0.1      # seconds between liveness checks
# A rank sends its result and exits at once: MPI completes a small send before it is
# delivered, so the result can still be on its way when the process is gone.  A rank
# found dead without a result gets this long for it to arrive before it counts as dead.
_LATE_RESULT = 1.0


class ProcessException(DistError):
    """A spawned rank failed; ``error_index`` is its rank, ``pid`` its process id."""

    def __init__(self, msg: str, error_index: int, pid: int | None):
        super().__init__(msg)
        self.msg, self.error_index, self.pid = msg, error_index, pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """``fn`` raised in a spawned rank; the message carries the child's traceback."""

    def __init__(self, msg: str, error_index: int, pid: int | None, error_type: str = ""):
        super().__init__(msg, error_index, pid)
        self.error_type = error_type

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid, self.error_type)


class ProcessExitedException(ProcessException):
    """A spawned rank's process ended without reporting (killed, crashed, exited)."""


class _Launcher:
    """The process manager that serves this process's spawns (one per process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.dir: str | None = None        # private directory: wrapper, pid file, job files
        self.prepared = False
        self.pm_pid: int | None = None     # Hydra's pid once it runs
        self.dead: str | None = None       # why no further spawn can work
        self.jobs = 0

    def private_dir(self) -> str:
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="spmd-spawn-")  # 0700
            atexit.register(shutil.rmtree, self.dir, True)
        return self.dir

    def boot_file(self) -> str:
        path = os.path.join(self.private_dir(), "spmd_spawn_boot.py")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(BOOT)
        return path

    def prepare(self) -> None:
        """Make sure MPICH's singleton init finds a Hydra that runs in its own group."""
        if self.prepared:
            return
        from mpi4py import MPI  # (called by spawn, which started MPI)

        if launch_info().launcher == SINGLETON and "MPICH" in MPI.Get_library_version():
            real = find_hydra()
            d = self.private_dir()
            wrapper = os.path.join(d, "mpiexec")
            code = ("import os, sys; os.setpgid(0, 0); "
                    "open(sys.argv[1], 'w').write(str(os.getpid())); "
                    "os.execv(sys.argv[2], sys.argv[2:])")
            with open(wrapper, "w") as f:
                f.write("#!/bin/sh\n# Hydra for spmd.spawn, in its own process group\n"
                        f"exec {shlex.quote(sys.executable)} -S -c {shlex.quote(code)} "
                        f"{shlex.quote(os.path.join(d, 'hydra.pid'))} {shlex.quote(real)} "
                        '"$@"\n')
            os.chmod(wrapper, 0o700)
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
        self.prepared = True

    def after_spawn(self) -> None:
        if self.pm_pid is None and self.dir is not None:
            try:
                with open(os.path.join(self.dir, "hydra.pid")) as f:
                    self.pm_pid = int(f.read().strip() or 0) or None
            except (OSError, ValueError):
                return
            # MPICH reads PATH once, at the first spawn; give the user theirs back.
            parts = os.environ.get("PATH", "").split(os.pathsep)
            if parts and parts[0] == self.dir:
                os.environ["PATH"] = os.pathsep.join(parts[1:])

    def pm_alive(self) -> bool:
        """False once Hydra has exited (it is this process's child: reap it)."""
        if self.pm_pid is None:
            return True
        try:
            pid, _ = os.waitpid(self.pm_pid, os.WNOHANG)
        except ChildProcessError:
            return _alive(self.pm_pid)
        return pid == 0


_launcher = _Launcher()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc; kill(0) elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _serialize(fn: Callable, args: tuple) -> tuple[bytes, str | None]:
    """Pickle ``(fn, args)``; the path of the main script children must load, if any."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    if cloudpickle is not None:
        try:
            return cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL), None
        except Exception as exc:
            raise TypeError(f"spawn: cannot pickle fn={fn!r} and its args with cloudpickle: "
                            f"{type(exc).__name__}: {exc}") from exc
    if getattr(fn, "__module__", None) == "__main__" and not main_file:
        raise TypeError(f"spawn: fn={getattr(fn, '__qualname__', fn)!r} is defined in an "
                        "interactive session, which plain pickle cannot send to other "
                        "processes; pip install cloudpickle (spmd uses it when installed), "
                        "or define fn in a module")
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"spawn: cannot pickle fn={fn!r} and its args: {type(exc).__name__}: "
                        f"{exc} (lambdas and local functions need cloudpickle: pip install "
                        "cloudpickle)") from exc
    return payload, os.path.abspath(main_file) if main_file and b"__main__" in payload else None


def singleton_spawn_problem(launcher: str, vendor: tuple[str, tuple[int, ...]]) -> str | None:
    """Why this MPI cannot spawn from a process no launcher started, or None.

    Open MPI 5's MPI_Comm_spawn from a singleton fails inside the library ("OPAL ERROR:
    Error in file ompi/dpm/dpm.c", open-mpi/ompi#12349 and #12916; mpi4py's own tests skip
    it); under ``mpiexec -n 1`` it works."""
    name, version = vendor
    if launcher == SINGLETON and name == "Open MPI" and version[:1] >= (5,):
        return (f"Open MPI {'.'.join(map(str, version))} cannot spawn from a process that "
                "mpiexec did not start (its singleton MPI_Comm_spawn fails upstream, "
                "open-mpi/ompi#12349); start this interpreter with `mpiexec -n 1 python ...`, "
                "or use MPICH (pip install 'spmd[mpich]')")
    return None


class ProcessContext:
    """A running spawned job: ``join(timeout)`` until done; results in rank order.

    Returned by ``spawn(..., join=False)``; ``spawn(..., join=True)`` joins it for you.
    """

    def __init__(self, comm: Any, nprocs: int, deadline: float | None,
                 job_file: str | None):
        self._comm: MPI.Intercomm | None = comm  # None once the job has ended
        self.nprocs, self._deadline = nprocs, deadline
        self._job_file = job_file
        self._pids: dict[int, int] = {}
        self._hosts: dict[int, str] = {}
        self._values: dict[int, Any] = {}
        self._replied: set[int] = set()
        self._failure: BaseException | None = None
        self._finished = False
        self._next_check = 0.0
        self._host = socket.gethostname()
        self._sends: list[MPI.Request] = []  # keep the payload buffers alive until sent

    # -- public ------------------------------------------------------------------
    @property
    def results(self) -> list:
        """Each rank's return value, in rank order.

        Raises:
            RuntimeError: the job has not finished successfully (call ``join`` first).
        """
        if not self._finished or self._failure is not None:
            raise RuntimeError("ProcessContext.results: the job has not finished successfully; "
                               "join() it first")
        return [self._values[r] for r in range(self.nprocs)]

    def pids(self) -> list[int | None]:
        """The process id of each rank (None for a rank that has not reported yet)."""
        return [self._pids.get(r) for r in range(self.nprocs)]

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (forever if None) for the job to finish.

        Returns:
            True when every rank has finished and its processes are gone, False when
            ``timeout`` passed first (call again to keep waiting).

        Raises:
            ProcessRaisedException: ``fn`` raised on a rank (the lowest failing rank is
                named, with its traceback); every rank has been ended.
            ProcessExitedException: a rank's process died.
            spmd.DistTimeoutError: the job's ``timeout`` (given to spawn) passed.
        """
        if self._finished:
            if self._failure is not None:
                raise self._failure
            return True
        until = None if timeout is None else \
            time.monotonic() + to_seconds(timeout, "ProcessContext.join", positive=True)
        try:
            done = self._poll(until)
        except KeyboardInterrupt:
            self._end(None)
            raise
        if not done:
            return False
        if self._failure is not None:
            raise self._failure
        return True

    # -- the engine ----------------------------------------------------------------
    def _poll(self, until: float | None) -> bool:
        delay = 0.0005
        while True:
            if self._drain():
                delay = 0.0005
            if self._failure is None and len(self._replied) == self.nprocs:
                self._end(None)
                return True
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _CHECK
                problem = self._check(now)
                if problem is not None:
                    self._end(problem)
                    return True
            if self._failure is not None:
                self._end(self._failure)
                return True
            if until is not None and now >= until:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _drain(self) -> bool:
        """Handle every message that has arrived; True if there was one."""
        from mpi4py import MPI  # (the job runs: MPI started when it was spawned)

        comm = self._comm
        assert comm is not None  # messages are drained only until the job ends
        got = False
        while True:
            msg = comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG,
                               status=(status := MPI.Status()))
            if msg is None:
                return got
            got = True
            rank, tag = status.Get_source(), status.Get_tag()
            data = msg.recv()
            if tag == HELLO:
                _, pid, host = data
                self._pids[rank], self._hosts[rank] = pid, host
            elif tag == RESULT:
                self._replied.add(rank)
                self._reply(rank, data)

    def _reply(self, rank: int, data: tuple) -> None:
        kind = data[0]
        if kind == "ok":
            try:
                self._values[rank] = pickle.loads(data[1])
            except Exception as exc:  # noqa: BLE001 - whatever unpickling raises is reported
                self._fail(ProcessRaisedException(
                    f"spawn: the value returned by rank {rank} cannot be unpickled here: "
                    f"{type(exc).__name__}: {exc}", rank, self._pids.get(rank)))
        elif kind == "error":
            _, type_name, message, text = data
            self._fail(ProcessRaisedException(
                f"spawn: rank {rank} of {self.nprocs} (pid {self._pids.get(rank)}) raised "
                f"{type_name}: {message}\n\n-- traceback of rank {rank} --\n{text}",
                rank, self._pids.get(rank), type_name))

    def _fail(self, exc: BaseException) -> None:
        # The first failure is the cause; ranks that fail after it were usually its victims.
        if self._failure is None:
            self._failure = exc

    def _dead_silent(self) -> list[int]:
        """Ranks on this host whose process is gone and whose result has not arrived."""
        return [r for r, pid in sorted(self._pids.items()) if r not in self._replied
                and self._hosts.get(r) == self._host and not _alive(pid)]

    def _check(self, now: float) -> BaseException | None:
        dead = self._dead_silent()
        limit = now + _LATE_RESULT
        while dead and time.monotonic() < limit:
            if not self._drain():
                time.sleep(0.01)
            dead = [r for r in dead if r not in self._replied]
        if len(dead) == 1:
            rank, pid = dead[0], self._pids[dead[0]]
            return ProcessExitedException(
                f"spawn: rank {rank} of {self.nprocs} (pid {pid}) died without reporting "
                "(killed by a signal or crashed); the other ranks were ended", rank, pid)
        if dead:
            # Hydra kills every rank within milliseconds of one dying of a signal, so
            # which one went first cannot be told from here.
            return ProcessExitedException(
                f"spawn: ranks {dead} of {self.nprocs} (pids {[self._pids[r] for r in dead]}) "
                "died without reporting: one was killed by a signal or crashed, and MPI's "
                "process manager then ended the others", dead[0], self._pids[dead[0]])
        if not _launcher.pm_alive():
            missing = [r for r in range(self.nprocs) if r not in self._replied]
            rank = missing[0] if missing else 0
            return ProcessExitedException(
                f"spawn: the MPI process manager ended while ranks {missing} were running "
                "(a spawned process died of a signal); the other ranks were ended",
                rank, self._pids.get(rank))
        if self._deadline is not None and now >= self._deadline:
            missing = [r for r in range(self.nprocs) if r not in self._replied]
            return DistTimeoutError(
                f"spawn: the job did not finish within its timeout; ranks {missing} were still "
                "running and were ended")
        return None

    def _end(self, failure: BaseException | None) -> None:
        """Finish: STOP the ranks still running, disconnect, make sure none is left."""
        if failure is not None:
            self._fail(failure)
        comm = self._comm
        assert comm is not None  # the job ends once
        live = [r for r in range(self.nprocs) if r not in self._replied]
        requests = [comm.isend(None, dest=r, tag=STOP) for r in live]
        # STOPped ranks reply "stopped" and disconnect, as finished ranks do.
        limit = time.monotonic() + _GRACE
        while len(self._replied) < self.nprocs and time.monotonic() < limit \
                and _launcher.pm_alive() and all(
                    _alive(self._pids[r]) for r in live
                    if r in self._pids and r not in self._replied):
            if not self._drain():
                time.sleep(0.005)
        clean = len(self._replied) == self.nprocs and _launcher.pm_alive()
        if clean:
            clean = _disconnect(comm, _GRACE)
        if not clean:
            for req in requests + self._sends:
                if not req.Test():
                    req.Cancel()
            comm.Free()  # local; Disconnect would wait for ranks that are gone
        self._comm, self._sends = None, []
        self._reap(_GRACE if clean else 0.0)
        if self._job_file:
            try:
                os.unlink(self._job_file)
            except OSError:
                pass
        if not _launcher.pm_alive() and _launcher.dead is None:
            _launcher.dead = ("the MPI process manager of this process ended when a spawned "
                              "process died of a signal, and MPI cannot start a new one in "
                              "this process: restart the interpreter (in Jupyter: restart the "
                              "kernel)")
        self._finished = True

    def _reap(self, grace: float) -> None:
        """Wait ``grace`` seconds for the ranks' processes to exit, then kill what is left."""
        limit = time.monotonic() + grace
        local = [p for r, p in self._pids.items() if self._hosts.get(r) == self._host]
        while any(_alive(p) for p in local) and time.monotonic() < limit:
            time.sleep(0.005)
        for pid in local:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        limit = time.monotonic() + 5.0
        while any(_alive(p) for p in local) and time.monotonic() < limit:
            time.sleep(0.01)


def _disconnect(comm: MPI.Intercomm, seconds: float) -> bool:
    """``comm.Disconnect()`` (collective with the children) unless it takes too long."""
    box: list[BaseException | None] = []

    def run():
        try:
            comm.Disconnect()
            box.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            box.append(exc)

    thread = threading.Thread(target=run, name="spmd-spawn-disconnect", daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(box) and box[0] is None


def spawn(fn: Callable[..., Any], args: Sequence = (), nprocs: int = 1, join: bool = True,
          *, timeout: float | None = None,
          env: Mapping[str, str] | None = None) -> list | ProcessContext:
    """Run ``fn(rank, *args)`` on ``nprocs`` new MPI processes that form spmd's WORLD.

    Call it from a single process (``python``, ``ipython``, Jupyter): no launcher needed.
    In each child spmd is initialised before ``fn`` runs and destroyed after.

    Args:
        fn: the function; it gets the rank (0..nprocs-1) and ``*args``.  Must be
            picklable (any function with cloudpickle installed; else one defined in a
            module or in the ``__main__`` of a script guarded by ``if __name__ ==
            "__main__":``).
        args: extra positional arguments (pickled).
        nprocs: number of ranks.
        join: wait for the job and return the results (True) or return a
            :class:`ProcessContext` at once (False).
        timeout: seconds (or a timedelta) the whole job may take, spawning included.
        env: extra environment variables for the children, applied before MPI starts
            in them.

    Returns:
        Each rank's return value in rank order, or the ProcessContext with ``join=False``.

    Raises:
        TypeError, ValueError: bad arguments, or ``fn`` cannot be pickled (before any
            process starts).
        RuntimeError: called inside a multi-rank MPI job, no Hydra for MPICH's singleton
            spawn, or the process manager of this process is gone after a killed child.
        ProcessRaisedException, ProcessExitedException, spmd.DistTimeoutError: see
            :meth:`ProcessContext.join`.
    """
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"spawn: args must be a tuple, got {type(args).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    seconds = None if timeout is None else to_seconds(timeout, "spawn", positive=True)
    child_env = {"SPMD_ABORT_ON_EXCEPTION": "0"}  # failures go back to the parent instead
    if env is not None:
        if not isinstance(env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError(f"spawn: env must map str to str, got {env!r}")
        child_env.update(env)
    from mpi4py import MPI  # spawning starts MPI in this process; importing spmd does not

    size = MPI.COMM_WORLD.Get_size()
    if size > 1:
        raise RuntimeError(
            f"spawn: this process is rank {MPI.COMM_WORLD.Get_rank()} of an MPI job of {size} "
            "ranks (started by mpiexec/srun), which already is an SPMD job: call fn on every "
            "rank instead; spawn starts a job from a single process (python, ipython, Jupyter)")
    if _launcher.dead is not None:
        raise RuntimeError(f"spawn: {_launcher.dead}")
    problem = singleton_spawn_problem(launch_info().launcher, MPI.get_vendor())
    if problem is not None:
        raise RuntimeError(f"spawn: {problem}")
    payload, main_file = _serialize(fn, tuple(args))
    start = time.monotonic()
    with _launcher.lock:
        _launcher.prepare()
        _launcher.jobs += 1
        job_file = os.path.join(_launcher.private_dir(), f"job-{_launcher.jobs}.json")
        boot_file = _launcher.boot_file()
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        job = {"env": child_env, "path": [p for p in sys.path], "cwd": os.getcwd(),
               "main": main_file, "main_file": script and os.path.abspath(script),
               "parent_pid": os.getpid()}
        fd = os.open(job_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(job, f)
        errcodes: list[int] = []
        comm = MPI.COMM_SELF.Spawn(sys.executable, [boot_file, job_file], maxprocs=nprocs,
                                   errcodes=errcodes)
        _launcher.after_spawn()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    ctx = ProcessContext(comm, nprocs, None if seconds is None else start + seconds, job_file)
    bad = [r for r, code in enumerate(errcodes) if code != MPI.SUCCESS]
    if bad:
        ctx._end(ProcessExitedException(f"spawn: MPI could not start ranks {bad}", bad[0], None))
        ctx.join()
    ctx._sends = [comm.isend(payload, dest=r, tag=PAYLOAD) for r in range(nprocs)]
    if not join:
        return ctx
    ctx.join()
    return ctx.results
