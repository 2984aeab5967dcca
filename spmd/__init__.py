"""spmd: torch.distributed's process-group model for numpy arrays, on MPI.

Importing spmd initialises MPI through mpi4py (thread level MULTIPLE); set
``mpi4py.rc`` options before the import to change that.
"""

from . import (
    checkpoint,
    coalescing,
    comms_log,
    futures,
    mpmd,
    parallel_state,
    persistent,
    store,
    topology,
    trace,
)
from ._version import __version__ as __version__
from .bucket_reducer import BucketReducer
from .coalescing import coalescing_manager
from .collectives import (
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
from .debug import (
    DebugLevel,
    get_debug_level,
    set_debug_level,
    set_debug_level_from_env,
)
from .errors import (
    CollectiveMismatchError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    GroupBrokenError,
)
from .flight_recorder import dump_flight_recorder
from .futures import Future
from .group import (
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
from .launch import LaunchInfo, launch_info
from .mesh import DeviceMesh, init_device_mesh
from .monitored_barrier import monitored_barrier
from .mpmd import Link, Program, get_programs, init_program, new_link
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .ops import ReduceOp, make_premul_sum
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from .spawn import ProcessContext, spawn
from .store import FileStore, HashStore, PrefixStore, Store, TCPStore
from .topology import NodeTopology, bind_device, node_topology
from .work import Work
from .world import (
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

_make_nccl_premul_sum = make_premul_sum  # torch's spelling

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
