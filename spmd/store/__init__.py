"""Key-value stores with torch.distributed's (c10d) method names and semantics.

Ranks use a store to rendezvous and to exchange small pieces of data outside the
collectives.  Four kinds, all standard library only:

* :class:`~spmd.HashStore` -- in one process, shared between threads;
* :class:`~spmd.FileStore` -- a file on a (shared) file system, for processes;
* :class:`~spmd.TCPStore` -- a server in the master process, reached over TCP
  (defined in ``spmd.store.tcp``, importable from here);
* :class:`~spmd.PrefixStore` -- a namespace on top of another store.

Keys are ``str``; values are ``bytes`` (``str`` values are UTF-8 encoded).  Counters
made by :meth:`~spmd.Store.add` are stored as decimal ASCII, as in c10d, so ``get`` of a
counter returns e.g. ``b"5"``.  Timeouts are ``datetime.timedelta`` or seconds; a
timeout of 0 means "do not wait" (c10d reads 0 as "wait forever").
"""

from spmd.store.base import DEFAULT_TIMEOUT, HashStore, PrefixStore, Store
from spmd.store.file import FileStore
from spmd.store.tcp import TCPStore

__all__ = ["DEFAULT_TIMEOUT", "Store", "HashStore", "FileStore", "TCPStore", "PrefixStore"]
