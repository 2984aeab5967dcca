"""Engines: one method per op of the op table, each starting nonblocking work and returning a Work.

``base`` (the interface), ``registry`` (which engine serves which device), ``host`` (host
arrays: shared memory or MPI), ``mpi/``, ``shm/``, ``nccl/``, ``cuda_mpi`` (GPU arrays over MPI),
``checked`` (debug mode's wrapper), ``reduction`` (reduction rules every engine shares),
``staging`` (GPU buffers for MPI outside the engines)."""
