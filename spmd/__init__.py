"""spmd: torch.distributed's process-group model for numpy arrays, on MPI.

Importing spmd initialises MPI through mpi4py (thread level MULTIPLE); set
``mpi4py.rc`` options before the import to change that.

The packages are the architecture (README.md, "Architecture"): ``core`` (foundations),
``store``, ``backends`` (engines), ``runtime`` (groups, the default group, the watchdog),
``api`` (the operations), ``torch`` (the torch.distributed backend), ``training``,
``layouts``, ``checkpoint``, ``spawn``, ``tools``, ``testing``.
"""

import sys

from spmd import checkpoint, store
from spmd._version import __version__ as __version__
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
from spmd.core import errors, futures
from spmd.core.errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    GroupBrokenError,
)
from spmd.core.flight_recorder import dump_flight_recorder
from spmd.core.futures import Future
from spmd.core.launch import LaunchInfo, launch_info
from spmd.core.ops import ReduceOp, make_premul_sum
from spmd.core.work import Work
from spmd.layouts import mesh, mpmd, parallel_state, topology
from spmd.layouts.mesh import DeviceMesh, init_device_mesh
from spmd.layouts.mpmd import Link, Program, get_programs, init_program, new_link
from spmd.layouts.topology import NodeTopology, bind_device, node_topology
from spmd.runtime import group
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

_make_nccl_premul_sum = make_premul_sum  # torch's spelling

# Public modules by their short names: ``dist.group.WORLD``, ``from spmd import
# parallel_state``, ``import spmd.parallel_state``, ``from spmd.mesh import DeviceMesh``.
for _short, _module in {"group": group, "errors": errors, "futures": futures, "mesh": mesh,
                        "parallel_state": parallel_state, "topology": topology, "mpmd": mpmd,
                        "coalescing": coalescing, "persistent": persistent,
                        "comms_log": comms_log, "trace": trace}.items():
    sys.modules.setdefault(f"spmd.{_short}", _module)
del _short, _module

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
