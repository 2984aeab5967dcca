"""Start an SPMD job from plain Python or a notebook: ``spmd.spawn(fn, args, nprocs)``.

torch.multiprocessing.spawn's interface, on the MPI library's own launcher.  The calling
process (``python``, ``ipython``, Jupyter) does not initialise MPI: it runs ``mpiexec -n
nprocs python -m spmd.spawn.child`` as a child process.  Those ranks share their own
``MPI.COMM_WORLD``; in each, spmd is initialised (WORLD is the spawned ranks alone, ranks
``0..nprocs-1``) and ``fn(rank, *args)`` runs (:mod:`spmd.spawn.child`).  The caller is
not a rank: it sends each rank the pickled ``(fn, args)`` over a connection of its own,
collects each rank's return value (or its exception's traceback text), and returns the
values in rank order.

Choices, and why:

- **No MPI in the caller.**  Spawning from the caller as an MPI singleton
  (``MPI_Comm_spawn``) fails in the MPI libraries themselves: Open MPI 5's singleton spawn
  is broken upstream (open-mpi/ompi#12349), Intel MPI's segfaults, and MPICH runs its
  process manager inside the caller, so one killed rank ended spawning for the life of
  the interpreter (a notebook kernel).  Starting the launcher is what every MPI program
  does, and whatever happens to the job, the caller is untouched and the next spawn
  starts afresh.  The caller never imports ``mpi4py.MPI``.
- **Launcher**: the mpiexec of the MPI library the ranks load, with the flags it needs,
  on this host; inside a SLURM allocation ``srun``, which runs the ranks on the
  allocation's nodes (:mod:`spmd.spawn.launcher`); none found is a RuntimeError saying
  what to install or set.  It runs in a session of its own: a Ctrl-C at the caller's
  terminal does not reach it (the caller stops the ranks itself), and ending it cannot
  signal the caller.
- **Channel**: a TCP socket the caller listens on, at 127.0.0.1 when the ranks run on
  this host, at the caller's own address on the network the allocation's nodes reach it
  on when srun may place them on other nodes (:func:`~spmd.spawn.launcher.caller_host`);
  an ephemeral port; its address and a random 128-bit token in the ranks' environment.
  Each end proves it knows the token before the other sends it anything but a challenge
  or unpickles anything from it (:mod:`spmd.spawn.protocol`); a connection that has not
  proved it within seconds is dropped, and so are the oldest such when too many wait or
  descriptors run out (:mod:`spmd.spawn.listener`).  Not MPI (the caller has none) and
  not a TCPStore (a store answers requests; it cannot tell the caller a rank is gone): a
  rank's connection ends the moment its process does, which is how the caller learns of
  a killed rank at once, on any host, without polling process ids.
- **Pickling**: cloudpickle when it is installed (lambdas, closures, functions defined in
  a notebook or in ``__main__`` travel by value); plain pickle otherwise, where a
  function defined in the ``__main__`` of a script is found by running that script in
  each rank as ``__mp_main__`` (as multiprocessing's spawn start method does, so the
  script needs its ``if __name__ == "__main__":`` guard).  A function defined in an
  interactive session without cloudpickle is refused before anything starts.
- **Environment**: the ranks start with the caller's environment (less the variables of
  an MPI job or SLURM allocation the caller is in: the ranks are a job of their own),
  ``env`` on top, so it is in place before MPI initialises there; the caller's working
  directory; with the job, the caller's ``sys.path``.
- **Faults** (:mod:`spmd.spawn.job`): the caller never blocks while the job runs: it
  waits on the connections and looks at the launcher every 50 ms.  An exception in a
  rank comes back as :class:`~spmd.spawn.ProcessRaisedException` naming the rank, with
  its traceback text, and the other ranks are sent STOP (a KeyboardInterrupt inside
  spmd's polling waits).  A rank that dies (SIGKILL, the OOM killer) is
  :class:`~spmd.spawn.ProcessExitedException` within milliseconds; so is the launcher
  ending before every rank reported.  ``timeout``
  bounds the whole job (:class:`spmd.DistTimeoutError`); a KeyboardInterrupt in the
  caller ends the job too.  However it ended, the launcher gets a grace period to
  finish, then it and every process below it are killed (an srun's step is cancelled
  first, which ends its ranks on every node); ``join`` returns or raises only once they
  are gone, and nothing of the job (process, socket, port) outlives it.
- **Inside an mpiexec/srun job** of more than one rank, spawn refuses (RuntimeError):
  the ranks already are the SPMD job, call ``fn`` directly.  A job of one rank spawns as
  a plain ``python`` does.
"""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from spmd.core.launch import launch_info
from spmd.core.timeouts import to_seconds
from spmd.spawn.job import ProcessContext
from spmd.spawn.launcher import caller_host, find_launcher, launcher_environment
from spmd.spawn.listener import MAX_PENDING, Listener
from spmd.spawn.protocol import ADDRESS_VAR, JOB, TOKEN_VAR, frame

__all__ = ["spawn"]

_CHILD = [sys.executable, "-m", "spmd.spawn.child"]



def _serialize(fn: Callable, args: tuple) -> tuple[bytes, str | None]:
    """Pickle ``(fn, args)``; the path of the main script ranks must load, if any."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file is not None and not os.path.isfile(main_file):
        main_file = None   # ``python - < script.py``: "<stdin>", no file the ranks could run
    try:
        import cloudpickle  # optional; looked up at each spawn, as it may come later
    except ImportError:
        cloudpickle = None
    if cloudpickle is not None:
        try:
            return cloudpickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL), None
        except Exception as exc:
            raise TypeError(f"spawn: cannot pickle fn={fn!r} and its args with cloudpickle: "
                            f"{type(exc).__name__}: {exc}") from exc
    if getattr(fn, "__module__", None) == "__main__" and not main_file:
        raise TypeError(f"spawn: fn={getattr(fn, '__qualname__', fn)!r} is defined in a "
                        "__main__ that has no file (an interactive session, python -c, or a "
                        "script read from stdin as by `python - < script.py`), which plain "
                        "pickle cannot send to other processes: run the script from its "
                        "file (`python script.py`), pip install cloudpickle (spmd uses it "
                        "when installed), or define fn in a module")
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"spawn: cannot pickle fn={fn!r} and its args: {type(exc).__name__}: "
                        f"{exc} (lambdas and local functions need cloudpickle: pip install "
                        "cloudpickle)") from exc
    return payload, os.path.abspath(main_file) if main_file and b"__main__" in payload else None


def spawn(fn: Callable[..., Any], args: Sequence = (), nprocs: int = 1, join: bool = True,
          *, timeout: float | None = None,
          env: Mapping[str, str] | None = None) -> list | ProcessContext:
    """Run ``fn(rank, *args)`` on ``nprocs`` new MPI processes that form spmd's WORLD.

    Call it from a single process (``python``, ``ipython``, Jupyter): it starts the MPI
    library's launcher itself.  In each rank spmd is initialised before ``fn`` runs and
    destroyed after.  The caller does not initialise MPI.

    Args:
        fn: the function; it gets the rank (0..nprocs-1) and ``*args``.  Must be
            picklable (any function with cloudpickle installed; else one defined in a
            module or in the ``__main__`` of a script guarded by ``if __name__ ==
            "__main__":``).
        args: extra positional arguments (pickled).
        nprocs: number of ranks.
        join: wait for the job and return the results (True) or return a
            :class:`~spmd.ProcessContext` at once (False).  The ranks get their job while
            ``join`` runs: they wait for it up to ``protocol.HANDSHAKE_TIMEOUT`` (5
            minutes), then give up.
        timeout: seconds (or a timedelta) the whole job may take, start-up included.
        env: extra environment variables for the ranks, set before MPI starts in them.

    Returns:
        Each rank's return value in rank order, or the ProcessContext with ``join=False``.

    Raises:
        TypeError, ValueError: bad arguments, or ``fn`` cannot be pickled (before any
            process starts).
        RuntimeError: called inside a multi-rank MPI job, no MPI launcher found, or no
            address to listen at (see :func:`~spmd.spawn.launcher.caller_host`).
        ProcessRaisedException, ProcessExitedException, spmd.DistTimeoutError: see
            :meth:`~spmd.ProcessContext.join`.
    """
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"spawn: args must be a tuple, got {type(args).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    seconds = None if timeout is None else to_seconds(timeout, "spawn", positive=True)
    rank_env = {"SPMD_ABORT_ON_EXCEPTION": "0"}  # failures go back to the caller instead
    if env is not None:
        if not isinstance(env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError(f"spawn: env must map str to str, got {env!r}")
        rank_env.update(env)
    info = launch_info()
    if (info.ntasks or 1) > 1:
        raise RuntimeError(
            f"spawn: this process is rank {info.rank} of an MPI job of {info.ntasks} ranks "
            "(started by mpiexec/srun), which already is an SPMD job: call fn on every rank "
            "instead; spawn starts a job from a single process (python, ipython, Jupyter)")
    payload, main_file = _serialize(fn, tuple(args))
    launcher = find_launcher()
    start = time.monotonic()
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    job = frame(JOB, pickle.dumps({"path": list(sys.path), "main": main_file,
                                   "main_file": script and os.path.abspath(script),
                                   "payload": payload}, protocol=pickle.HIGHEST_PROTOCOL))
    host = caller_host(launcher)
    token = secrets.token_hex(16)   # 128 bits
    try:
        # Room for every rank at once, in the backlog and among those not yet proved.
        listener = Listener(host, token, backlog=max(nprocs, 128),
                            max_pending=max(MAX_PENDING, nprocs))
    except OSError as exc:
        raise RuntimeError(f"spawn: cannot listen for the ranks at {host}: {exc}") from exc
    rank_env.update({ADDRESS_VAR: listener.address, TOKEN_VAR: token})
    try:
        process = subprocess.Popen(launcher.command(nprocs, _CHILD),
                                   env=launcher_environment(rank_env, launcher),
                                   cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    except OSError as exc:
        listener.close_all()
        raise RuntimeError(f"spawn: cannot start {launcher.path}: {exc}") from exc
    ctx = ProcessContext(process, launcher, listener, job, nprocs,
                         None if seconds is None else start + seconds)
    if not join:
        return ctx
    ctx.join()
    return ctx.results
