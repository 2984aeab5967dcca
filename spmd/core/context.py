"""What an engine and a Work know of their group: communicator, identity, timeout.

``spmd.runtime.group.ProcessGroup`` answers torch's API (``rank()``, ``size()``,
``timeout`` as a timedelta...) and holds one ``GroupContext``, its ``context``: the
plain fields below, which engines, Works, the flight recorder and the diagnosis read
and nothing else of the group layer.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from spmd.core.errors import GroupBrokenError, ProcessFailedError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["GroupContext", "set_broken_notice"]

# (group, reason): tells the group's other members that it broke here, so that an op
# they are in, or reach later, raises instead of completing against a rank that gave it
# up.  Set by the runtime (its control channel); None before init.
_tell_peers: Callable[[GroupContext, str], None] | None = None


def set_broken_notice(fn: Callable[[GroupContext, str], None] | None) -> None:
    global _tell_peers
    _tell_peers = fn


class GroupContext:
    """A group's communicator and identity, as its engines and Works see it.

    Read-only to its readers; each field is set once by the group layer except these:
    ``comm`` becomes None when the group is destroyed (:meth:`mark_destroyed`), ``error``
    is set once when a timeout breaks the group (:meth:`mark_broken`) or a member dies
    (:meth:`mark_failed`, which also sets ``failed``), and three fields
    hold the state of one lower module each (``op_counters``: the flight recorder;
    ``inherited``: the NCCL engine's split; ``bootstrap_seq``/``bootstrap_count``: the
    start-up exchange).

    Attributes:
        comm: the group's private communicator (None once destroyed).
        rank: this process's rank in the group.
        size: the group's size.
        ranks: the members' global ranks in group-rank order.
        index: global rank -> group rank, for the members.
        name: the group's name in messages.
        desc: the group's description.
        timeout: seconds a blocking operation may take.
        backend_name: the backend string (``"mpi"``, ``"cpu:mpi,cuda:nccl"``...).
        store: the key-value store given to init_process_group, or None.
        error: why the group is broken (a timeout, a dead member), or None.
        failed: the global ranks of the members that died, as the survivors agreed on
            them (:meth:`mark_failed`), or None.
        op_counters: the flight recorder's sequence counters of this group: collectives
            and point-to-point operations started (an int64 array the compiled call path
            writes too).
        inherited: device -> a communicator a split of the parent made for this
            group's engine of that device to adopt (NCCL's ``commSplit``).
        bootstrap_seq: the number the members agreed on for this group's store keys
            (None until its first start-up exchange through a store).
        bootstrap_count: how many start-up exchanges ran on this group.
        engines: the group's engines by device, each made at the first subscript of its
            device (an engine that moves device arrays through the host engine asks for
            it); None where no ProcessGroup holds the context.
        on_end: called once when the group is broken or destroyed (an engine that keeps
            a copy of the group's state, as the compiled call path does, closes it).
    """

    __slots__ = ("comm", "rank", "size", "ranks", "index", "name", "desc", "timeout",
                 "backend_name", "store", "error", "failed", "departed", "op_counters",
                 "inherited",
                 "bootstrap_seq", "bootstrap_count", "engines", "on_end",
                 "__weakref__")  # debug mode keeps per-group state in weak dicts

    def __init__(self, comm: MPI.Intracomm, ranks: Sequence[int], name: str, timeout: float,
                 backend: str, desc: str | None = None, store: Any = None):
        # None only once destroyed; every op checks that first (check_alive), so engines
        # read it as a communicator.
        self.comm: MPI.Intracomm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.ranks = tuple(int(r) for r in ranks)
        self.index = {g: i for i, g in enumerate(self.ranks)}
        self.name = name
        self.desc = desc or name
        self.timeout = timeout
        self.backend_name = backend
        self.store = store
        self.error: str | None = None
        self.failed: tuple[int, ...] | None = None
        self.departed: str | None = None
        self.op_counters = array("q", [0, 0])
        self.inherited: dict[str, Any] = {}
        self.bootstrap_seq: int | None = None
        self.bootstrap_count = 0
        self.engines: dict[str, Any] | None = None
        self.on_end: list[Callable[[], None]] = []

    def mark_broken(self, reason: str, *, tell_peers: bool = True) -> None:
        """A timeout broke the group: every later op on it raises GroupBrokenError.

        ``tell_peers``: tell the other members (False where they know already: the news
        came from one of them, or every survivor of a failure breaks its groups itself).
        """
        if self.error is None:
            self.error = reason
            self._ended()
            if tell_peers and _tell_peers is not None and self.size > 1:
                _tell_peers(self, reason)

    def mark_departed(self, reason: str) -> None:
        """A member's program ended (it exited): the group's collectives can no longer
        complete, so a wait for one raises (:meth:`wait_error`), while its other calls
        (``get_rank``, ``destroy``, point-to-point ops between the others) go on."""
        if self.departed is None:
            self.departed = reason
            self._ended()   # the compiled path stops taking its calls

    def wait_error(self, op: str, collective: bool = True) -> Exception | None:
        """Why a wait for ``op`` on this group cannot complete (it broke, a member died,
        or, for a collective, one exited), or None."""
        if self.error is not None or self.comm is None:
            try:
                self.check_alive(op)
            except Exception as exc:  # noqa: BLE001 - returned, the caller raises it
                return exc
        if self.departed is not None and collective:
            return GroupBrokenError(f"{op}: {self.departed}; the group's collectives can no "
                                    "longer complete: spmd.shrink_group() without the rank "
                                    "makes a group of the others "
                                    f"[rank {self.rank}, group {self.name}]")
        return None

    def break_for_departure(self) -> None:
        """A collective was given up because a member exited: the group breaks for that,
        on every member alike (each heard the exit itself: nobody to tell), before any
        other reason (the give-up's own) can."""
        if self.departed is not None:
            self.mark_broken(self.departed, tell_peers=False)

    def mark_failed(self, failed: tuple[int, ...]) -> None:
        """Members died (``failed``: their global ranks, agreed by the survivors): every
        later op on the group raises ProcessFailedError."""
        if self.failed is None:
            self.failed = tuple(sorted(failed))
            self.error = f"ranks {list(self.failed)} failed"
            self._ended()

    def failure_error(self, op: str) -> ProcessFailedError:
        """The ProcessFailedError of ``op`` on this failed group."""
        failed = self.failed or ()
        in_group = tuple(self.index[g] for g in failed if g in self.index)
        return ProcessFailedError(
            f"{op}: rank(s) {list(failed)} of group {self.name} failed (process died); the "
            f"survivors agreed on it. spmd.shrink_group({list(in_group)}, group) on every "
            f"survivor makes the group without them [rank {self.rank}, group {self.name}]",
            failed, in_group, op, self.name, self.rank)

    def mark_destroyed(self) -> None:
        """The group's communicator was freed: every later op on it raises."""
        self.comm = None  # type: ignore[assignment]  # (see the class docstring)
        self._ended()

    def _ended(self) -> None:
        callbacks, self.on_end = self.on_end, []
        for callback in callbacks:
            callback()

    def check_alive(self, op: str) -> None:
        """Raise if the group was destroyed or a timeout broke it."""
        if self.comm is None:
            raise RuntimeError(f"{op}: group {self.name} was destroyed (destroy_process_group, "
                               "or shrink_group replaced it)")
        if self.error is not None:
            if self.failed is not None:
                raise self.failure_error(op)
            raise GroupBrokenError(f"{op}: group {self.name} is broken since {self.error}; "
                                   "its ranks are out of step, so make a new group or restart "
                                   f"the job [rank {self.rank}, group {self.name}]")

    def group_rank(self, global_rank: int) -> int:
        """The group rank of a global rank; -1 for a non-member."""
        return self.index.get(global_rank, -1)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"<GroupContext {self.name} rank={self.rank} size={self.size}>"
