"""Helpers for the store tests that run in other processes.

The worker functions are started by multiprocessing (spawn), so they must live in
an importable module.  Run as a script:

* ``python _store_helpers.py master HOST`` starts a TCPStore master, prints its
  port, and sleeps until killed;
* ``python _store_helpers.py serve HOST [--token T] [--nofile N]
  [--handshake-timeout S]`` starts a master (after lowering its soft
  RLIMIT_NOFILE to N), prints its port, then answers one line on stdout for each
  command line on stdin (see ``serve``) and exits at end of input.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def serve(argv: list) -> None:
    """A TCPStore master driven from stdin, for tests that watch it from outside.

    Commands, one per line, each answered by one line: ``rss`` (peak resident set
    in KiB), ``stats`` (JSON: handshakes pending, clients joined, descriptors open),
    ``ping`` (the master's own client adds 1 to a counter; prints the count),
    ``hog`` (opens /dev/null until descriptors run out; prints how many) and
    ``free`` (closes them again).
    """
    parser = argparse.ArgumentParser(prog="_store_helpers.py serve")
    parser.add_argument("host")
    parser.add_argument("--token")
    parser.add_argument("--nofile", type=int)
    parser.add_argument("--handshake-timeout", type=float)
    args = parser.parse_args(argv)
    if args.nofile is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))
    master = TCPStore(args.host, 0, is_master=True, wait_for_workers=False, timeout=30,
                      token=args.token, handshake_timeout=args.handshake_timeout)
    print(master.port, flush=True)
    hogged: list = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "rss":
            out = str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        elif cmd == "stats":
            server = master._server  # the test looks inside on purpose
            assert server is not None
            out = json.dumps({"pending": server.handshakes_pending(), "joined": server.joined,
                              "fds": len(os.listdir("/proc/self/fd"))})
        elif cmd == "ping":
            out = str(master.add("ping", 1))
        elif cmd == "hog":
            try:
                while True:
                    hogged.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            out = str(len(hogged))
        elif cmd == "free":
            for fd in hogged:
                os.close(fd)
            out, hogged = str(len(hogged)), []
        else:
            out = f"unknown command {cmd!r}"
        print(out, flush=True)
    master.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "master":
        master = TCPStore(sys.argv[2], 0, is_master=True, wait_for_workers=False, timeout=30)
        print(master.port, flush=True)
        while True:
            time.sleep(1)
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
        sys.exit(0)
    sys.exit(f"usage: {sys.argv[0]} master HOST | serve HOST [options]")
