"""The shared-memory engine's settings: when it takes an op (measured thresholds), its
slot sizes, and ``SPMD_SHM``'s modes."""

from __future__ import annotations

from typing import NamedTuple

from spmd.backends.base import Engine
from spmd.core import settings

__all__ = ["ACROSS_NODES", "ACROSS_NODES_FORCED", "ALIGN", "AUTO_FROM",
           "AUTO_FROM_OVERSUBSCRIBED", "FORCED", "NEVER", "NOTHING", "ONE_SHOT_READ", "SHM_ENV",
           "SLOTS", "SLOT_BYTES", "SLOT_BYTES_OVERSUBSCRIBED", "Thresholds", "shm_mode",
           "status"]

SHM_ENV = "SPMD_SHM"
NEVER = 1 << 62

# -- measured constants --------------------------------------------------------------
# Bytes per slot and slots per rank: a rank's segment is SLOTS x SLOT_BYTES (+4 KiB).
# 64 MiB float32 all_reduce, 2 ranks on 2 cores (load 4.5, medians of 7): slots of 1, 2,
# 4, 8 MiB took 28, 38, 41, 40 ms (MPI 62).  4 ranks on the same 2 cores, where every
# wait costs a trip through the scheduler: 1, 2, 4, 8 MiB took 163, 76, 67, 63 ms
# (MPI 170).  Hence bigger slots (fewer waits) when ranks outnumber cores.
SLOT_BYTES = 1 << 20
SLOT_BYTES_OVERSUBSCRIBED = 4 << 20
SLOTS = 3                # the fewest the release marks allow; 4 measured no faster
# One-shot all_reduce/reduce while every rank reads at most this many bytes (local
# ranks x message) and the message fits one slot: 2 MiB messages at 2 ranks, 1 MiB at 4.
ONE_SHOT_READ = 4 << 20
ALIGN = 64              # bytes: parts of a chunk owned by different ranks start on cache lines


class Thresholds(NamedTuple):
    """The size in bytes from which the engine takes each op, ``NEVER`` for never.

    The size is the array's for all_reduce, reduce and broadcast, the input's for
    reduce_scatter_tensor, the output's for the all-gathers, which also go back to MPI
    from ``all_gather_to``.
    """

    all_reduce_from: int
    reduce_from: int
    reduce_scatter_from: int
    broadcast_from: int
    all_gather_from: int
    all_gather_to: int = NEVER

    def by_name(self) -> dict[str, int]:
        """Every size by its field's name (as the compiled call path takes them)."""
        return self._asdict()


# The thresholds of SPMD_SHM=auto mode.  Measured with benchmarks/shm_allreduce.py (float32, medians,
# load average 4-6 on the 2-core test machine, so +-30% is noise):
# - 2 ranks on 2 cores: all_reduce 0.9x MPI's speed at 16 KiB, 1.4x at 32 KiB, 1.9x
#   at 64 KiB, 3-4x from 256 KiB to 4 MiB, 1.0x at 16 MiB, 2.4x at 64 MiB; reduce 1.2x
#   at 16 KiB, 4.7x at 64 KiB, 6-15x above; reduce_scatter_tensor 1.1x at 64 KiB,
#   1.2-3.8x above; all-gathers 1.9-2.6x from 256 KiB to 2 MiB but 0.7-0.9x from 4 MiB
#   (MPI copies large messages once, the window twice); broadcast 0.3-0.7x everywhere.
# - 4 ranks on 2 cores (oversubscribed): MPI's small-message times swing between 0.05
#   and 1.6 ms from run to run, the engine's stay near 0.3-0.6 ms; from 64 KiB the
#   engine was 1.2-11x faster for all_reduce, 2.5-7x for broadcast, the all-gathers and
#   reduce_scatter_tensor, and from 256 KiB 2.5-6x for reduce.
# - Measured again on the quiet machine (load < 3): MPI is faster than under load, and
#   the all-gathers lost their lead: at 2 ranks the engine took 1.1-3x MPI's time from
#   128 KiB to 1 MiB and tied above; at 4 ranks 2-3x from 16 KiB to 256 KiB, a tie
#   above.  They stay with MPI in auto mode.  all_reduce at 4 ranks: 1.35x MPI's time
#   at 64 KiB, a tie at 128 KiB, 0.83x at 256 KiB, 2.1x faster at 64 MiB; at 2 ranks a
#   tie from 32 KiB to 4 MiB, 1.2x faster at 16 MiB, 2.8x at 64 MiB.  reduce and
#   reduce_scatter_tensor (2 ranks) 1.1-7x faster from 128 KiB.
# The all-gathers go back to MPI from 4 MiB of output (unless ranks outnumber cores).
AUTO_FROM = Thresholds(all_reduce_from=32 << 10, reduce_from=64 << 10,
                       reduce_scatter_from=64 << 10, broadcast_from=NEVER,
                       all_gather_from=NEVER, all_gather_to=4 << 20)
AUTO_FROM_OVERSUBSCRIBED = Thresholds(all_reduce_from=256 << 10, reduce_from=256 << 10,
                                      reduce_scatter_from=64 << 10, broadcast_from=64 << 10,
                                      all_gather_from=NEVER)
# SPMD_SHM=force: every size.
FORCED = Thresholds(all_reduce_from=1, reduce_from=1, reduce_scatter_from=1, broadcast_from=1,
                    all_gather_from=1)
# No window, or no two ranks on a node: nothing.
NOTHING = Thresholds(all_reduce_from=NEVER, reduce_from=NEVER, reduce_scatter_from=NEVER,
                     broadcast_from=NEVER, all_gather_from=NEVER)
# When the group spans several nodes only all_reduce runs here (hierarchically), in auto
# mode from 32 MiB: pseudo-nodes (2 x 2 ranks on the 2-core host) measured 0.5-0.8x
# MPI's speed from 64 KiB to 16 MiB and 1.2-1.3x at 64 MiB; real multi-node runs are not
# measured here.
ACROSS_NODES = Thresholds(all_reduce_from=32 << 20, reduce_from=NEVER,
                          reduce_scatter_from=NEVER, broadcast_from=NEVER, all_gather_from=NEVER)
ACROSS_NODES_FORCED = Thresholds(all_reduce_from=1, reduce_from=NEVER, reduce_scatter_from=NEVER,
                                 broadcast_from=NEVER, all_gather_from=NEVER)

_MODES = {"": "auto", "1": "auto", "auto": "auto", "on": "auto", "true": "auto",
          "yes": "auto", "0": "off", "off": "off", "false": "off", "no": "off",
          "force": "force", "always": "force"}


def shm_mode(environ=None) -> str:
    """``"auto"``, ``"off"`` or ``"force"`` from ``SPMD_SHM`` (auto when unset).

    Raises:
        ValueError: the variable has a value this function does not know.
    """
    return _MODES[settings.read(SHM_ENV, environ)]


def status(host: Engine) -> str:
    """What the engine does for the group of the host engine ``host`` (WORLD's in
    ``spmd info``); every member calls it."""
    host = getattr(host, "inner", host)  # the engine the debug mode's wrapper checks
    engine = getattr(host, "shm", None)
    if engine is None:  # the group's backend was made with the engine off, or without it
        if shm_mode() == "off":
            return f"off ({SHM_ENV}=0)"
        return "not used (one rank)" if host.group.size < 2 else "not used by this backend"
    try:
        return engine.describe()
    except Exception as exc:  # noqa: BLE001 - info reports, it does not fail
        return f"unavailable, MPI is used: {exc}"

