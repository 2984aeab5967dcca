"""The control channel: ranks ask each other where they are, even while busy or blocked.

A private duplicate of COMM_WORLD carries small JSON messages (never pickles: a reply
cannot run code).  Each rank runs a daemon thread that polls for queries every few
milliseconds and answers them from the flight recorder, so a rank whose main thread is
computing, sleeping or stuck in another collective still says what it is doing.  That
needs MPI_THREAD_MULTIPLE (mpi4py's default); below it the channel stays off and
diagnoses say so.

The same thread is the watchdog's heartbeat monitor: it calls ``on_tick`` on every poll.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time

from mpi4py import MPI

from spmd.backends.mpi import faults
from spmd.core.lines import write_lines

__all__ = ["TAG_BARRIER", "TAG_QUERY", "Channel"]

TAG_QUERY = 101
_TAG_REPLY = 1000          # + query id % _REPLY_TAGS
_REPLY_TAGS = 8000
TAG_BARRIER = 10000        # + 2 * (group hash % 4096) (+1 for the release)
POLL_SECONDS = 0.01


class Channel:
    """One rank's end of the control channel (made by every rank at init)."""

    def __init__(self, world: MPI.Intracomm, answer, on_tick=None):
        self.comm = world.Dup()
        self.comm.Set_name("spmd:control")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._answer = answer            # request dict -> reply dict (on the thread)
        self._on_tick = on_tick
        self._qids = itertools.count(1)
        self._sends: list = []           # (request, buffer) of replies not yet complete
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._thread = None
        if self.threaded:
            self._thread = threading.Thread(target=self._serve, name="spmd-control", daemon=True)
            self._thread.start()

    # -- the answering thread -----------------------------------------------------

    def _serve(self) -> None:
        status = MPI.Status()
        failures = 0
        while not self._stop.wait(POLL_SECONDS):
            try:
                while True:
                    msg = self.comm.Improbe(MPI.ANY_SOURCE, TAG_QUERY, status)
                    if msg is None:
                        break
                    buf = bytearray(status.Get_count(MPI.BYTE))
                    msg.Recv([buf, MPI.BYTE])
                    self._reply(status.Get_source(), buf)
                self._reap()
                if self._on_tick is not None:
                    self._on_tick()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive a bad message
                if faults.is_failure(exc):
                    # A rank died (ULFM): acknowledged, its death no longer fails
                    # ANY_SOURCE probes; the survivors go on answering each other.
                    with contextlib.suppress(MPI.Exception):
                        self.comm.Ack_failed()
                    continue
                failures += 1
                if failures <= 3:
                    import sys
                    write_lines(f"[rank {self.rank}] spmd control channel: "
                                f"{type(exc).__name__}: {exc}", sys.stderr)

    def _reply(self, source: int, buf: bytearray) -> None:
        request = json.loads(buf)
        try:
            reply = self._answer(request)
        except Exception as exc:  # noqa: BLE001 - answer with the error instead of silence
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if reply is None or "tag" not in request:   # a notice (see notify): nobody waits
            return
        reply["qid"] = request.get("qid")
        reply["rank"] = self.rank
        self.send(reply, source, int(request["tag"]))

    def send(self, obj, dest: int, tag: int) -> None:
        """Send a small JSON message without blocking (kept until MPI is done with it)."""
        data = bytearray(json.dumps(obj).encode())
        req = self.comm.Isend([data, MPI.BYTE], dest, tag)
        with self._lock:
            self._sends.append((req, data))

    def _reap(self) -> None:
        with self._lock:
            self._sends = [(r, d) for r, d in self._sends if not r.Test()]

    # -- telling and asking ---------------------------------------------------------

    def notify(self, ranks, notice: dict) -> None:
        """Send ``notice`` to ``ranks`` (global ranks) without waiting for them: each
        one's thread hands it to ``answer``, which answers nothing.  Callable from any
        thread; a rank that is gone is skipped."""
        if not self.threaded:
            return
        for r in ranks:
            if r != self.rank:
                try:
                    self.send(notice, r, TAG_QUERY)
                except MPI.Exception:  # a dead rank (ULFM): it needs no news
                    pass

    def query(self, ranks, request: dict, timeout: float) -> dict[int, dict]:
        """Send ``request`` to ``ranks`` (global ranks); return the replies that came
        within ``timeout`` seconds, by rank.  Callable from any thread."""
        ranks = [r for r in ranks if r != self.rank]
        if not ranks or not self.threaded:
            return {}
        qid = next(self._qids)
        tag = _TAG_REPLY + qid % _REPLY_TAGS
        pending = set()
        for r in ranks:
            try:
                self.send({**request, "qid": qid, "tag": tag}, r, TAG_QUERY)
                pending.add(r)
            except MPI.Exception:   # a dead rank (ULFM): it answers nothing
                pass
        replies: dict[int, dict] = {}
        status = MPI.Status()
        deadline = time.monotonic() + timeout
        while pending:
            for r in list(pending):
                try:
                    msg = self.comm.Improbe(r, tag, status)
                except MPI.Exception:   # died meanwhile (ULFM)
                    pending.discard(r)
                    continue
                if msg is None:
                    continue
                buf = bytearray(status.Get_count(MPI.BYTE))
                msg.Recv([buf, MPI.BYTE])
                reply = json.loads(buf)
                if reply.get("qid") == qid:  # not a late answer to an older query
                    replies[r] = reply
                    pending.discard(r)
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        with contextlib.suppress(MPI.Exception):   # a reply to a rank that died
            self._reap()
        return replies

    def receive(self, source: int, tag: int):
        """A JSON message from ``source`` with ``tag`` if one is waiting, else None."""
        status = MPI.Status()
        msg = self.comm.Improbe(source, tag, status)
        if msg is None:
            return None
        buf = bytearray(status.Get_count(MPI.BYTE))
        msg.Recv([buf, MPI.BYTE])
        return json.loads(buf)

    def close(self) -> None:
        """Stop the thread and free the communicator (every rank, at destroy or exit)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with contextlib.suppress(MPI.Exception):   # a reply to a rank that died
            self._reap()
        with self._lock:
            for req, _ in self._sends:
                try:
                    req.Free()  # a reply nobody received: MPI may drop it
                except MPI.Exception:
                    pass
            self._sends = []
        try:
            self.comm.Free()
        except MPI.Exception:
            pass
