"""A spawned job while it runs: the caller's side of the ranks' connections, each rank's
result collected in rank order, failures seen as they happen, and every process of the
job ended, whatever ended it.

:func:`~spmd.spawn.spawn` (:mod:`spmd.spawn.parent`) starts the launcher and hands it
here as a :class:`ProcessContext`.  The caller never blocks while the job runs: it waits
on the connections and looks at the launcher every 50 ms.  A rank that raised is
:class:`ProcessRaisedException`, the other ranks are sent STOP; a rank whose connection
ends without a result is :class:`ProcessExitedException`, and so is the launcher ending
before every rank reported.  However it ended, the launcher gets a grace period to
finish, then it and every process below it are killed (an srun's step is cancelled
first); ``join`` returns or raises only once they are gone.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import signal
import socket
import subprocess
import time
import weakref
from typing import Any

from spmd.core.errors import DistError, DistNetworkError, DistTimeoutError
from spmd.core.timeouts import to_seconds
from spmd.spawn.launcher import SRUN, Launcher
from spmd.spawn.listener import Connection, Listener
from spmd.spawn.protocol import HELLO, RESULT, STOP, frame

__all__ = [
    "ProcessContext",
    "ProcessException",
    "ProcessExitedException",
    "ProcessRaisedException",
]

_STOP_GRACE = 3.0    # seconds STOPped ranks get to leave before everything is killed
_EXIT_GRACE = 10.0   # seconds finished ranks get to finalise MPI and exit
_CHECK = 0.05        # seconds between looks at the launcher and the deadline
# The launcher ends every rank within milliseconds of one dying, and a dying process
# closes its files one by one, so its victims' connections can end before its own (7 ms
# before, seen with Intel MPI): after a rank's connection ends, the caller waits for the
# launcher to exit, or this long, before it says which ranks died.
_SETTLE = 0.5
_SRUN_GRACE = 10.0   # seconds srun gets to end a cancelled step before it is killed
_STEP = re.compile(r"[0-9]+(_[0-9]+)?\.[0-9]+")   # a SLURM job step, "123.4"
# With ranks still to connect, the caller gives up once accepting connections has failed
# (out of descriptors, with none of its own to free) this long.
_ACCEPT_GIVE_UP = 30.0
_DRAIN = 1.0         # seconds at most reading what the ranks sent, once the launcher exits


class ProcessException(DistError):
    """A spawned rank failed; ``error_index`` is its rank, ``pid`` its process id."""

    def __init__(self, msg: str, error_index: int, pid: int | None):
        super().__init__(msg)
        self.msg, self.error_index, self.pid = msg, error_index, pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid)


class ProcessRaisedException(ProcessException):
    """``fn`` raised in a spawned rank; the message carries the rank's traceback."""

    def __init__(self, msg: str, error_index: int, pid: int | None, error_type: str = ""):
        super().__init__(msg, error_index, pid)
        self.error_type = error_type

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.pid, self.error_type)


class ProcessExitedException(ProcessException):
    """A spawned rank's process ended without reporting (killed, crashed, exited)."""


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None if it is gone or a
    zombie; with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc (none where there is no /proc).

    Hydra puts each of its processes in a session of its own, so the launcher's process
    group does not hold its ranks: the process tree does."""
    parents: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            parents[int(name)] = int(fields[1])
    found: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# Jobs not joined when the interpreter exits are ended then, not left running.
_running: weakref.WeakSet[ProcessContext] = weakref.WeakSet()


@atexit.register
def _end_running_jobs() -> None:
    for ctx in list(_running):
        ctx._end(RuntimeError("spawn: the interpreter exited before the job was joined"))


class ProcessContext:
    """A running spawned job: ``join(timeout)`` until done; results in rank order.

    Returned by ``spawn(..., join=False)``; ``spawn(..., join=True)`` joins it for you.
    """

    def __init__(self, launcher: subprocess.Popen, kind: Launcher, listener: Listener,
                 job: bytes, nprocs: int, deadline: float | None):
        self.nprocs = nprocs
        self._launcher, self._launcher_path, self._kind = launcher, kind.path, kind
        self._listener, self._job = listener, job
        self._deadline = deadline
        self._ranks: dict[int, Connection] = {}
        self._pids: dict[int, int] = {}
        self._starts: dict[int, int] = {}   # local ranks' process start times
        self._steps: set[str] = set()       # srun's job step ("job.step"), from the ranks
        self._values: dict[int, Any] = {}
        self._replied: set[int] = set()
        self._dead: list[int] = []          # ranks whose connection ended without a
        self._dead_since = 0.0              # result, in that order; when the first did
        self._failure: BaseException | None = None
        self._finished = False
        self._host = socket.gethostname()
        _running.add(self)

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
            ProcessRaisedException: ``fn`` raised on a rank (the first failing rank is
                named, with its traceback); every rank has been ended.
            ProcessExitedException: a rank's process died, or the launcher ended first.
            spmd.DistTimeoutError: the job's ``timeout`` (given to spawn) passed.
            spmd.DistNetworkError: ranks could not connect: accepting their connections
                failed (this process out of descriptors) for 30 s on end.
            RuntimeError: the launcher's processes are not one MPI job (it is not the
                launcher of the MPI library mpi4py uses).
            KeyboardInterrupt: it came while waiting; the job has been ended.
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
            self._end(RuntimeError("spawn: the job was ended by a KeyboardInterrupt in the "
                                   "caller"))
            raise
        if not done:
            return False
        if self._failure is not None:
            raise self._failure
        return True

    # -- the engine ----------------------------------------------------------------
    def _poll(self, until: float | None) -> bool:
        """Serve the connections until the job is over (True) or ``until`` passes."""
        while True:
            if self._failure is not None or len(self._replied) == self.nprocs:
                self._end(None)
                return True
            now = time.monotonic()
            if self._deadline is not None and now >= self._deadline:
                missing = [r for r in range(self.nprocs) if r not in self._replied]
                self._end(DistTimeoutError(
                    f"spawn: the job did not finish within its timeout; ranks {missing} were "
                    f"still running and were ended{self._connect_trouble()}"))
                return True
            if self._launcher.poll() is not None:
                # Whatever the ranks sent before they ended has arrived: read it first.
                drain = now + _DRAIN
                while self._serve(0) and time.monotonic() < drain:
                    pass
                if self._failure is None and len(self._replied) < self.nprocs:
                    self._fail(self._died() if self._dead else self._launcher_ended())
                continue
            if self._dead and now >= self._dead_since + _SETTLE:
                self._fail(self._died())
                continue
            trouble = self._listener.trouble()
            if trouble is not None and now - trouble[0] >= _ACCEPT_GIVE_UP \
                    and len(self._ranks) < self.nprocs:
                missing = [r for r in range(self.nprocs) if r not in self._ranks]
                self._fail(DistNetworkError(
                    f"spawn: ranks {missing} of {self.nprocs} could not connect to this "
                    f"process: accepting connections has failed for {now - trouble[0]:.0f} s: "
                    f"{trouble[1]}; the launcher ({self._launcher_path}) was ended"))
                continue
            if until is not None and now >= until:
                return False
            wait = _CHECK
            for limit in (until, self._deadline):
                if limit is not None:
                    wait = min(wait, max(limit - now, 0.0))
            self._serve(wait)

    def _serve(self, wait: float) -> int:
        """Accept, read and write what is ready within ``wait`` seconds; the events."""
        events, arrivals = self._listener.serve(wait, admit=self._failure is None)
        for conn, frames in arrivals:
            if frames is None:
                self._lost(conn)
                continue
            for kind, body in frames:
                self._handle(conn, kind, body)
        return events

    def _handle(self, conn: Connection, kind: int, body: bytes) -> None:
        if conn.rank is None:
            if kind == HELLO and conn.hello is not None:
                self._hello(conn, conn.hello)
            else:
                self._listener.close(conn)
        elif kind == RESULT and conn.rank not in self._replied:
            self._replied.add(conn.rank)
            self._reply(conn.rank, body)

    def _hello(self, conn: Connection, hello: dict) -> None:
        """A connection that proved it knows the token says which rank it is: the job's
        rank, or one to drop (a rank already taken, or the job is ending)."""
        if self._failure is not None:
            self._listener.close(conn)   # the job is ending: a rank that comes late gets no job
            return
        step = hello.get("step")
        if self._kind.kind == SRUN and isinstance(step, str) and _STEP.fullmatch(step):
            self._steps.add(step)
        if hello.get("size") != self.nprocs:
            # Each process initialised an MPI of its own (a world of 1): the launcher
            # speaks another process-management protocol than mpi4py's MPI library.
            if self._kind.kind == SRUN:
                why = (f"srun's PMI plugin (--mpi={self._kind.mpi or 'its default'}) is not "
                       "one the MPI library mpi4py uses speaks; set SLURM_MPI_TYPE to one it "
                       "does (srun --mpi=list), or SPMD_MPIEXEC to that library's mpiexec to "
                       "run the ranks on this host")
            else:
                why = ("it is not the launcher of the MPI library mpi4py uses; set "
                       "SPMD_MPIEXEC to that library's mpiexec")
            self._fail(RuntimeError(
                f"spawn: {self._launcher_path} started processes that MPI made ranks of a "
                f"world of {hello.get('size')}, not {self.nprocs}: {why}"))
            self._listener.close(conn)
            return
        rank, pid, host = hello.get("rank"), hello.get("pid"), hello.get("host")
        if not isinstance(rank, int) or not 0 <= rank < self.nprocs or rank in self._ranks \
                or not isinstance(pid, int):
            self._listener.close(conn)
            return
        conn.rank = rank
        self._ranks[rank] = conn
        self._pids[rank] = pid
        if host == self._host:
            start = _process_start(pid)
            if start is not None:
                self._starts[rank] = start
        self._listener.send(conn, self._job)

    def _reply(self, rank: int, body: bytes) -> None:
        try:
            data = pickle.loads(body)
            value = pickle.loads(data[1]) if data[0] == "ok" else None
        except Exception as exc:  # noqa: BLE001 - whatever unpickling raises is reported
            self._fail(ProcessRaisedException(
                f"spawn: the value returned by rank {rank} cannot be unpickled here: "
                f"{type(exc).__name__}: {exc}", rank, self._pids.get(rank)))
            return
        if data[0] == "ok":
            self._values[rank] = value
        elif data[0] == "error":
            _, type_name, message, text = data
            self._fail(ProcessRaisedException(
                f"spawn: rank {rank} of {self.nprocs} (pid {self._pids.get(rank)}) raised "
                f"{type_name}: {message}\n\n-- traceback of rank {rank} --\n{text}",
                rank, self._pids.get(rank), type_name))

    def _lost(self, conn: Connection) -> None:
        """A connection ended: a rank without a result died."""
        if conn.rank is not None and conn.rank not in self._replied:
            if not self._dead:
                self._dead_since = time.monotonic()
            self._dead.append(conn.rank)

    def _fail(self, exc: BaseException) -> None:
        # The first failure is the cause; ranks that fail after it were usually its victims.
        if self._failure is None:
            self._failure = exc

    def _died(self) -> ProcessExitedException:
        dead, first = sorted(self._dead), self._dead[0]
        pid = self._pids.get(first)
        if len(dead) == 1:
            return ProcessExitedException(
                f"spawn: rank {first} of {self.nprocs} (pid {pid}) died without reporting "
                "(killed by a signal or crashed); the other ranks were ended", first, pid)
        return ProcessExitedException(
            f"spawn: ranks {dead} of {self.nprocs} (pids {[self._pids.get(r) for r in dead]}) "
            "died without reporting: one was killed by a signal or crashed, and the launcher "
            f"then ended the others (rank {first}'s connection ended first)", first, pid)

    def _launcher_ended(self) -> ProcessExitedException:
        code = self._launcher.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        missing = [r for r in range(self.nprocs) if r not in self._replied]
        hint = ""
        if self._kind.kind == SRUN and not self._pids:
            hint = ("; srun runs the ranks in this SLURM allocation: a PMI plugin it lacks "
                    f"(--mpi={self._kind.mpi or 'its default'}, see srun --mpi=list; SLURM_MPI_TYPE picks "
                    "another) or more ranks than the allocation has stop it there, and "
                    "SPMD_MPIEXEC set to the MPI library's mpiexec runs them on this host instead")
        return ProcessExitedException(
            f"spawn: the launcher ({self._launcher_path}) {how} before ranks {missing} of "
            f"{self.nprocs} reported (its messages, if any, are on this process's stderr)"
            f"{hint}{self._connect_trouble()}", missing[0], self._pids.get(missing[0]))

    def _connect_trouble(self) -> str:
        """Why ranks may not have connected, for an error message: '' when nothing says."""
        trouble = self._listener.trouble()
        if trouble is None or len(self._ranks) == self.nprocs:
            return ""
        return (f"; accepting the ranks' connections has failed for the last "
                f"{time.monotonic() - trouble[0]:.0f} s: {trouble[1]}")

    def _end(self, failure: BaseException | None) -> None:
        """Finish: STOP the ranks still running, give the launcher its grace, then make
        sure no process of the job is left, whatever interrupts this."""
        if self._finished:
            return
        if failure is not None:
            self._fail(failure)
        try:
            grace = _EXIT_GRACE
            if self._failure is not None:
                grace = _STOP_GRACE
                self._stop_ranks()
            limit = time.monotonic() + grace
            while self._launcher.poll() is None and time.monotonic() < limit:
                self._serve(0.02)   # keeps reading, so no rank blocks on a full socket
        finally:
            # Connections first: a rank still waiting for its job then leaves by itself,
            # and their descriptors are free for what ending the rest needs (/proc, scancel).
            self._listener.close_all()
            self._kill_leftovers()
            self._finished = True
            _running.discard(self)

    def _stop_ranks(self) -> None:
        """STOP every rank that has its job and no result; a rank still receiving its job
        is cut off instead (it exits when its connection ends)."""
        stop = frame(STOP)
        for rank, conn in self._ranks.items():
            if rank in self._replied or conn.closed:
                continue
            if not conn.outbox:
                try:
                    if conn.sock.send(stop) == len(stop):
                        continue
                except OSError:
                    pass
            self._listener.close(conn)

    def _kill_leftovers(self) -> None:
        """Kill the launcher and every process below it, and any rank of this host that
        outlived them; reap the launcher.  srun's ranks may be on other hosts: its step is
        cancelled first (SIGKILL to every rank, by SLURM), or, where no rank said which
        step it is, srun is asked to end it (SIGTERM, which it passes to every rank)."""
        if self._kind.kind == SRUN and self._launcher.poll() is None:
            cancelled = False
            if self._steps:
                try:
                    subprocess.run(["scancel", "--quiet", *sorted(self._steps)], check=False,
                                   stdin=subprocess.DEVNULL, timeout=30)
                    cancelled = True
                except (OSError, subprocess.SubprocessError):
                    pass   # no scancel to run (or no descriptor to run it): srun ends it
            if not cancelled:
                self._launcher.terminate()
            try:
                self._launcher.wait(_SRUN_GRACE)   # srun exits once its step has ended
            except subprocess.TimeoutExpired:
                pass
        if self._launcher.poll() is None:
            for pid in [self._launcher.pid, *_descendants(self._launcher.pid)]:
                _kill(pid)
        ranks = [(pid, self._starts[r]) for r, pid in self._pids.items() if r in self._starts]
        for pid, start in ranks:
            if _process_start(pid) == start:
                _kill(pid)
        self._launcher.wait()
        limit = time.monotonic() + 5.0
        while any(_process_start(pid) == start for pid, start in ranks) \
                and time.monotonic() < limit:
            time.sleep(0.01)
