"""spmd.spawn from a plain ``python`` script, as a notebook would use it: the functions
below are defined in ``__main__``.  ``python spawn_jobs.py MODE`` prints one JSON line
per check (``{"check": ..., ...}``) for tests/jobs/test_spawn.py to assert on."""

import json
import os
import signal
import sys
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
    """Spawned ranks still running (their command line names the boot file)."""
    return [p for p, cmd in descendants() if "spmd_spawn_boot" in cmd]


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


def mode_sizes():
    for n in (1, 2, 3, 4):
        out = spmd.spawn(collectives, args=(100 * n,), nprocs=n)
        xs = [np.random.default_rng(100 * n + r).standard_normal(5) for r in range(n)]
        ok = (len(out) == n
              and all(o["rank"] == r and o["size"] == n for r, o in enumerate(out))
              and all(np.array_equal(o["x"], xs[r]) for r, o in enumerate(out))
              and all(np.allclose(o["sum"], np.sum(xs, axis=0), rtol=0, atol=1e-12)
                      for o in out)
              and all(np.array_equal(o["gathered"], np.concatenate(xs)) for o in out)
              and all(np.array_equal(o["bcast"], xs[n - 1]) for o in out))
        emit(check="sizes", n=n, ok=bool(ok))
    emit(check="left", workers=workers())


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
    t0 = time.monotonic()
    try:
        spmd.spawn(kill_one, nprocs=3)
    except ProcessExitedException as exc:
        emit(check="kill", rank=exc.error_index, message=str(exc),
             seconds=time.monotonic() - t0, workers=workers(),
             descendants=[c for _, c in descendants()])
    try:
        spmd.spawn(train_global, args=(1.0,), nprocs=2)
    except RuntimeError as exc:
        emit(check="again", message=str(exc))


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
                 lambda: spmd.spawn(lambda rank: rank)):
        try:
            call()
            msgs.append(None)
        except (TypeError, ValueError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    emit(check="badinput", messages=msgs, workers=workers())


def mode_env():
    emit(check="env", results=spmd.spawn(read_env_global, nprocs=2, env={"SPMD_SPAWN_TEST": "hello"}))


def read_env_global(rank):
    return f"{os.environ.get('SPMD_SPAWN_TEST')}:{rank}"


if __name__ == "__main__":
    if os.environ.get("SPAWN_TEST_NO_CLOUDPICKLE") == "1":
        sys.modules["cloudpickle"] = None  # plain pickle, as without cloudpickle installed
    globals()["mode_" + sys.argv[1]]()
