"""spmd: torch.distributed's process-group model for numpy arrays, on MPI.

Importing spmd starts nothing: the public names below are loaded on first use, and MPI
initialises when the first of them that needs it is (``init_process_group``, mpi4py's
own rule: ``from mpi4py import MPI`` starts it, at thread level MULTIPLE unless
``mpi4py.rc`` says otherwise).  A process that imports spmd and never uses it pays for
no MPI.

The packages are the architecture (docs/architecture.md): ``core`` (foundations),
``store``, ``backends`` (engines), ``runtime`` (groups, the default group, the watchdog),
``api`` (the operations), ``torch`` (the torch.distributed backend), ``training``,
``layouts``, ``checkpoint``, ``spawn``, ``tools``, ``testing``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import pathlib
import sys
from typing import TYPE_CHECKING, Any

from spmd._version import __version__ as __version__

# The public API, as the type checker and the reader see it.  At run time nothing
# here is imported: _LAZY (read from these very lines) says which module each name
# comes from, and __getattr__ imports it when the name is first used.
if TYPE_CHECKING:
    from spmd import checkpoint, store
    from spmd.api import coalescing, persistent
    from spmd.api.coalescing import coalescing_manager
    from spmd.api.collectives import (
        all_gather,
        all_gather_coalesced,
        all_gather_into_tensor,
        all_reduce,
        all_reduce_coalesced,
        all_to_all,
        all_to_all_single,
        barrier,
        broadcast,
        gather,
        reduce,
        reduce_scatter,
        reduce_scatter_tensor,
        scatter,
    )
    from spmd.api.monitored_barrier import monitored_barrier
    from spmd.api.objects import (
        all_gather_object,
        broadcast_object_list,
        gather_object,
        recv_object_list,
        scatter_object_list,
        send_object_list,
    )
    from spmd.api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
    from spmd.core import errors as errors
    from spmd.core import futures
    from spmd.core.errors import (
        CollectiveMismatchError,
        DistBackendError,
        DistError,
        DistNetworkError,
        DistStoreError,
        DistTimeoutError,
        GroupBrokenError,
        ProcessFailedError,
    )
    from spmd.core.flight_recorder import dump_flight_recorder
    from spmd.core.futures import Future
    from spmd.core.launch import LaunchInfo, launch_info
    from spmd.core.ops import ReduceOp, make_premul_sum
    from spmd.core.work import Work
    from spmd.layouts import mesh as mesh
    from spmd.layouts import mpmd, parallel_state, topology
    from spmd.layouts.mesh import DeviceMesh, init_device_mesh, rebuild_device_mesh
    from spmd.layouts.mpmd import Link, Program, get_programs, init_program, new_link
    from spmd.layouts.topology import NodeTopology, bind_device, node_topology
    from spmd.runtime import group as group
    from spmd.runtime.debug import (
        DebugLevel,
        get_debug_level,
        set_debug_level,
        set_debug_level_from_env,
    )
    from spmd.runtime.group import (
        GroupMember,
        ProcessGroup,
        get_global_rank,
        get_group_rank,
        get_process_group_ranks,
        new_group,
        new_subgroups,
        new_subgroups_by_enumeration,
        split_group,
    )
    from spmd.runtime.heal import heal, heal_state, is_replacement
    from spmd.runtime.shrink import (
        SHRINK_ABORT,
        SHRINK_DEFAULT,
        fault_tolerant,
        get_failed_ranks,
        shrink_group,
    )
    from spmd.runtime.world import (
        Backend,
        destroy_process_group,
        get_backend,
        get_node_local_rank,
        get_rank,
        get_world_size,
        init_process_group,
        is_available,
        is_initialized,
        is_mpi_available,
        is_nccl_available,
        register_backend,
    )
    from spmd.spawn import ProcessContext, spawn
    from spmd.store import FileStore, HashStore, PrefixStore, Store, TCPStore
    from spmd.tools import comms_log, trace
    from spmd.training.bucket_reducer import BucketReducer


def _lazy_table() -> dict[str, tuple[str, str | None]]:
    """{public name: (module, attribute or None for the module itself)}, read from the
    TYPE_CHECKING imports above: one list of the public API, not two."""
    tree = ast.parse(pathlib.Path(__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    table: dict[str, tuple[str, str | None]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            name = alias.asname or alias.name
            if node.module == "spmd":   # a subpackage: from spmd import checkpoint
                table[name] = (f"spmd.{alias.name}", None)
            else:
                table[name] = (node.module, alias.name)
    return table


_LAZY = _lazy_table()

# Public modules by their short names: ``dist.group.WORLD``, ``from spmd import
# parallel_state``, ``import spmd.parallel_state``, ``from spmd.mesh import DeviceMesh``.
_SHORT_MODULES = {short: ".".join(_LAZY[short]) for short in (  # type: ignore[arg-type]
    "group", "errors", "futures", "mesh", "parallel_state", "topology", "mpmd",
    "coalescing", "persistent", "comms_log", "trace")}
_ALIASES = {"_make_nccl_premul_sum": "make_premul_sum"}  # torch's spelling


def __getattr__(name: str) -> Any:
    if name in _ALIASES:
        value = __getattr__(_ALIASES[name])
    elif name in _LAZY:
        module, attribute = _LAZY[name]
        value = importlib.import_module(module)
        if attribute is not None:
            try:
                value = getattr(value, attribute)
            except AttributeError:   # a submodule: from spmd.runtime import group
                value = importlib.import_module(f"{module}.{attribute}")
    else:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    globals()[name] = value    # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_ALIASES))


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import spmd.parallel_state`` is ``spmd.layouts.parallel_state``: the same module
    object under its short name, imported when first asked for."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, short = fullname.rpartition(".")
        if package != "spmd" or short not in _SHORT_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_SHORT_MODULES[spec.name.rpartition(".")[2]])
        spec.loader_state = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module) -> None:
        # Already executed under its full name; the import machinery has just put this
        # short name's spec on it: give it back its own.
        module.__spec__, module.__loader__ = module.__spec__.loader_state


sys.meta_path.append(_ShortNames())


# spmd.spawn is the function (torch's spawn); the subpackage of the same name is reached
# by its import path (from spmd.spawn import ProcessRaisedException).  Bound now, as the
# import system sets a subpackage on its parent when it is first imported: the function
# must come after it.  (spmd.spawn imports no MPI: only the ranks it starts do.)
from spmd.spawn import spawn as spawn  # noqa: E402, I001 - after the finder (above)

# In a job started with ULFM fault tolerance, spmd finalizes MPI itself (before MPI starts,
# so at import): spmd.core.mpi_exit says why.  Elsewhere it does nothing.
from spmd.core.mpi_exit import prepare as _prepare_mpi_exit  # noqa: E402, I001

_prepare_mpi_exit()

__all__ = [
    "Backend",
    "BucketReducer",
    "CollectiveMismatchError",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "FileStore",
    "Future",
    "GroupBrokenError",
    "GroupMember",
    "ProcessFailedError",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "HashStore",
    "LaunchInfo",
    "Link",
    "NodeTopology",
    "P2POp",
    "PrefixStore",
    "ProcessContext",
    "ProcessGroup",
    "Program",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "bind_device",
    "broadcast",
    "broadcast_object_list",
    "checkpoint",
    "coalescing",
    "coalescing_manager",
    "comms_log",
    "destroy_process_group",
    "dump_flight_recorder",
    "futures",
    "gather",
    "gather_object",
    "get_backend",
    "get_debug_level",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_programs",
    "get_rank",
    "get_failed_ranks",
    "fault_tolerant",
    "shrink_group",
    "heal",
    "heal_state",
    "is_replacement",
    "rebuild_device_mesh",
    "get_world_size",
    "init_device_mesh",
    "init_process_group",
    "init_program",
    "irecv",
    "is_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "isend",
    "launch_info",
    "make_premul_sum",
    "monitored_barrier",
    "mpmd",
    "new_group",
    "new_link",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "node_topology",
    "parallel_state",
    "persistent",
    "recv",
    "recv_object_list",
    "register_backend",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "spawn",
    "set_debug_level",
    "set_debug_level_from_env",
    "split_group",
    "store",
    "topology",
    "trace",
]
