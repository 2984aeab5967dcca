"""Starting processes as a job the launcher lets fail: Open MPI's runtime, through PMIx.

``MPI_Comm_spawn`` on Open MPI 5 starts the new processes as a job of their own that
the launcher does not let fail: ``mpiexec --with-ft ulfm`` marks only the job it
started recoverable, and Open MPI's ``MPI_Comm_spawn`` passes no such key on.  A killed
replacement then aborts its job, and ``mpiexec`` returns 137 at the end although every
rank of the final world finished (and one that leaves without ``MPI_Finalize`` aborts it
too).  PMIx's own spawn takes the job's attributes: started with ``pmix.recover``, the new
processes fail like the launcher's own ranks, harmlessly to the exit status.

Processes started that way have no MPI parent: they connect to a port the starting
processes opened (``MPI_Comm_connect`` / ``MPI_Comm_accept``), whose name they find in
their environment (:data:`PORT_VARIABLE`), and from there it is the same merged
intercommunicator as after ``MPI_Comm_spawn`` (:mod:`spmd.backends.mpi.replacement`).

PMIx is reached with ctypes in the library Open MPI itself loaded (its ``libpmix`` beside
``libmpi``), so the calls go to the client Open MPI initialised.  Only the few PMIx
structures a spawn needs are declared here; the job's attributes are built with
PMIx's own ``PMIx_Info_list_*`` calls, so their layout is the library's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

from mpi4py import MPI

from spmd.core import settings

__all__ = ["PORT_VARIABLE", "available", "spawn", "take_port"]

# The port the new processes connect to (set by spawn() in their environment only;
# read and removed at their init_process_group).
PORT_VARIABLE = "SPMD_JOIN_PORT"

_PMIX_BOOL, _PMIX_STRING = 1, 3          # pmix_data_type_t
_PMIX_SUCCESS = 0
_NSPACE_LEN = 256                        # PMIX_MAX_NSLEN + 1


class _DataArray(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint16), ("size", ctypes.c_size_t),
                ("array", ctypes.c_void_p)]


class _App(ctypes.Structure):
    _fields_ = [("cmd", ctypes.c_char_p), ("argv", ctypes.POINTER(ctypes.c_char_p)),
                ("env", ctypes.POINTER(ctypes.c_char_p)), ("cwd", ctypes.c_char_p),
                ("maxprocs", ctypes.c_int), ("info", ctypes.c_void_p),
                ("ninfo", ctypes.c_size_t)]


_lib: ctypes.CDLL | None = None
_probed = False


def _libpmix() -> ctypes.CDLL | None:
    """Open MPI's libpmix (the one its libmpi loaded), or None."""
    global _lib, _probed
    if _probed:
        return _lib
    _probed = True
    if "Open MPI" not in MPI.Get_library_version():
        return None
    candidates = []
    for mapped in _mapped_libraries():
        if os.path.basename(mapped).startswith("libpmix.so"):
            candidates.append(mapped)
    found = ctypes.util.find_library("pmix")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            lib.PMIx_Spawn, lib.PMIx_Info_list_start   # noqa: B018 (the calls spawn needs)
        except (OSError, AttributeError):
            continue
        lib.PMIx_Info_list_start.restype = ctypes.c_void_p
        lib.PMIx_Info_list_add.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p,
                                           ctypes.c_uint16]
        lib.PMIx_Info_list_convert.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DataArray)]
        lib.PMIx_Info_list_release.argtypes = [ctypes.c_void_p]
        lib.PMIx_Data_array_destruct.argtypes = [ctypes.POINTER(_DataArray)]
        lib.PMIx_Spawn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(_App),
                                   ctypes.c_size_t, ctypes.c_char_p]
        lib.PMIx_Error_string.restype = ctypes.c_char_p
        lib.PMIx_Error_string.argtypes = [ctypes.c_int]
        _lib = lib
        break
    return _lib


def _mapped_libraries() -> list[str]:
    """The shared libraries this process has loaded (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if ".so" in line.split()[-1]})
    except OSError:
        return []


def available() -> bool:
    """Whether this process can start a recoverable job (Open MPI with its PMIx)."""
    return _libpmix() is not None


def _strings(items: Sequence[str]):
    return (ctypes.c_char_p * (len(items) + 1))(*[s.encode() for s in items], None)


def spawn(count: int, port: str, argv: Sequence[str], env: dict[str, str]) -> str:
    """Start ``count`` processes running ``argv`` (the executable first) in this
    process's working directory, as a recoverable Open MPI job; they connect to
    ``port``.  ``env`` is added to their environment (Open MPI's ``OMPI_MCA_*``
    settings of this process go along, as ``MPI_Comm_spawn`` passes them).

    Returns:
        The new job's namespace.

    Raises:
        RuntimeError: PMIx refused the spawn (its error string).
    """
    lib = _libpmix()
    if lib is None:
        raise RuntimeError("recoverable spawn: Open MPI's PMIx library was not found")
    extra = {k: v for k, v in os.environ.items() if k.startswith("OMPI_MCA_")}
    extra.update(env)
    extra[PORT_VARIABLE] = port
    attrs = lib.PMIx_Info_list_start()
    yes = ctypes.c_bool(True)
    try:
        for key, value, kind in ((b"pmix.recover", ctypes.byref(yes), _PMIX_BOOL),
                                 (b"pmix.pers", ctypes.c_char_p(b"ompi5"), _PMIX_STRING)):
            rc = lib.PMIx_Info_list_add(attrs, key, value, kind)
            if rc != _PMIX_SUCCESS:
                raise RuntimeError(f"recoverable spawn: PMIx refused the job attribute "
                                   f"{key.decode()}: {lib.PMIx_Error_string(rc).decode()}")
        info = _DataArray()
        lib.PMIx_Info_list_convert(attrs, ctypes.byref(info))
    finally:
        lib.PMIx_Info_list_release(attrs)
    args = _strings(list(argv))
    envs = _strings([f"{k}={v}" for k, v in extra.items()])
    app = _App(argv[0].encode(), args, envs, os.getcwd().encode(), count, None, 0)
    nspace = ctypes.create_string_buffer(_NSPACE_LEN)
    try:
        rc = lib.PMIx_Spawn(ctypes.c_void_p(info.array), info.size, ctypes.byref(app), 1,
                            nspace)
    finally:
        lib.PMIx_Data_array_destruct(ctypes.byref(info))
    if rc != _PMIX_SUCCESS:
        raise RuntimeError(f"PMIx_Spawn of {count} process(es) failed: "
                           f"{lib.PMIx_Error_string(rc).decode()}")
    return nspace.value.decode()


def take_port() -> str | None:
    """In a process ``spawn()`` started: the port to connect to (removed from the
    environment, so that processes this one starts do not see it); else None."""
    port = settings.read(PORT_VARIABLE)
    os.environ.pop(PORT_VARIABLE, None)
    return port
