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

import importlib
from typing import Any

from spmd._version import __version__ as __version__
from spmd.backends.mpi.finalize import prepare as _prepare_mpi_finalize
from spmd.core import settings as _settings
from spmd.core import startup as _startup

# spmd.spawn is the function (torch's spawn); the subpackage of the same name is reached
# by its import path (from spmd.spawn import ProcessRaisedException).  The import system
# sets a subpackage on its parent when it is first imported: the function is bound after
# it.  (spmd.spawn imports no MPI: only the ranks it starts do.)
from spmd.spawn import spawn as spawn

# In a job started with ULFM fault tolerance, spmd finalizes MPI itself (before MPI starts,
# so at import): spmd.backends.mpi.finalize says why.  Elsewhere it does nothing.
_prepare_mpi_finalize()


def _tools_from_settings() -> None:
    """The tools a setting turns on for the whole run, loaded at init_process_group
    (they read their setting when loaded; loading them starts MPI, so not at import)."""
    for name, module in (("SPMD_COMMS_LOG", "spmd.tools.comms_log"),
                         ("SPMD_TRACE", "spmd.tools.trace")):
        if _settings.read(name):
            importlib.import_module(module)


_startup.at_init(_tools_from_settings)

# The public API, the one list of it: the names each module gives spmd.  __all__,
# dir(spmd) and the lazy imports below come from here; spmd/__init__.pyi is what type
# checkers read instead, and tests/unit/test_package_face.py holds the two equal.
_NAMES = {
    "spmd.api.coalescing": "coalescing_manager",
    "spmd.api.collectives": """all_gather all_gather_coalesced all_gather_into_tensor
        all_reduce all_reduce_coalesced all_to_all all_to_all_single barrier broadcast
        gather reduce reduce_scatter reduce_scatter_tensor scatter""",
    "spmd.api.monitored_barrier": "monitored_barrier",
    "spmd.api.objects": """all_gather_object broadcast_object_list gather_object
        recv_object_list scatter_object_list send_object_list""",
    "spmd.api.p2p": "P2POp batch_isend_irecv irecv isend recv send",
    "spmd.core.errors": """CollectiveMismatchError DistBackendError DistError
        DistNetworkError DistStoreError DistTimeoutError GroupBrokenError ProcessFailedError""",
    "spmd.core.flight_recorder": "dump_flight_recorder",
    "spmd.core.futures": "Future",
    "spmd.core.launch": "LaunchInfo launch_info",
    "spmd.core.ops": "ReduceOp make_premul_sum",
    "spmd.core.work": "Work",
    "spmd.layouts.mesh": "DeviceMesh init_device_mesh rebuild_device_mesh",
    "spmd.layouts.mpmd": "Link Program get_programs init_program new_link",
    "spmd.layouts.topology": "NodeTopology bind_device node_topology",
    "spmd.runtime.debug": "DebugLevel get_debug_level set_debug_level set_debug_level_from_env",
    "spmd.runtime.group": """GroupMember ProcessGroup get_global_rank get_group_rank
        get_process_group_ranks new_group new_subgroups new_subgroups_by_enumeration
        split_group""",
    "spmd.runtime.heal": "heal heal_state is_replacement",
    "spmd.runtime.shrink": "SHRINK_ABORT SHRINK_DEFAULT fault_tolerant get_failed_ranks "
                           "shrink_group",
    "spmd.runtime.world": """Backend destroy_process_group get_backend get_node_local_rank
        get_rank get_world_size init_process_group is_available is_initialized
        is_mpi_available is_nccl_available register_backend""",
    "spmd.spawn": "ProcessContext spawn",
    "spmd.store": "FileStore HashStore PrefixStore Store TCPStore",
    "spmd.training.bucket_reducer": "BucketReducer",
}
# Public modules, named by their last part.  Those that live deeper than spmd.<name> are
# also importable under that short name (import spmd.parallel_state, from spmd.mesh import
# DeviceMesh): spmd/<name>.py puts the module itself into sys.modules under it, so either
# path gives the same module object.
_MODULES = """spmd.checkpoint spmd.store spmd.api.coalescing spmd.api.persistent
    spmd.core.errors spmd.core.futures spmd.layouts.mesh spmd.layouts.mpmd
    spmd.layouts.parallel_state spmd.layouts.topology spmd.runtime.group
    spmd.tools.comms_log spmd.tools.trace""".split()
_ALIASES = {"_make_nccl_premul_sum": "make_premul_sum"}  # torch's spelling

# {public name: (module, attribute, or None for the module itself)}
_LAZY: dict[str, tuple[str, str | None]] = {
    **{name: (module, name) for module, names in _NAMES.items() for name in names.split()},
    **{module.rpartition(".")[2]: (module, None) for module in _MODULES},
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _ALIASES:
        value = __getattr__(_ALIASES[name])
    elif name in _LAZY:
        module, attribute = _LAZY[name]
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
    else:
        raise AttributeError(f"module 'spmd' has no attribute {name!r}")
    globals()[name] = value    # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_ALIASES))

