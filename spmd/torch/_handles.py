"""Reconfigure handles of the spmd backend, and the plan a set of them makes.

A handle names a process of a *world*, the communicator it is in now: the world's id
(agreed when the group was made), the process's rank and the world's size; for processes
``spmd.torch.spawn_peers`` started, the world that started them; on a world's rank 0, an
MPI port other worlds can connect to.  From the handles alone every process derives the
same :class:`ReconfigurePlan` (:func:`plan`), so a reconfigure needs no exchange to agree
on it:

1. the *base*: the world that started the spawned processes among the handles, else
   the world with the most processes listed (the first of those);
2. if the base has members not listed (dead, or left out), the listed ones shrink it;
3. processes spawn_peers started join through the link their start made: the starting
   world and all of them are listed;
4. any other world joins through its rank 0's port, all of it listed: processes started
   by the user or the scheduler;
5. ranks follow the handles' order (a list), or the base's order, then the others' (a set).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["Handle", "ReconfigurePlan", "plan"]

_PREFIX = "spmd:"
_OP = "reconfigure"


@dataclasses.dataclass(frozen=True)
class Handle:
    """One process of one world, as a reconfigure handle says."""

    world: str      # the id of the communicator the process is in
    rank: int       # its rank there
    size: int       # that world's size
    parent: str = ""   # the world that started it (spawn_peers), if one did
    port: str = ""     # on rank 0 of a world not started by spawn_peers: its MPI port

    def encode(self) -> str:
        fields: dict[str, Any] = {"w": self.world, "r": self.rank, "n": self.size}
        if self.parent:
            fields["s"] = self.parent
        if self.port:
            fields["p"] = self.port
        return _PREFIX + json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def decode(cls, text: object, where: str) -> Handle:
        """The handle ``text`` (``where`` names it in errors)."""
        if not isinstance(text, str) or not text.startswith(_PREFIX):
            raise ValueError(f"{_OP}: {where} is not a handle of the spmd backend (one "
                             f"get_reconfigure_handle() gave): {text!r:.80}")
        try:
            f = json.loads(text[len(_PREFIX):])
            h = cls(str(f["w"]), int(f["r"]), int(f["n"]), str(f.get("s", "")),
                    str(f.get("p", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{_OP}: {where} is not a well-formed spmd handle ({exc}): "
                             f"{text!r:.80}") from None
        if not 0 <= h.rank < h.size:
            raise ValueError(f"{_OP}: {where} says rank {h.rank} of a world of {h.size}")
        return h


@dataclasses.dataclass(frozen=True)
class ReconfigurePlan:
    """How a reconfigure builds its group (the same on every process: see the module)."""

    base: str                          # the world the others join
    base_size: int
    base_kept: tuple[int, ...]         # its ranks listed (all of them: no shrink)
    spawned: str                       # the world spawn_peers started, joining by its link
    by_port: tuple[tuple[str, str], ...]   # (world, port) of the others, in joining order
    order: tuple[Handle, ...]          # the processes in their new ranks' order

    def steps(self, me: Handle) -> list[tuple[str, str]]:
        """``me``'s part (spmd.runtime.heal.regroup_world's steps), after any shrink."""
        steps: list[tuple[str, str]] = []
        joined = me.world in (self.base, self.spawned)
        if self.spawned and joined:
            steps.append(("link", self.spawned))
        for world, port in self.by_port:
            if me.world == world:
                steps.append(("accept", port))
                joined = True
            elif joined:
                steps.append(("connect", port))
        return steps


def plan(handles: Sequence[Handle], ordered: bool) -> ReconfigurePlan:
    """The plan for ``handles`` (``ordered``: a list, whose order gives the ranks).

    Raises:
        ValueError: the handles cannot make one group (named in the message): a process
            listed twice, a world that disagrees with itself, spawned processes without
            their whole starting world, a world other than the base that is partly
            listed or has no port.
    """
    worlds: dict[str, list[Handle]] = {}
    for h in handles:
        worlds.setdefault(h.world, []).append(h)
    for world, hs in worlds.items():
        ranks = [h.rank for h in hs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{_OP}: world {world} lists rank(s) "
                             f"{sorted({r for r in ranks if ranks.count(r) > 1})} twice")
        if len({(h.size, h.parent) for h in hs}) != 1:
            raise ValueError(f"{_OP}: the handles of world {world} disagree on its size or "
                             "origin (handles of two different reconfigurations?)")
    spawned = [w for w, hs in worlds.items() if hs[0].parent]
    if len(spawned) > 1:
        raise ValueError(f"{_OP}: handles of {len(spawned)} groups of processes spawn_peers "
                         "started; one reconfigure joins one (start them in one call)")
    child = spawned[0] if spawned else ""
    if child:
        base = worlds[child][0].parent
        for world in (base, child):
            have = len(worlds.get(world, []))
            size = worlds[child][0].size if world == child else \
                (worlds[base][0].size if base in worlds else 0)
            if have != size or not have:
                raise ValueError(
                    f"{_OP}: processes spawn_peers started join together with the whole "
                    f"world that started them: {have} of {size or '?'} handles of world "
                    f"{world} given (shrink first, in a reconfigure of its own, then "
                    "spawn_peers)")
    else:
        base = max(worlds, key=lambda w: len(worlds[w]))   # the first of the largest
    by_port = []
    for world, hs in worlds.items():
        if world in (base, child):
            continue
        port = next((h.port for h in hs if h.rank == 0), "")
        if len(hs) != hs[0].size or not port:
            raise ValueError(f"{_OP}: world {world} joins through its rank 0's port, with "
                             f"all of its {hs[0].size} process(es): {len(hs)} handle(s) "
                             f"given, {'a' if port else 'no'} port")
        by_port.append((world, port))
    if ordered:
        order = tuple(handles)
    else:
        rest = [h for w, hs in worlds.items() if w not in (base, child) for h in hs]
        order = tuple(sorted(worlds[base], key=lambda h: h.rank) +
                      sorted(worlds.get(child, []), key=lambda h: h.rank) + rest)
    return ReconfigurePlan(base, worlds[base][0].size,
                           tuple(sorted(h.rank for h in worlds[base])), child, tuple(by_port),
                           order)
