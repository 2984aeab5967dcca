"""Run torch's own distributed test suite (``DistributedTest._DistTestBase`` from
``torch/testing/_internal/distributed/distributed_test.py``, shipped in the wheel)
against the spmd backend, the way torch's MPI driver did: every rank of one
``mpiexec`` job initialises the default group once and runs every test in the same
order.

    mpiexec -n 2 python tests/torch_backend/run_torch_suite.py [--as gloo|mpi]
        [-k SUBSTRING] [--json OUT]

Tests listed in ``excluded.txt`` (next to this file, one ``name  # reason`` a line)
are not run and count as excluded.  A test is a failure if it fails on any rank.
Rank 0 prints the counts; the exit status is non-zero on any failure.

About a third of the suite is skipped by the backend's *name*: torch's decorators
allow only "nccl", "gloo" or "ucc" there (CPU all-to-all only "mpi"), whatever the
backend can do.  With ``--as gloo`` the suite is told its backend is "gloo" (its
``BACKEND``, read by those decorators and by the tests themselves), and every group a
test asks "gloo" for is made by spmd: gloo never runs, every group is spmd's.
``--as mpi`` likewise (torch's suite assumes 3 or more ranks for MPI).  Each such run
has its own exclusion list, ``excluded_as_NAME.txt``.  Only this runner says so; the
backend a user gets is always named "spmd".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


def load_exclusions(path: str) -> dict[str, str]:
    """{test name: reason} from the exclusion file; a line without a reason is an error."""
    out = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, reason = line.partition("#")
            if not sep or not reason.strip():
                raise SystemExit(f"{path}:{n}: exclusion {name.strip()!r} has no reason")
            out[name.strip()] = reason.strip()
    return out


def make_groups_with_spmd(told: str) -> None:
    """Every process group torch makes for backend ``told`` (alone or in a
    "cpu:gloo,..." list) is made by the spmd backend: all of them pass through
    ``_new_process_group_helper``."""
    from torch.distributed import distributed_c10d as c10d

    make = c10d._new_process_group_helper

    def spmd_for_told(group_size, group_rank, global_ranks, backend, *rest, **kw):
        parts = []
        for part in str(backend).lower().split(","):  # "gloo" or "cpu:gloo,cuda:nccl"
            device, sep, name = part.rpartition(":")
            parts.append(device + sep + ("spmd" if name == told else name))
        return make(group_size, group_rank, global_ranks, ",".join(parts), *rest, **kw)

    c10d._new_process_group_helper = spmd_for_told


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="run only tests whose name contains this")
    p.add_argument("--json", default=None, help="write per-test outcomes here (rank 0)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="group timeout in seconds: a hung test ends in DistTimeoutError")
    p.add_argument("--as", dest="told", choices=("gloo", "mpi"), default=None,
                   help="answer torch's backend-name checks with this name (the groups "
                   "stay spmd)")
    args = p.parse_args()

    import torch.distributed as dist
    from mpi4py import MPI

    import spmd.torch  # noqa: F401 - registers the backend also with autoload off

    os.environ.setdefault("SPMD_ABORT_ON_EXCEPTION", "0")
    dist.init_process_group("spmd", timeout=timedelta(seconds=args.timeout))
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="spmd-torch-suite-") if rank == 0 else None)
    if rank == 0:
        for d in ("barrier", "test_dir", "init_dir"):
            os.makedirs(os.path.join(tmp, d), exist_ok=True)
    comm.Barrier()
    os.environ.update(BACKEND=args.told or "spmd", WORLD_SIZE=str(size), TEMP_DIR=tmp,
                      INIT_METHOD="env://")
    if args.told:
        make_groups_with_spmd(args.told)

    # Declared before the import: the suite's skip decorators read these at import.
    from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases

    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("spmd")
    from torch.testing._internal.distributed import distributed_test as dt

    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}

    from torch.testing._internal.common_utils import TestCase

    class TestSpmd(TestCase, dt.DistributedTest._DistTestBase):
        file_name = os.path.join(tmp, "init_dir", "shared_init_file")

        @property
        def rank(self):
            return dist.get_rank()

        @property
        def world_size(self):
            return os.environ["WORLD_SIZE"]

        @property
        def init_method(self):
            return "file://" + self.file_name

        def setUp(self):
            super().setUp()  # seeds every rank's RNG alike, as torch's harness does
            comm.Barrier()
            if rank == 0:
                for f in os.listdir(os.path.join(tmp, "barrier")):
                    os.unlink(os.path.join(tmp, "barrier", f))
            comm.Barrier()
            dt.Barrier.barrier_id = 0

    excluded = load_exclusions(os.path.join(
        HERE, f"excluded_as_{args.told}.txt" if args.told else "excluded.txt"))
    names = sorted(n for n in dir(TestSpmd) if n.startswith("test_") and args.k in n)
    unknown = sorted(set(excluded) - set(dir(TestSpmd)))
    outcomes: dict[str, dict] = {}
    t0 = time.monotonic()
    for name in names:
        if name in excluded:
            outcomes[name] = {"outcome": "excluded", "why": excluded[name]}
            continue
        result = unittest.TestResult()
        started = time.monotonic()
        try:
            TestSpmd(name).run(result)
        except SystemExit as exc:
            result.skipped.append((name, skip_codes.get(exc.code, f"exit {exc.code}")))
        mine = {"outcome": "passed", "why": "", "s": round(time.monotonic() - started, 2)}
        for _, err in result.errors + result.failures:
            code = None
            if "SystemExit" in err:
                code = next((c for c in skip_codes if f"SystemExit: {c}" in err), None)
            if code is not None:
                mine = {"outcome": "skipped", "why": skip_codes[code]}
            else:
                mine = {"outcome": "failed", "why": err[-3000:]}
                break
        if mine["outcome"] == "passed" and result.skipped:
            mine = {"outcome": "skipped", "why": str(result.skipped[0][1])}
        if mine["outcome"] == "passed" and result.unexpectedSuccesses:
            mine = {"outcome": "failed", "why": "unexpected success"}
        everyone = comm.allgather(mine)
        failed = [r for r, o in enumerate(everyone) if o["outcome"] == "failed"]
        if failed:
            outcomes[name] = {"outcome": "failed", "ranks": failed,
                              "why": everyone[failed[0]]["why"]}
        else:
            outcomes[name] = everyone[0]
        if rank == 0:
            print(f"{outcomes[name]['outcome']:8s} {name}", flush=True)
    elapsed = time.monotonic() - t0
    if rank == 0:
        counts: dict[str, int] = {}
        for o in outcomes.values():
            counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
        for name, o in outcomes.items():
            if o["outcome"] == "failed":
                print(f"\n=== FAILED {name} (ranks {o['ranks']})\n{o['why']}")
        if unknown:
            print(f"\nexclusions naming no test of this torch: {unknown}")
        told = f' (told "{args.told}")' if args.told else ""
        print(f"\ntorch distributed_test on spmd{told}, {size} ranks, {elapsed:.0f} s: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": size, "seconds": elapsed, "counts": counts,
                           "tests": outcomes}, f, indent=1)
    bad = any(o["outcome"] == "failed" for o in outcomes.values())
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group still ends the run
        traceback.print_exc()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
