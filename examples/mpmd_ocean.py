"""Ocean half of a coupled ocean-atmosphere column; runs together with mpmd_atmos.py.

    mpiexec -n 2 python examples/mpmd_ocean.py : -n 2 python examples/mpmd_atmos.py
    sbatch slurm/mpmd.sbatch      (srun --multi-prog)     sbatch slurm/hetjob.sbatch

Heat diffuses through one vertical column: ocean cells at the bottom, air cells on
top.  Each program spreads its cells over its own ranks and swaps halo cells inside
its own group; at the sea surface the top ocean cell and the bottom air cell are
swapped with the other program through a link.  Every REPORT steps each program
broadcasts its surface temperature to all ranks of the other.  At the end both
programs check themselves against a serial run of the whole column.

The column model below is shared: mpmd_atmos.py imports it from here.
"""

import sys

import numpy as np

import spmd

OCEAN_CELLS, AIR_CELLS = 24, 30
CELLS = OCEAN_CELLS + AIR_CELLS
KAPPA = {"ocean": 0.10, "atmos": 0.40, "surface": 0.20}  # per step; < 0.5 keeps it stable
STEPS, REPORT = 200, 50


def initial_column() -> np.ndarray:
    depth = np.arange(OCEAN_CELLS) / (OCEAN_CELLS - 1)
    ocean = 4.0 + 14.0 * depth ** 2                 # cold abyss, warm surface
    air = 16.0 - 0.65 * np.arange(AIR_CELLS)        # cooling with height
    return np.concatenate([ocean, air])


def face_kappas() -> np.ndarray:
    """Conductance of face j, between cells j and j+1 (the column's ends are closed)."""
    k = np.full(CELLS - 1, KAPPA["atmos"])
    k[:OCEAN_CELLS - 1] = KAPPA["ocean"]
    k[OCEAN_CELLS - 1] = KAPPA["surface"]
    return k


def surface(t: np.ndarray) -> tuple[float, float]:
    """Sea-surface and surface-air temperature."""
    return float(t[OCEAN_CELLS - 1]), float(t[OCEAN_CELLS])


def serial_run(steps: int) -> tuple[np.ndarray, list]:
    """The whole column on one process: the reference both programs check against."""
    t, k, history = initial_column(), face_kappas(), []
    for step in range(1, steps + 1):
        flux = k * (t[1:] - t[:-1])
        t[:-1] += flux
        t[1:] -= flux
        if step % REPORT == 0:
            history.append(surface(t))
    return t, history


def say(line: str) -> None:
    sys.stdout.write(line + "\n")   # one write per line: the launcher merges ranks by line
    sys.stdout.flush()


def run(name: str, other: str, first: int, last: int) -> None:
    """One program's part of the coupled run: global cells ``first .. last-1``."""
    spmd.init_process_group()
    group = spmd.init_program(name)                  # this program's ranks only
    link = spmd.new_link(other)                      # every rank of both programs
    r, size, remote = group.rank(), group.size(), link.remote_size()
    below = name == "atmos"                          # the other program lies below us

    # Handshake: each program's leader hands its set-up to every rank of the other.
    mine = {"program": name, "cells": (first, last), "steps": STEPS, "kappa": KAPPA}
    for src_program in ("ocean", "atmos"):
        theirs = link.broadcast_object(mine if src_program == name else None, src=0,
                                       src_program=src_program)
        if src_program != name:
            assert theirs["steps"] == STEPS and theirs["kappa"] == KAPPA, theirs

    cells = np.array_split(np.arange(first, last), size)[r]
    lo, hi = int(cells[0]), int(cells[-1]) + 1
    k_all = face_kappas()
    k = np.array([k_all[j] if 0 <= j < CELLS - 1 else 0.0 for j in range(lo - 1, hi)])
    t = np.zeros(hi - lo + 2)                        # our cells plus a ghost at each end
    t[1:-1] = initial_column()[lo:hi]
    sst_rank = remote - 1 if below else size - 1     # the ocean rank at the sea surface
    history = []
    for step in range(1, STEPS + 1):
        works = []
        if r > 0:                                    # neighbours inside this program
            works += [spmd.isend(t[1:2], group_dst=r - 1, group=group),
                      spmd.irecv(t[0:1], group_src=r - 1, group=group)]
        elif below:                                  # across the sea surface
            works += [link.isend(t[1:2], dst=remote - 1), link.irecv(t[0:1], src=remote - 1)]
        if r < size - 1:
            works += [spmd.isend(t[-2:-1], group_dst=r + 1, group=group),
                      spmd.irecv(t[-1:], group_src=r + 1, group=group)]
        elif not below:
            works += [link.isend(t[-2:-1], dst=0), link.irecv(t[-1:], src=0)]
        for w in works:
            w.wait()
        flux = k * (t[1:] - t[:-1])
        t[1:-1] += flux[1:]                          # the serial run's order of operations
        t[1:-1] -= flux[:-1]
        if step % REPORT == 0:                       # surface temperatures to everyone
            sst = np.zeros(1) if below else t[-2:-1].copy()  # right on the sending rank
            sat = t[1:2].copy() if below else np.zeros(1)
            link.broadcast(sst, src=sst_rank, src_program="ocean")
            link.broadcast(sat, src=0, src_program="atmos")
            # ... and inside the sending program, from its surface rank to the others
            spmd.broadcast(sat if below else sst, group_src=0 if below else size - 1,
                           group=group)
            history.append((float(sst[0]), float(sat[0])))

    expected, expected_history = serial_run(STEPS)
    error = float(np.abs(t[1:-1] - expected[lo:hi]).max())
    assert error <= 1e-12, f"{name} rank {r}: max error {error} against the serial run"
    assert history == expected_history, (history, expected_history)

    # The leaders swap whole halves, so each can check the full column and its heat.
    parts = [None] * size if r == 0 else None
    spmd.gather_object(t[1:-1].copy(), parts, group=group, group_dst=0)
    if r == 0:
        half = np.concatenate(parts)
        if below:                                    # one side sends first, the other receives
            other_half = link.recv_object(src=0)
            link.send_object(half, dst=0)
        else:
            link.send_object(half, dst=0)
            other_half = link.recv_object(src=0)
        column = np.concatenate([other_half, half] if below else [half, other_half])
        assert np.abs(column - expected).max() <= 1e-12
        assert abs(column.sum() - initial_column().sum()) <= 1e-9 * CELLS   # heat is conserved
        if name == "ocean":
            programs = ", ".join(f"{p.name} ranks {list(p.ranks)}" for p in spmd.get_programs())
            say(f"programs: {programs}")
            say(f"column: {CELLS} cells, {STEPS} steps, heat {column.sum():.6f} conserved, "
                f"sea surface {history[-1][0]:.4f}, surface air {history[-1][1]:.4f}")
    say(f"{name} rank {r}/{size} coupled OK: cells {lo}-{hi - 1}, max error {error:.1e}")
    link.free()
    spmd.destroy_process_group()


if __name__ == "__main__":
    run("ocean", "atmos", 0, OCEAN_CELLS)
