"""The flight recorder's ring (spmd.core.flight_recorder): preallocated columns, entries
made only when read, in-flight operations kept when the ring wraps over them, and a
reader on another thread never seeing a slot half written.  The compiled call path
writes the same ring: tests/engines/test_fastcall.py."""

from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

from spmd.core.context import GroupContext
from spmd.core.flight_recorder import FlightRecorder, counters


def _group(name: str = "g") -> GroupContext:
    return GroupContext(MPI.COMM_SELF, [0], name, 30.0, "mpi")


def test_the_ring_keeps_the_last_operations_in_order():
    rec, g = FlightRecorder(16), _group()
    a = np.zeros(5, np.int16)
    numbers = []
    for i in range(40):
        n = rec.begin("all_reduce" if i % 2 else "send", g, None if i % 3 == 1 else a)
        rec.end(n, failed=i == 39)
        numbers.append(n)
    entries = rec.entries()
    assert [e.number for e in entries] == numbers[-16:]
    assert counters(g) == (20, 20)            # collectives and p2p numbered on their own
    last = entries[-1]
    assert (last.op, last.kind, last.seq, last.size, last.dtype) == \
        ("all_reduce", "collective", 20, 5, np.int16)
    assert last.state() == "failed" and entries[-2].state() == "completed"
    assert entries[-2].kind == "p2p" and entries[-2].seq == 20
    assert all(e.t0 <= e.t1 for e in entries)
    none = [e for e in entries if e.number % 3 == 1]
    assert none and all(e.size is None and e.dtype is None for e in none)


def test_an_operation_in_flight_outlives_its_slot():
    rec, g = FlightRecorder(16), _group()
    slow = rec.begin("recv", g, None)
    for _ in range(20):       # the ring wraps over the slot of the waiting receive
        rec.end(rec.begin("all_reduce", g, None))
    assert [e.op for e in rec.in_flight()] == ["recv"]
    rec.mark_timed_out(slow)
    (e,) = rec.in_flight()
    assert e.timed_out and e.number == slow and rec.entry(slow) is e
    assert rec.seq_of(slow) == 1
    rec.end(slow)
    assert rec.in_flight() == [] and rec.entry(slow) is None
    assert len(rec.entries()) == 16


def test_resize_hands_the_new_ring_to_listeners():
    rec, seen = FlightRecorder(16), []
    rec.listeners.append(seen.append)
    rec.resize(3)
    assert rec.size == 16 and seen == [rec.ring]   # at least 16 entries
    rec.resize(100)
    assert rec.size == 100 and seen[-1] is rec.ring and seen[-1].capacity == 100


def test_a_reader_thread_never_sees_a_slot_half_written():
    """The watchdog reads the ring while ops are recorded: an entry in flight must carry
    its own start time and op, never another op's (a false timeout)."""
    rec, g = FlightRecorder(16), _group()
    ops = ("all_reduce", "broadcast", "reduce", "barrier")
    stop, bad, seen = threading.Event(), [], [0]

    def read():
        while not stop.is_set():
            for e in rec.entries():
                seen[0] += 1
                # each op's name follows from its number, and its start from the clock
                if e.op != ops[e.number % 4] or (e.t1 is None and e.t0 < started):
                    bad.append((e.number, e.op, e.t0, e.t1))

    started = time.monotonic()
    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline, k = time.monotonic() + 1.0, 0   # (the only writer: op k gets number k)
        while time.monotonic() < deadline:
            for _ in range(200):
                assert rec.begin(ops[k % 4], g, None) == k
                rec.end(k)
                k += 1
    finally:
        stop.set()
        reader.join(10)
    assert not reader.is_alive()
    assert seen[0] > 0 and not bad, bad[:5]
