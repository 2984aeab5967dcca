"""spmd.spawn from a plain ``python`` script, as a notebook would use it: the functions
below are defined in ``__main__``.  ``python spawn_jobs.py MODE`` prints one JSON line
per check (``{"check": ..., ...}``) for tests/jobs/test_spawn.py to assert on."""

import json
import os
import signal
import socket
import struct
import sys
import threading
import time

import numpy as np

import spmd
from spmd.spawn import ProcessExitedException, ProcessRaisedException


def emit(**fields):
    print(json.dumps(fields), flush=True)


def descendants() -> list[tuple[int, str]]:
    """Every process below this one (pid, command line), from /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                parents[int(name)] = (int(fields[1]), cmd)
    out, frontier = [], {os.getpid()}
    while frontier:
        kids = [(p, c) for p, (pp, c) in parents.items() if pp in frontier]
        out += kids
        frontier = {p for p, _ in kids}
    return sorted(out)


def workers() -> list[int]:
    """Spawned ranks still running (their command line names spmd.spawn.child)."""
    return [p for p, cmd in descendants() if "spmd.spawn.child" in cmd]


def running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def collectives(rank, seed):
    """What every rank computes; the parent checks it against numpy."""
    n = spmd.get_world_size()
    rng = np.random.default_rng(seed + rank)
    x = rng.standard_normal(5)
    total = x.copy()
    spmd.all_reduce(total)
    gathered = np.empty(5 * n)
    spmd.all_gather_into_tensor(gathered, x)
    b = x.copy() if rank == n - 1 else np.zeros(5)
    spmd.broadcast(b, src=n - 1)
    return {"rank": spmd.get_rank(), "size": n, "x": x, "sum": total, "gathered": gathered,
            "bcast": b}


def refuse(rank):
    raise ValueError(f"bad value on rank {rank}")


def raise_on_one(rank):
    x = np.ones(3)
    if rank == 1:
        refuse(rank)  # through a second function of this script: both frames are named
    spmd.all_reduce(x)  # the others wait here for rank 1, which never comes
    return rank


def kill_one(rank):
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def sleep_long(rank):
    time.sleep(600)


def slow_square(rank, delay):
    time.sleep(delay)
    x = np.array([rank * rank], np.int64)
    spmd.all_reduce(x)
    return int(x[0])


def collectives_match_numpy(n: int, seed: int) -> bool:
    """Spawn ``collectives`` on n ranks; every rank's results equal numpy's."""
    out = spmd.spawn(collectives, args=(seed,), nprocs=n)
    xs = [np.random.default_rng(seed + r).standard_normal(5) for r in range(n)]
    return bool(len(out) == n
                and all(o["rank"] == r and o["size"] == n for r, o in enumerate(out))
                and all(np.array_equal(o["x"], xs[r]) for r, o in enumerate(out))
                and all(np.allclose(o["sum"], np.sum(xs, axis=0), rtol=0, atol=1e-12)
                        for o in out)
                and all(np.array_equal(o["gathered"], np.concatenate(xs)) for o in out)
                and all(np.array_equal(o["bcast"], xs[n - 1]) for o in out))


def mode_sizes():
    for n in (1, 2, 3, 4):
        emit(check="sizes", n=n, ok=collectives_match_numpy(n, 100 * n))
    # The caller never started MPI: it only ran the MPI library's launcher.
    emit(check="left", workers=workers(), descendants=[c for _, c in descendants()],
         mpi_in_caller="mpi4py.MPI" in sys.modules)


def mode_readme():
    def train(rank, lr):
        x = np.full(4, rank, np.float32)
        spmd.all_reduce(x)
        return float(x[0]) * lr

    # train is local to this function: plain pickle cannot send it, cloudpickle can.
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        fn = globals()["train_global"]
    else:
        fn = train
    emit(check="readme", results=spmd.spawn(fn, args=(0.1,), nprocs=4))


def train_global(rank, lr):
    x = np.full(4, rank, np.float32)
    spmd.all_reduce(x)
    return float(x[0]) * lr


def mode_raise():
    t0 = time.monotonic()
    try:
        spmd.spawn(raise_on_one, nprocs=3)
    except ProcessRaisedException as exc:
        emit(check="raise", type=type(exc).__name__, rank=exc.error_index,
             error_type=exc.error_type, message=str(exc), seconds=time.monotonic() - t0,
             workers=workers())
    # The process manager survived: the next job runs.
    emit(check="after", results=spmd.spawn(train_global, args=(1.0,), nprocs=2))
    emit(check="left", workers=workers())


def mode_kill():
    fds0 = open_fds()
    t0 = time.monotonic()
    try:
        spmd.spawn(kill_one, nprocs=3)
    except ProcessExitedException as exc:
        emit(check="kill", rank=exc.error_index, message=str(exc),
             seconds=time.monotonic() - t0, workers=workers(),
             descendants=[c for _, c in descendants()], fds_before=fds0, fds_after=open_fds())
    # The same interpreter spawns again, and the collectives are right.
    emit(check="again", ok=collectives_match_numpy(3, 7), workers=workers())


def mode_interrupt():
    """Ctrl-C in the caller while it waits for ranks stuck in a collective and a sleep."""
    fds0 = open_fds()
    ctx = spmd.spawn(stuck, nprocs=3, join=False)
    while None in ctx.pids():
        ctx.join(timeout=0.05)
    pids = ctx.pids()
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        ctx.join()
    except KeyboardInterrupt:
        alive = [p for p in pids if running(p)]
        emit(check="interrupt", seconds=time.monotonic() - t0, alive=alive, workers=workers(),
             descendants=[c for _, c in descendants()], fds_before=fds0, fds_after=open_fds())
    try:
        ctx.join()
    except RuntimeError as exc:
        emit(check="rejoin", message=str(exc))
    emit(check="again", ok=collectives_match_numpy(2, 11))


def stuck(rank):
    if rank == 0:
        time.sleep(600)
    x = np.ones(3)
    spmd.all_reduce(x)  # ranks 1 and 2 wait here for rank 0


def intrude(rank):
    """Rank 0 connects to the caller's socket like a rank of the job would, without the
    token, and claims rank 1 with a result; the job must not take it."""
    if rank == 0:
        env = dict(line.split("=", 1) for line in
                   open("/proc/self/environ").read().split("\0") if "=" in line)
        host, _, port = env["SPMD_SPAWN_ADDRESS"].rpartition(":")
        hello = json.dumps({"token": "0" * 32, "rank": 1, "size": 2, "pid": 1,
                            "host": "x"}).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(struct.pack("!BQ", 1, len(hello)) + hello)
            s.sendall(struct.pack("!BQ", 3, 10) + b"not pickle")
            time.sleep(0.3)
    x = np.array([rank + 1.0])
    spmd.all_reduce(x)
    return float(x[0])


def mode_intruder():
    emit(check="intruder", results=spmd.spawn(intrude, nprocs=2), workers=workers())


def mode_timeout():
    t0 = time.monotonic()
    try:
        spmd.spawn(sleep_long, nprocs=2, timeout=3)
    except spmd.DistTimeoutError as exc:
        emit(check="timeout", message=str(exc), seconds=time.monotonic() - t0,
             workers=workers())
    emit(check="after", results=spmd.spawn(train_global, args=(1.0,), nprocs=2))


def mode_repeat():
    spmd.spawn(train_global, args=(1.0,), nprocs=2)  # starts the process manager
    fds0, procs0 = sorted(os.listdir("/proc/self/fd")), descendants()
    ok = True
    for i in range(10):
        ok &= spmd.spawn(train_global, args=(float(i),), nprocs=2) == [1.0 * i, 1.0 * i]
    fds1, procs1 = sorted(os.listdir("/proc/self/fd")), descendants()
    emit(check="repeat", ok=bool(ok), fds_before=len(fds0), fds_after=len(fds1),
         procs_before=[c for _, c in procs0], procs_after=[c for _, c in procs1],
         workers=workers())


def mode_nojoin():
    ctx = spmd.spawn(slow_square, args=(2.0,), nprocs=3, join=False)
    first = ctx.join(timeout=0.01)
    t0, polls = time.monotonic(), 0
    while not ctx.join(timeout=0.5):
        polls += 1
    emit(check="nojoin", first=first, polls=polls, results=ctx.results,
         pids=ctx.pids(), seconds=time.monotonic() - t0, workers=workers())


def mode_badinput():
    msgs = []
    for call in (lambda: spmd.spawn(42), lambda: spmd.spawn(train_global, nprocs=0),
                 lambda: spmd.spawn(train_global, args=5),
                 lambda: spmd.spawn(train_global, timeout=-1),
                 lambda: spmd.spawn(train_global, env={"A": 1}),
                 lambda: spmd.spawn(lambda rank: rank),
                 no_launcher):
        try:
            call()
            msgs.append(None)
        except (TypeError, ValueError, RuntimeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    emit(check="badinput", messages=msgs, workers=workers())


def no_launcher():
    os.environ["SPMD_MPIEXEC"] = "/nonexistent/mpiexec"
    try:
        spmd.spawn(train_global, args=(1.0,), nprocs=2)
    finally:
        del os.environ["SPMD_MPIEXEC"]


def mode_nested():
    """Under ``mpiexec -n 1``: the spawned job is a job of its own, beside the caller's."""
    emit(check="nested", ok=collectives_match_numpy(2, 5), workers=workers())


def caller_address() -> str:
    """The host this rank reached its caller at: SPMD_SPAWN_ADDRESS as the rank started
    (spmd.spawn.child takes it out of os.environ; /proc keeps the environment of exec)."""
    with open("/proc/self/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"SPMD_SPAWN_ADDRESS="):
                return item.split(b"=", 1)[1].decode().rpartition(":")[0]
    return ""


def where(rank):
    """The SLURM node and job step a rank runs in, the caller's address it reached, and
    its collectives."""
    return {"node": os.environ.get("SLURMD_NODENAME"),
            "caller": caller_address(),
            "step": f"{os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}",
            **collectives(rank, 3)}


# Marks the ranks this program spawns (they inherit its environment, through srun too):
# other jobs' spawned ranks on this host (tests running side by side) are not its own.
RUN_MARK = f"SPMD_SPAWN_JOBS_RUN={os.getpid()}.{time.time_ns()}"
os.environ["SPMD_SPAWN_JOBS_RUN"] = RUN_MARK.partition("=")[2]


def spawned_anywhere() -> list[int]:
    """This program's spawned ranks still running anywhere on this host (srun's ranks
    are slurmstepd's children, not the caller's), from /proc."""
    found = []
    mark = RUN_MARK.encode() + b"\0"
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if b"spmd.spawn.child" not in f.read():
                        continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read() + b"\0" and running(int(name)):
                        found.append(int(name))
            except OSError:
                continue
    return found


def steps() -> list[str]:
    """The job steps SLURM runs in this allocation (squeue --steps)."""
    import subprocess

    out = subprocess.run(["squeue", "-h", "--steps", "-j", os.environ["SLURM_JOB_ID"],
                          "-o", "%i"], capture_output=True, text=True, timeout=30, check=True)
    return [s for s in out.stdout.split() if not s.endswith((".extern", ".batch", ".interactive"))]


def mode_slurm():
    """Inside an allocation of two nodes (salloc): srun places the ranks on both; a killed
    rank ends the step on every node; the next spawn works."""
    xs = [np.random.default_rng(3 + r).standard_normal(5) for r in range(4)]
    out = spmd.spawn(where, nprocs=4)
    emit(check="slurm", nodes=[o["node"] for o in out], steps=sorted({o["step"] for o in out}),
         callers=sorted({o["caller"] for o in out}),
         ok=all(np.allclose(o["sum"], np.sum(xs, axis=0), rtol=0, atol=1e-12)
                and np.array_equal(o["gathered"], np.concatenate(xs)) for o in out))
    t0 = time.monotonic()
    try:
        spmd.spawn(kill_one, nprocs=4)
    except ProcessExitedException as exc:
        emit(check="slurm_kill", message=str(exc), seconds=time.monotonic() - t0,
             spawned=spawned_anywhere(), steps=steps(), descendants=[c for _, c in descendants()])
    try:
        spmd.spawn(raise_on_one, nprocs=3)
    except ProcessRaisedException as exc:
        emit(check="slurm_raise", rank=exc.error_index, seconds=time.monotonic() - t0,
             spawned=spawned_anywhere(), steps=steps())
    emit(check="slurm_again", results=spmd.spawn(slow_square, args=(0.0,), nprocs=4),
         spawned=spawned_anywhere(), steps=steps())


def mode_env():
    emit(check="env", results=spmd.spawn(read_env_global, nprocs=2, env={"SPMD_SPAWN_TEST": "hello"}))


def read_env_global(rank):
    return f"{os.environ.get('SPMD_SPAWN_TEST')}:{rank}"


if __name__ == "__main__":
    if os.environ.get("SPAWN_TEST_NO_CLOUDPICKLE") == "1":
        sys.modules["cloudpickle"] = None  # plain pickle, as without cloudpickle installed
    globals()["mode_" + sys.argv[1]]()
