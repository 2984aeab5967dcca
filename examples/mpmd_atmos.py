"""Atmosphere half of a coupled ocean-atmosphere column; runs together with mpmd_ocean.py.

    mpiexec -n 2 python examples/mpmd_ocean.py : -n 2 python examples/mpmd_atmos.py

The column model lives in mpmd_ocean.py (next to this file).  This program owns the
air cells, above the sea surface; it names itself "atmos", which is how the job tells
the programs apart under mpiexec, srun --multi-prog and SLURM hetjobs alike.
"""

from mpmd_ocean import CELLS, OCEAN_CELLS, run

if __name__ == "__main__":
    run("atmos", "ocean", OCEAN_CELLS, CELLS)
