"""GPU-aware MPI: whether the MPI library in this process may be handed device pointers.

Asked of the library (``MPIX_Query_cuda_support`` where it has one), with what its
version says it can do and ``SPMD_CUDA_AWARE_MPI=0|1`` to override; the GPU engine over
MPI (cuda_mpi), host staging and MPMD links read the answer.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import NamedTuple

from mpi4py import MPI

from spmd.core import settings

__all__ = ["AWARE_ENV", "GpuAwareness", "decide_gpu_awareness", "mpi_gpu_support",
           "mpi_library_paths", "query_cuda_support"]

AWARE_ENV = "SPMD_CUDA_AWARE_MPI"


class GpuAwareness(NamedTuple):
    """Whether MPI may be handed device pointers, and how that was decided."""

    aware: bool
    reason: str
    # Open MPI documents that its nonblocking collectives (reductions included) do not
    # work on CUDA buffers outside UCX; its Isend/Irecv do.
    nonblocking_reductions: bool

    @property
    def nonblocking_collectives(self) -> bool:
        """Whether nonblocking collectives may get device buffers (not on Open MPI)."""
        return self.nonblocking_reductions


def mpi_library_paths() -> list[str]:
    """Paths of the MPI libraries loaded into this process (from /proc/self/maps)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                base = os.path.basename(path)
                if base.startswith(("libmpi", "libmpich")) and ".so" in base and path not in paths:
                    paths.append(path)
    except OSError:  # pragma: no cover - not Linux
        pass
    return paths


def query_cuda_support(paths: list[str] | None = None) -> tuple[int | None, str]:
    """Call ``MPIX_Query_cuda_support()`` in the loaded MPI library when it has one.

    Returns:
        (its result, the library it was found in), or (None, "") when no loaded MPI
        library exports it.
    """
    for path in mpi_library_paths() if paths is None else paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is None:
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return int(fn()), path
    return None, ""


def decide_gpu_awareness(library_version: str, query: int | None, env) -> GpuAwareness:
    """Decide whether MPI reads device memory (pure logic, for tests and ``spmd info``).

    Args:
        library_version: ``MPI.Get_library_version()``.
        query: what ``MPIX_Query_cuda_support()`` returned, None if the library has none.
        env: the environment (a mapping): ``SPMD_CUDA_AWARE_MPI=0|1`` overrides
            everything; Cray MPICH's ``MPICH_GPU_SUPPORT_ENABLED`` is read too.

    Raises:
        ValueError: ``SPMD_CUDA_AWARE_MPI`` is set to something other than 0 or 1.
    """
    open_mpi = "Open MPI" in library_version
    first = library_version.strip().splitlines()[0].strip() if library_version.strip() else "?"
    value = settings.read(AWARE_ENV, env)
    if value is not None:
        aware = value == "1"
        return GpuAwareness(aware, f"{AWARE_ENV}={value}", aware and not open_mpi)
    if query is not None:
        aware = query == 1
        reason = f"MPIX_Query_cuda_support() returned {query} ({first})"
        if aware and open_mpi and _open_mpi_major(library_version) < 5:
            # Before 5 it returns the build-time flag: a build with CUDA support compiled
            # in but switched off at run time (conda-forge's default) would get device
            # pointers and segfault.
            switch = env.get("OMPI_MCA_opal_cuda_support", "").strip().lower()
            if switch not in ("1", "true", "yes"):
                return GpuAwareness(False, f"{reason}, but Open MPI < 5 answers for the build, "
                                    "not the run: set OMPI_MCA_opal_cuda_support=true (or "
                                    f"{AWARE_ENV}=1) if CUDA support is on", False)
            reason += " and OMPI_MCA_opal_cuda_support=" + switch
        return GpuAwareness(aware, reason, aware and not open_mpi)
    upper = library_version.upper()
    if "MVAPICH2-GDR" in upper or "MVAPICH-PLUS" in upper:
        return GpuAwareness(True, f"{first} is built for GPU buffers", True)
    if "CRAY MPICH" in upper:
        aware = env.get("MPICH_GPU_SUPPORT_ENABLED", "") == "1"
        return GpuAwareness(aware, f"Cray MPICH with MPICH_GPU_SUPPORT_ENABLED="
                            f"{env.get('MPICH_GPU_SUPPORT_ENABLED', '(unset)')}", aware)
    return GpuAwareness(False, f"{first} has no MPIX_Query_cuda_support and is not known to "
                        f"read GPU memory (set {AWARE_ENV}=1 if it does)", False)


def _open_mpi_major(library_version: str) -> int:
    """The major version in ``Open MPI v4.1.5, ...`` (0 when it cannot be read)."""
    m = re.search(r"Open MPI v?(\d+)\.", library_version)
    return int(m.group(1)) if m else 0


_query_cache: tuple[int | None, str] | None = None


def mpi_gpu_support() -> GpuAwareness:
    """Whether the MPI library in this process reads device memory.  The library is
    queried once; the environment override is read on every call."""
    global _query_cache

    if _query_cache is None:
        _query_cache = query_cuda_support()
    return decide_gpu_awareness(MPI.Get_library_version(), _query_cache[0], os.environ)


# -- GPU arrays ---------------------------------------------------------------------
