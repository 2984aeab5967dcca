"""Helpers for tests/unit/test_store.py that run in other processes.

The worker functions are started by multiprocessing (spawn), so they must live in
an importable module.  Run as a script, ``python _store_helpers.py master HOST``
starts a TCPStore master, prints its port, and sleeps until killed.
"""

from __future__ import annotations

import os
import sys
import time

# Make ``spmd`` importable when run as a script from anywhere.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from spmd.store import FileStore, TCPStore  # noqa: E402


def open_store(spec):
    """Open a handle on a shared store: ("file", path, world_size) or ("tcp", host, port)."""
    if spec[0] == "file":
        return FileStore(spec[1], world_size=spec[2], timeout=30)
    return TCPStore(spec[1], spec[2], timeout=30)


def cas_increment(store, key: str, tag: str) -> int:
    """Increment the counter `key` ("<count>/<tag>") with a compare_set retry loop.

    The desired value carries a tag unique to this caller and attempt, so
    compare_set returning it proves that this call did the write (a plain count
    could have been written by another worker).  Returns the new count.
    """
    attempt = 0
    while True:
        current = store.get(key)
        count = int(current.split(b"/")[0]) + 1
        desired = f"{count}/{tag}.{attempt}".encode()
        if store.compare_set(key, current, desired) == desired:
            return count
        attempt += 1


def add_worker(spec, rank: int, n: int) -> None:
    """Add 1 to "counter" n times; publish the values add returned under vals/<rank>."""
    store = open_store(spec)
    values = [store.add("counter", 1) for _ in range(n)]
    store.set(f"vals/{rank}", ",".join(map(str, values)))
    store.close()


def cas_worker(spec, rank: int, n: int) -> None:
    """Increment the counter "cas" n times with compare_set; publish the counts reached."""
    store = open_store(spec)
    values = [cas_increment(store, "cas", f"{rank}.{i}") for i in range(n)]
    store.set(f"vals/{rank}", ",".join(map(str, values)))
    store.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "master":
        master = TCPStore(sys.argv[2], 0, is_master=True, wait_for_workers=False, timeout=30)
        print(master.port, flush=True)
        while True:
            time.sleep(1)
    sys.exit(f"usage: {sys.argv[0]} master HOST")
