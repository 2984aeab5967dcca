"""The default group: init/destroy, backends by device, and what the launcher gave us."""

from __future__ import annotations

import atexit
import os
import warnings
from datetime import timedelta

from mpi4py import MPI

from spmd.backends import registry
from spmd.backends.bootstrap import check_same_installation
from spmd.backends.mpi import finalize, replacement
from spmd.backends.mpi.nodes import node_layout
from spmd.backends.registry import Backend, register_backend
from spmd.core import cuda as _gpu
from spmd.core import settings, startup
from spmd.core import wait as _wait
from spmd.core.launch import LOCAL_RANK_VARS, check_world_size, local_rank_from_env
from spmd.core.settings import Config, parse_options
from spmd.core.timeouts import DEFAULT_PG_TIMEOUT, to_seconds
from spmd.core.typing import Timeout
from spmd.runtime import supervision
from spmd.runtime.group import (
    GroupArg,
    GroupMember,
    ProcessGroup,
    default_group,
    resolve,
    world_state,
)
from spmd.store import Store

__all__ = [
    "Backend",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "register_backend",
    "get_backend",
    "get_rank",
    "get_world_size",
    "get_node_local_rank",
]


def is_available() -> bool:
    """True: spmd runs wherever mpi4py imports."""
    return True


def is_mpi_available() -> bool:
    return True


def is_nccl_available() -> bool:
    """True when the NCCL backend can run: CuPy imports and loads its NCCL library."""
    return registry.unavailable("nccl") is None


def is_initialized() -> bool:
    """True between ``init_process_group()`` and ``destroy_process_group()``."""
    return world_state.world is not None


def _installation() -> dict:
    import mpi4py

    from spmd._version import __version__

    return {"spmd": __version__, "mpi4py": mpi4py.__version__, "MPI": _library_name()}


def _library_name() -> str:
    """The MPI library this process loaded: the first line of its version string."""
    return MPI.Get_library_version().splitlines()[0].strip()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: Timeout | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, group_name: str = "",
                       pg_options: object = None, device_id: object = None) -> None:
    """Initialise spmd: the default group (WORLD) over a private duplicate of COMM_WORLD.

    Every rank of the MPI job must call it.  Ranks and the world size come from the MPI
    launcher (``mpiexec``, ``srun``, or a plain ``python`` run as a world of one).

    Args:
        backend: ``"mpi"`` (MPI for every device: GPU arrays go through GPU-aware
            MPI or host staging), ``"nccl"`` (GPU arrays only), ``"gloo"`` (an alias
            of MPI for host arrays), a per-device map like ``"cpu:mpi,cuda:nccl"``,
            or a name given to :func:`register_backend`.  ``None`` means
            ``"cpu:mpi,cuda:nccl"`` when CuPy's NCCL can run here, else ``"mpi"``,
            decided at a group's first GPU array (CuPy is not loaded before).
        init_method: accepted for torch compatibility and ignored: MPI does the
            rendezvous.  A value other than ``env://`` or ``mpi://`` warns.
        timeout: default timeout of blocking operations (if None: ``SPMD_TIMEOUT``
            seconds, else 30 minutes).  Past it a wait raises DistTimeoutError naming
            the ranks that did not reach the op.
        world_size, rank: if given, must equal what MPI says.
        store: a key-value store (``spmd.store``) used for the start-up exchanges that
            would otherwise go over MPI: the check that every rank runs the same spmd,
            mpi4py and MPI library, and GPU communicator ids.
        group_name: name of the default group in messages ("WORLD" if empty).
        pg_options: a dict of reliability settings (``spmd.core.settings.Config``):
            ``debug`` ("OFF"/"INFO"/"DETAIL"), ``abort_on_exception``, ``dump_dir``,
            ``flight_recorder_size``, ``watchdog``, ``watchdog_interval``,
            ``heartbeat_timeout``, ``query_timeout``; unset ones come from the
            ``SPMD_*`` environment variables.
        device_id: the CUDA device this rank uses (an int, ``"cuda:N"``, a
            ``torch.device``); it becomes CuPy's current device here, and GPU arrays
            on another device raise ValueError.  With the
            NCCL backend the communicator is created here (eagerly) instead of at the
            first GPU collective, and groups split from WORLD get theirs by
            ``ncclCommSplit`` where NCCL and CuPy have it.

    Raises:
        RuntimeError: spmd is already initialised, or a backend is not available.
        ValueError: ``rank``/``world_size`` disagree with MPI, or bad backend string.
    """
    if world_state.world is not None:
        raise RuntimeError("init_process_group: trying to initialize the default process "
                           "group twice; call destroy_process_group() first")
    if backend is None:
        # c10d's default (MPI for host arrays, NCCL for GPU arrays when it can run here),
        # decided at the first GPU array: checking NCCL now would load CuPy in every run.
        spec = Backend.UNDEFINED
    else:
        spec = str(Backend(backend))
    devices = Backend.device_map(spec)
    for device, name in devices.items():
        why = registry.unavailable(name)
        if why is not None:
            raise RuntimeError(f"init_process_group: backend {name!r} for {device} arrays is not "
                               f"available in this installation: {why} (registered: "
                               f"{registry.names()})")
    if device_id is not None:
        _gpu.device_index(device_id)  # a ValueError for a bad one, before anything is created
        if devices.get("cuda") == Backend.UNDEFINED and is_nccl_available():
            spec, devices = "cpu:mpi,cuda:nccl", {"cpu": "mpi", "cuda": "nccl"}
    if init_method not in (None, "env://", "mpi://"):
        warnings.warn(f"init_process_group: init_method={init_method!r} is ignored; the MPI "
                      "launcher provides ranks and rendezvous", stacklevel=2)
    inter = replacement.parent()
    if inter is not None:   # started by spmd.heal() to take a lost rank's place
        comm, plan = replacement.join(inter)
        size, me = comm.Get_size(), comm.Get_rank()
        world_state.full_size, world_state.replaced = plan.full_size, plan.lost
        world_state.is_replacement = True
        world_state.awaiting_state = True
        if replacement.started_recoverable():
            finalize.note_failure()   # as its peers: they all saw a rank die
        else:
            finalize.note_replacement()
        end_healed_world_at_exit()
        group_name = group_name or plan.name
    else:
        comm = MPI.COMM_WORLD
        size, me = comm.Get_size(), comm.Get_rank()
        world_state.full_size, world_state.replaced = size, ()
    check_world_size(size, library=_library_name())
    if world_size not in (-1, None) and world_size != size:
        raise ValueError(f"init_process_group: world_size={world_size} but MPI started {size} "
                         f"ranks [rank {me}]")
    if rank not in (-1, None) and rank != me:
        raise ValueError(f"init_process_group: rank={rank} but MPI says this is rank {me} "
                         f"(of {size})")
    if timeout is not None and not isinstance(timeout, timedelta):   # as torch asks
        raise TypeError(f"init_process_group: timeout must be a datetime.timedelta, got "
                        f"{type(timeout).__name__}")
    if timeout is None:   # SPMD_TIMEOUT, else torch's default (30 minutes)
        from_env = settings.read("SPMD_TIMEOUT")
        timeout = DEFAULT_PG_TIMEOUT if from_env is None else timedelta(seconds=from_env)
    seconds = to_seconds(timeout, "init_process_group", positive=True)
    reliability = parse_options(pg_options)
    if inter is None:
        comm = comm.Dup()   # spmd's traffic never meets the program's on COMM_WORLD
    world_state.home_rank = me
    _gpu.bind_device_id(device_id)
    if device_id is not None:
        _gpu.select_device(device_id)  # arrays made from now on land on it; staging syncs it
    pg = open_world(comm, group_name or "WORLD", seconds, spec, store, reliability)
    startup.run()
    if device_id is not None and devices.get("cuda") == "nccl":
        pg.engine_for("cuda").connect("init_process_group")  # eager, as c10d does


_end_registered = False


def end_healed_world_at_exit() -> None:
    """In a world healing remade (spmd.heal): at exit, free the groups on every process
    before it goes, as ``destroy_process_group()`` would.  Open MPI 5.0 ends the new
    processes' job in error (an abort) when they finalize while the survivors' spawned
    and merged communicators are still live on either side; freed on both, the job ends
    cleanly (8 of 8 runs, against 0 of 8 without)."""
    global _end_registered
    if not _end_registered:
        atexit.register(_end_at_exit)   # after spmd's own: runs first (last in, first out)
        _end_registered = True


def _end_at_exit() -> None:
    # No exit notice here (spmd.runtime.exits): sends to the other job's processes still
    # pending at finalize made Open MPI abort the job about 3 runs in 4.
    if world_state.world is not None:
        destroy_process_group()


def open_world(comm: MPI.Intracomm, name: str, seconds: float, spec: str, store: Store | None,
               reliability: Config, op: str = "init_process_group") -> ProcessGroup:
    """Make ``comm`` (spmd's own) the default group: every process of it calls this, at
    init or when healing remakes the world.  The collectives in it (the node layout, the
    installation check, the reliability machinery's start) are the same on every process,
    so survivors and the processes they started meet in them."""
    comm.Set_name(f"spmd:{name}")
    world_state.node_rank, world_state.node_size, host_size = node_layout(comm)
    _wait.set_oversubscribed(host_size > _usable_cores())
    world_state.store = store
    pg = ProcessGroup(comm, range(comm.Get_size()), name, seconds, spec, store=store)
    try:
        check_same_installation(pg.context, store, _installation())
    except BaseException:
        comm.Free()
        raise
    world_state.world = pg
    world_state.groups = [pg]
    GroupMember.WORLD = pg
    supervision.start(pg, reliability, op)
    return pg


def destroy_process_group(group: GroupArg = None) -> None:
    """Free ``group``'s communicator, or every group and the default one if None.

    After ``destroy_process_group()`` spmd can be initialised again.  Every member must
    call it; using a destroyed group raises RuntimeError.
    """
    if group is None:
        if world_state.world is None:
            raise RuntimeError("destroy_process_group: the default process group is not "
                               "initialized; call spmd.init_process_group() first")
        supervision.stop()
        for pg in reversed(world_state.groups):
            pg.release()
        world_state.groups = []
        world_state.world = None
        world_state.store = None
        _gpu.bind_device_id(None)
        GroupMember.WORLD = None
        return
    if isinstance(group, ProcessGroup) and group.context.comm is None:
        return  # already destroyed (also by destroying WORLD): a no-op, as in torch
    # resolve() refuses a group broken by a timeout; destroying it must still work.
    target: ProcessGroup | None
    if isinstance(group, ProcessGroup) and group.context.comm is not None:
        target = group
    else:
        target = resolve(group, "destroy_process_group")
    if target is None:
        return
    if target is world_state.world:
        destroy_process_group(None)
        return
    target.release()
    if target in world_state.groups:
        world_state.groups.remove(target)


def get_backend(group: GroupArg = None) -> Backend:
    """The backend string of ``group`` (the default group if None)."""
    pg = resolve(group, "get_backend")
    if pg is None:
        raise ValueError("get_backend: this rank is not a member of the group")
    if pg.context.backend_name == Backend.UNDEFINED:  # init's default, resolved when asked
        return Backend("cpu:mpi,cuda:nccl" if is_nccl_available() else "mpi")
    return Backend(pg.context.backend_name)


def get_rank(group: GroupArg = None) -> int:
    """This process's rank in ``group`` (global rank if None); -1 if not a member."""
    pg = world_state.world if group is None else group
    if pg is None:
        default_group("get_rank")
    if pg is GroupMember.NON_GROUP_MEMBER:
        return -1
    member = resolve(pg, "get_rank")
    assert member is not None  # resolve() gives None only for NON_GROUP_MEMBER
    return member.context.rank


def get_world_size(group: GroupArg = None) -> int:
    """The size of ``group`` (of the world if None); -1 if this rank is not a member."""
    pg = world_state.world if group is None else group
    if pg is None:
        default_group("get_world_size")
    if pg is GroupMember.NON_GROUP_MEMBER:
        return -1
    member = resolve(pg, "get_world_size")
    assert member is not None  # resolve() gives None only for NON_GROUP_MEMBER
    return member.context.size


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank among the ranks on its node.

    After init it comes from MPI (``Split_type(COMM_TYPE_SHARED)``); before init from
    the launcher's variables (LOCAL_RANK, MPI_LOCALRANKID, OMPI_COMM_WORLD_LOCAL_RANK,
    PMI_LOCAL_RANK, SLURM_LOCALID), else ``fallback_rank``.

    Raises:
        RuntimeError: not initialised, no launcher variable and no fallback given.
    """
    if world_state.world is not None:
        return world_state.node_rank
    local = local_rank_from_env()
    if local is not None:
        return local
    if fallback_rank is not None:
        return fallback_rank
    raise RuntimeError("get_node_local_rank: spmd is not initialized and no launcher variable "
                       f"({', '.join(LOCAL_RANK_VARS)}) is set; call spmd.init_process_group() "
                       "first or pass fallback_rank")
