"""Process groups: MPI communicators split from the world, and rank translation."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypeAlias

from mpi4py import MPI

from spmd.backends.checked import free_check_comm
from spmd.backends.host import HostEngine
from spmd.backends.mpi import fastcall, faults
from spmd.backends.mpi.fastcall import GroupSlots, WorldSlots
from spmd.backends.registry import Backend, make_engine
from spmd.core.context import GroupContext
from spmd.core.timeouts import to_seconds
from spmd.core.typing import Timeout
from spmd.store import Store

__all__ = [
    "ProcessGroup",
    "GroupMember",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "GroupArg",
]

class Engines(dict):
    """A group's engines by device ("cpu", "cuda"), each made at the group's first array of
    its device (``backends/registry.py``).  Debug mode and ``coalescing_manager`` put
    theirs in an engine's place for a while.

    Whatever holds "cpu" sets the group's ``compiled`` (a field the public ops' compiled
    entry reads): the FastComm of the host engine itself, None for any other engine (a
    recorder or checker in its place takes its calls) and once the engines are cleared."""

    __slots__ = ("context", "_group")

    def __init__(self, context: GroupContext, group: ProcessGroup):
        super().__init__()
        self.context = context
        self._group = weakref.ref(group)   # (the group holds this table)

    def __missing__(self, device: str) -> Any:
        engine = self[device] = make_engine(self.context, device)
        return engine

    def __setitem__(self, device: str, engine: Any) -> None:
        super().__setitem__(device, engine)
        if device == "cpu":
            self._compiled(engine.fast if type(engine) is HostEngine else None)

    def clear(self) -> None:
        super().clear()
        self._compiled(None)

    def _compiled(self, fast: Any) -> None:
        group = self._group()
        if group is not None:
            group.compiled = fast


class ProcessGroup(GroupSlots):
    """A set of ranks that communicate together, backed by one MPI communicator.

    Groups are made by :func:`spmd.init_process_group` (the default group, WORLD),
    :func:`new_group`, :func:`new_subgroups`, :func:`split_group` and the mesh helpers.
    ``rank()`` and ``size()`` are this process's rank in the group and the group's
    size; ``ranks`` lists the members' global ranks in group-rank order; ``comm`` is
    the group's private mpi4py communicator for users who need raw MPI (spmd's own
    traffic runs on it, so match collectives with care).  ``context`` is what the
    group's engines and Works read of it (:class:`spmd.core.context.GroupContext`).
    """

    def __init__(self, comm: MPI.Intracomm, ranks: Sequence[int], name: str,
                 timeout: float, backend: str, desc: str | None = None,
                 store: Store | None = None):
        self.context = GroupContext(comm, ranks, name, timeout, backend, desc, store)
        # device -> engine, made at the first array of that device: the public ops look
        # their engine up here (a dict subscript, no call, once the engine exists).
        self.engines = self.context.engines = Engines(self.context, self)

    def rank(self) -> int:
        """This process's rank in the group."""
        return self.context.rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self.context.size

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the members, in group-rank order."""
        return list(self.context.ranks)

    @property
    def name(self) -> str:
        return self.context.name

    group_name = name

    @property
    def group_desc(self) -> str:
        return self.context.desc

    @property
    def comm(self) -> MPI.Intracomm:
        """The group's mpi4py communicator (a private one, not the user's COMM_WORLD)."""
        self.context.check_alive("comm")
        return self.context.comm

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.context.timeout)

    def engine_for(self, device: str) -> Any:
        """The group's engine for arrays on ``device`` ("cpu", "cuda"): ``engines[device]``,
        for tools and tests (the public ops subscript ``engines``)."""
        return self.engines[device]

    def release(self) -> None:
        """Free the group's engines and its communicator (what destroy_process_group runs
        on every member).  A group a member of died, or one revoked because a rank died
        (ULFM), is aborted instead: freeing would wait for the dead.  So is a broken
        group: an op given up on it may still be pending in MPI (held by
        spmd.backends.mpi.orphans), and a freed communicator's context id can go to a
        new one, whose messages that op would then take."""
        ctx = self.context
        if ctx.failed is not None or ctx.error is not None or (
                ctx.comm is not None and faults.ulfm() and ctx.comm.Is_revoked()):
            self.abort()
            return
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
        free_check_comm(ctx)  # debug mode's, also where no engine was made (objects)
        if ctx.comm is not None:
            ctx.comm.Free()
            ctx.mark_destroyed()

    def abort(self) -> None:
        """End the group on this rank alone, waiting for no other (a member died, or
        shrink_group replaced it): engines dropped, communicators left unfreed (freeing
        one may wait for the dead), every later use raises."""
        for engine in self.engines.values():
            engine.abort()
        self.engines.clear()
        ctx = self.context
        if ctx.comm is not None:
            aborted.append(ctx.comm)
            ctx.mark_destroyed()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.context.name} rank={self.context.rank} size={self.context.size}>"


class _NonGroupMember:
    """What group constructors return on ranks outside the group (torch's sentinel)."""

    name = "NON_GROUP_MEMBER"

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"

    def __bool__(self) -> bool:
        return False


# What a ``group`` argument takes: a ProcessGroup, None for the default group, or the
# sentinel non-members get from the group constructors (the op then returns None).
GroupArg: TypeAlias = ProcessGroup | _NonGroupMember | None


class GroupMember:
    """``GroupMember.WORLD`` is the default group (None before init);
    ``GroupMember.NON_GROUP_MEMBER`` is what non-members get from group constructors."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = _NonGroupMember()


class WorldState(WorldSlots):
    """The groups init_process_group and the group constructors made, in one place."""

    def __init__(self) -> None:
        self.world: ProcessGroup | None = None
        self.groups: list[ProcessGroup] = []
        self.store: Store | None = None
        self.node_rank = 0
        self.node_size = 1
        # What healing needs (spmd.runtime.heal): the world's size when it was made, this
        # process's rank in it (kept while shrinking renumbers the ranks), the ranks the
        # last healing gave to new processes, whether this process is one of them, and
        # whether it still waits for the program's state (a new process, until
        # heal_state gave it: it can never be the state's source).
        self.full_size = 1
        self.home_rank = 0
        self.replaced: tuple[int, ...] = ()
        self.is_replacement = False
        self.awaiting_state = False


world_state = WorldState()
# The public ops' compiled entry finds the default group here (WorldSlots' field).
fastcall.set_world(world_state)
# Communicators of aborted groups: never freed, kept referenced so nothing frees them.
aborted: list = []
NON_GROUP_MEMBER = GroupMember.NON_GROUP_MEMBER



def __getattr__(name: str):
    # ``spmd.runtime.group.WORLD`` follows init/destroy, like torch's ``dist.group.WORLD``.
    if name == "WORLD":
        return world_state.world
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _not_initialized(op: str) -> RuntimeError:
    return RuntimeError(f"{op}: the default process group is not initialized; "
                        "call spmd.init_process_group() first")


def default_group(op: str) -> ProcessGroup:
    pg = world_state.world
    if pg is None:
        raise _not_initialized(op)
    return pg


def resolve(group: GroupArg, op: str) -> ProcessGroup | None:
    """The group an op runs on: the default one for None; None for a non-member.

    A rank that is not a member of ``group`` gets a warning and the op returns None
    without communicating, as torch does.
    """
    if group is None:
        pg = world_state.world
        if pg is None:
            raise _not_initialized(op)
        if pg.context.error is not None:
            pg.context.check_alive(op)
        return pg
    if type(group) is ProcessGroup:
        ctx = group.context
        if ctx.comm is None or ctx.error is not None:
            ctx.check_alive(op)
        return group
    if group is GroupMember.NON_GROUP_MEMBER:
        if world_state.world is None:
            raise _not_initialized(op)
        warnings.warn(f"Running {op} on global rank {world_state.world.context.rank} which "
                      "does not belong to the given group.", stacklevel=3)
        return None
    if isinstance(group, ProcessGroup):
        ctx = group.context
        if ctx.comm is None or ctx.error is not None:
            ctx.check_alive(op)
        return group
    raise TypeError(f"{op}: group must be a ProcessGroup or None, got {type(group).__name__}")


def timeout_seconds(timeout, op: str) -> float:
    """A new group's timeout in seconds: the default group's if None."""
    if timeout is None:
        world = world_state.world
        assert world is not None  # the callers found the default group first
        return world.context.timeout
    return to_seconds(timeout, op, positive=True)


def backend_name_of(backend, op: str) -> str:
    if backend is None:
        world = world_state.world
        assert world is not None  # the callers found the default group first
        return world.context.backend_name
    Backend(backend)  # validates the spelling
    return str(backend).lower()


def _ranks_name(ranks: Sequence[int]) -> str:
    if len(ranks) <= 8:
        return "ranks[" + ",".join(map(str, ranks)) + "]"
    return f"ranks[{ranks[0]},{ranks[1]},...,{ranks[-1]}]({len(ranks)})"


def register_group(comm, ranks, name, timeout, backend, desc) -> ProcessGroup:
    pg = ProcessGroup(comm, ranks, name, timeout, backend, desc, world_state.store)
    world_state.groups.append(pg)
    return pg


def _check_rank_list(ranks, world_size: int, op: str, arg: str = "ranks") -> list[int]:
    if not isinstance(ranks, (list, tuple, range)):
        raise TypeError(f"{op}: {arg} must be a list of ints, got {type(ranks).__name__}")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{op}: {arg} must hold ints, got {type(r).__name__}")
        if not 0 <= r < world_size:
            raise ValueError(f"{op}: rank {r} in {arg} is out of range [0, {world_size})")
        out.append(int(r))
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: {arg} has duplicates: {list(ranks)}")
    return out


def new_group(ranks: Sequence[int] | None = None, timeout: Timeout | None = None,
              backend: str | None = None, pg_options: object = None,
              use_local_synchronization: bool = False, group_desc: str | None = None,
              device_id: object = None, sort_ranks: bool = True,
              ) -> ProcessGroup | _NonGroupMember:
    """Create a group of the given global ranks (all ranks if None).

    Only the members need to call it (it uses ``MPI_Comm_create_group``); when every
    rank calls it, non-members get ``GroupMember.NON_GROUP_MEMBER`` back without
    communicating.  Members must create their groups in the same order and pass the
    same ``ranks``.  Group ranks follow the sorted global ranks, as in torch, or the
    order of ``ranks`` with ``sort_ranks=False``.

    Raises:
        ValueError: a rank is out of range or listed twice.
    """
    world = default_group("new_group")
    world.context.check_alive("new_group")   # a group is made from a working WORLD
    seconds = timeout_seconds(timeout, "new_group")
    name = backend_name_of(backend, "new_group")
    if ranks is None:
        ranks = list(range(world.context.size))
    members = _check_rank_list(ranks, world.context.size, "new_group")
    if sort_ranks:
        members.sort()
    if world.context.rank not in members:
        return GroupMember.NON_GROUP_MEMBER
    mpi_group = world.context.comm.Get_group().Incl(members)
    # The tag keeps concurrent creations of different groups on one rank apart.
    tag = hash(tuple(members)) % 32768
    try:
        comm = world.context.comm.Create_group(mpi_group, tag)
    finally:
        mpi_group.Free()
    label = group_desc or _ranks_name(members)
    return register_group(comm, members, label, seconds, name, group_desc)


def _parent_ranks(comm, parent_comm) -> list[int]:
    """The parent ranks of ``comm``'s ranks, in order, from the two MPI groups: local,
    where an allgather over the new communicator would be one more collective per split."""
    mine, theirs = comm.Get_group(), parent_comm.Get_group()
    try:
        return MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), theirs)
    finally:
        mine.Free()
        theirs.Free()


def split_comm(parent: ProcessGroup, color: int, key: int, name_of, timeout, backend, desc, op):
    """One ``Comm.Split`` of ``parent``: every member of parent must call it."""
    parent.context.check_alive(op)   # a failed or broken parent cannot split
    comm = parent.context.comm.Split(color, key)
    pg = None
    if comm != MPI.COMM_NULL:
        members = [parent.context.ranks[r] for r in _parent_ranks(comm, parent.context.comm)]
        pg = register_group(comm, members, name_of(members), timeout_seconds(timeout, op),
                       backend_name_of(backend, op), desc)
    for engine in list(parent.engines.values()):  # e.g. NCCL's commSplit, collective
        engine.on_split(pg.context if pg is not None else None, color, key)  # over the parent
    return pg


def new_subgroups(group_size: int | None = None, group: GroupArg = None,
                  timeout: Timeout | None = None, backend: str | None = None,
                  pg_options: object = None, group_desc: str | None = None,
                  ) -> tuple[ProcessGroup, list[ProcessGroup | _NonGroupMember]]:
    """Split a group (WORLD by default) into subgroups of ``group_size`` consecutive ranks.

    Every rank of ``group`` must call it.  ``group_size`` defaults to the number of
    ranks on this node.  Built with one ``Comm.Split``.

    Returns:
        (this rank's subgroup, list of all subgroups); entries of subgroups this rank
        is not in are ``GroupMember.NON_GROUP_MEMBER``.
    """
    parent = resolve(group, "new_subgroups") if group is not None else default_group("new_subgroups")
    if parent is None:
        raise ValueError(f"new_subgroups: this rank is not a member of group {group!r}")
    if group_size is None:
        group_size = world_state.node_size
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"new_subgroups: group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0 or parent.context.size % group_size:
        raise ValueError(f"new_subgroups: group_size ({group_size}) must be positive and divide "
                         f"the group size ({parent.context.size}) [group {parent.context.name}]")
    count = parent.context.size // group_size
    ranks_lists = [list(parent.context.ranks[i * group_size:(i + 1) * group_size]) for i in range(count)]
    mine = parent.context.rank // group_size
    label = group_desc or "subgroup"
    pg = split_comm(parent, mine, parent.context.rank, lambda m: f"{label}:{mine}", timeout, backend,
                group_desc, "new_subgroups")
    subgroups = [pg if i == mine else GroupMember.NON_GROUP_MEMBER for i in range(len(ranks_lists))]
    return pg, subgroups


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: Timeout | None = None, backend: str | None = None,
                                 pg_options: object = None, group_desc: str | None = None,
                                 ) -> tuple[ProcessGroup | None,
                                            list[ProcessGroup | _NonGroupMember]]:
    """Create one subgroup per list of global ranks; the lists must not overlap.

    Every rank must call it.  Built with one ``Comm.Split`` of WORLD.

    Returns:
        (this rank's subgroup or None, list of all subgroups).
    """
    world = default_group("new_subgroups_by_enumeration")
    if not isinstance(ranks_per_subgroup_list, (list, tuple)) or not ranks_per_subgroup_list:
        raise ValueError("new_subgroups_by_enumeration: ranks_per_subgroup_list must be a "
                         "non-empty list of lists of ranks")
    owner: dict[int, int] = {}
    for i, ranks in enumerate(ranks_per_subgroup_list):
        for r in _check_rank_list(ranks, world.context.size, "new_subgroups_by_enumeration",
                                  f"ranks_per_subgroup_list[{i}]"):
            if r in owner:
                raise ValueError(f"new_subgroups_by_enumeration: rank {r} is in subgroups "
                                 f"{owner[r]} and {i}; subgroups must not overlap")
            owner[r] = i
    mine = owner.get(world.context.rank, MPI.UNDEFINED)
    label = group_desc or "subgroup"
    pg = split_comm(world, mine, world.context.rank, lambda m: f"{label}:{mine}", timeout, backend,
                group_desc, "new_subgroups_by_enumeration")
    subgroups = [pg if i == mine else GroupMember.NON_GROUP_MEMBER
                 for i in range(len(ranks_per_subgroup_list))]
    return pg, subgroups


def split_group(parent_pg: GroupArg = None, split_ranks: Sequence[Sequence[int]] | None = None,
                timeout: Timeout | None = None, pg_options: object = None,
                group_desc: str | None = None, backend: str | None = None,
                ) -> ProcessGroup | None:
    """Split ``parent_pg`` (WORLD by default) into disjoint groups of its group ranks.

    Every rank of the parent must call it with the same ``split_ranks`` (lists of group
    ranks in the parent).  Built with one ``Comm.Split``.

    Returns:
        The group this rank belongs to, or None if it is in no split.
    """
    parent = resolve(parent_pg, "split_group") if parent_pg is not None else default_group("split_group")
    if parent is None:
        return None
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise ValueError("split_group: split_ranks must be a non-empty list of lists of group ranks")
    owner: dict[int, int] = {}
    for i, ranks in enumerate(split_ranks):
        for r in _check_rank_list(ranks, parent.context.size, "split_group", f"split_ranks[{i}]"):
            if r in owner:
                raise ValueError(f"split_group: group rank {r} is in splits {owner[r]} and {i}; "
                                 "splits must not overlap")
            owner[r] = i
    mine = owner.get(parent.context.rank, MPI.UNDEFINED)
    return split_comm(parent, mine, parent.context.rank, lambda m: group_desc or _ranks_name(m), timeout,
                  backend, group_desc, "split_group")


def get_process_group_ranks(group: GroupArg) -> list[int]:
    """Global ranks of the members of ``group``, in group-rank order."""
    pg = resolve(group, "get_process_group_ranks")
    if pg is None:
        return []
    return list(pg.context.ranks)


def get_group_rank(group: GroupArg, global_rank: int) -> int:
    """Translate a global rank to its rank in ``group``.

    Raises:
        ValueError: ``global_rank`` is not a member of ``group``.
    """
    pg = resolve(group, "get_group_rank") if group is not None else default_group("get_group_rank")
    r = pg.context.group_rank(global_rank) if pg is not None else -1
    if r < 0:
        raise ValueError(f"get_group_rank: global rank {global_rank} is not part of group "
                         f"{getattr(group, 'name', group)}")
    return r


def get_global_rank(group: GroupArg, group_rank: int) -> int:
    """Translate a rank in ``group`` to its global rank.

    Raises:
        ValueError: ``group_rank`` is out of range for ``group``.
    """
    pg = resolve(group, "get_global_rank") if group is not None else default_group("get_global_rank")
    if pg is None or not 0 <= group_rank < pg.context.size:
        size = pg.context.size if pg is not None else 0
        raise ValueError(f"get_global_rank: group rank {group_rank} is out of range [0, {size}) "
                         f"for group {getattr(group, 'name', group)}")
    return pg.context.ranks[group_rank]
