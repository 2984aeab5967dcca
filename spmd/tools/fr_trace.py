"""Read the flight recorder dumps of a job and show where its ranks diverged.

    python -m spmd.tools.fr_trace DUMP_DIR_OR_FILES... [--table]

For every group, collectives are lined up by sequence number across the ranks' dumps
(``spmd_fr.rank<R>.json``, written on a timeout or by ``spmd.dump_flight_recorder``);
the first one that some rank never started, did not finish, or called differently is
the place to look.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections.abc import Iterable

from spmd.core.flight_recorder import COMPLETED, FORMAT, format_table, ranks_text
from spmd.core.lines import write_lines

__all__ = ["analyze", "load", "main"]


def load(paths: Iterable[str]) -> list[dict]:
    """Read per-rank dumps: files, or directories holding ``spmd_fr.rank*.json``."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "spmd_fr.rank*.json")))
        else:
            files.append(p)
    dumps = []
    for f in files:
        try:
            with open(f) as fh:
                d = json.load(fh)
        except (OSError, ValueError) as exc:
            write_lines(f"skipping {f}: {exc}", sys.stderr)
            continue
        if d.get("format") != FORMAT:
            write_lines(f"skipping {f}: not a spmd flight recorder dump", sys.stderr)
            continue
        dumps.append(d)
    dumps.sort(key=lambda d: d["rank"])
    return dumps


def _describe(e: dict | None) -> str:
    if e is None:
        return "-"
    arr = f" {e['size']} x {e['dtype']}" if e["dtype"] is not None else ""
    state = e["state"] + (", timed out" if e["timed_out"] else "")
    return f"{e['op']}{arr} ({state})"


def analyze(dumps: list[dict]) -> str:
    """Merge per-rank dumps; for each group, the first collective where ranks diverge."""
    if not dumps:
        return "no flight recorder dumps found"
    world = dumps[0]["world_size"]
    have = [d["rank"] for d in dumps]
    lines = [f"flight recorder: dumps from {ranks_text(have)} of {world}"]
    for d in dumps:
        lines.append(f"  rank {d['rank']} ({d['host']}, pid {d['pid']}): {d['reason']}")
    missing = sorted(set(range(world)) - set(have))
    if missing:
        lines.append(f"  no dump from {ranks_text(missing)} (dead, or not reached by the "
                     "dump request)")
    groups: dict[str, dict] = {}
    for d in dumps:
        for gid, info in d["groups"].items():
            groups.setdefault(gid, {"info": info, "ranks": {}})["ranks"][d["rank"]] = info
    for gid, g in groups.items():
        by_rank = {}
        for d in dumps:
            if d["rank"] in g["ranks"]:
                by_rank[d["rank"]] = {e["seq"]: e for e in d["entries"]
                                      if e["group_id"] == gid and e["kind"] == "collective"}
        lines.append(f"group {g['info']['name']} (global {ranks_text(g['info']['ranks'])}):")
        members_missing = sorted(set(g["info"]["ranks"]) - set(by_rank))
        if members_missing:
            lines.append(f"  no dump from member {ranks_text(members_missing)}")
        started = {r: g["ranks"][r]["seq"] for r in by_rank}
        lowest = max((min(es) if es else started[r] + 1) for r, es in by_rank.items())
        highest = max(started.values()) if started else 0
        verdict = None
        for seq in range(max(1, lowest), highest + 1):
            seen: dict[str, list[int]] = {}
            ops, dtypes, unfinished = set(), set(), False
            for r, es in by_rank.items():
                e = es.get(seq)
                if e is None:
                    key = "not started" if started[r] < seq else "not recorded"
                    unfinished |= key == "not started"
                else:
                    key = _describe(e)
                    ops.add(e["op"])
                    dtypes.add(e["dtype"])
                    unfinished |= e["state"] != COMPLETED
                seen.setdefault(key, []).append(r)
            if len(ops) > 1 or len(dtypes) > 1 or unfinished:
                kind = ("ranks called different collectives" if len(ops) > 1 else
                        "ranks passed different dtypes" if len(dtypes) > 1 else
                        "not every rank finished it")
                verdict = [f"  first divergence at collective #{seq}: {kind}"]
                for k, rs in sorted(seen.items(), key=lambda kv: kv[1]):
                    if k == "not started":
                        lasts = "; ".join(
                            f"rank {r} last started #{started[r]}: "
                            f"{_describe(by_rank[r].get(started[r]))}" for r in rs)
                        verdict.append(f"    {ranks_text(rs)}: never started #{seq} ({lasts})")
                    else:
                        verdict.append(f"    {ranks_text(rs)}: {k}")
                break
        if verdict is None:
            lines.append(f"  no divergence in collectives #{max(1, lowest)}..#{highest}")
        else:
            lines += verdict
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m spmd.tools.fr_trace",
                                 description="merge per-rank flight recorder dumps and show "
                                             "where the ranks diverge")
    ap.add_argument("paths", nargs="+", help="dump files, or directories holding them")
    ap.add_argument("--table", action="store_true", help="also print every rank's ops")
    args = ap.parse_args(argv)
    dumps = load(args.paths)
    if args.table:
        for d in dumps:
            write_lines(format_table(d, last=None))
    write_lines(analyze(dumps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
