"""Sharded checkpoints over MPI-IO: one ``.npy`` file per array, readable by plain numpy.

``save``/``load``: :mod:`spmd.checkpoint.save_load`; the index and its checks:
:mod:`spmd.checkpoint.index`; the blocks ranks hold: :mod:`spmd.checkpoint.shard`; how
blocks are named and fitted together: :mod:`spmd.checkpoint.plan`; collective ``.npy``
I/O: :mod:`spmd.checkpoint.mpiio`.
"""

from spmd.checkpoint.index import INDEX_FILE, VALUES_FILE
from spmd.checkpoint.save_load import load, save
from spmd.checkpoint.shard import Shard

__all__ = ["INDEX_FILE", "VALUES_FILE", "Shard", "load", "save"]
