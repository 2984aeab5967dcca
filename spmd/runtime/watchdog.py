"""Timeouts that end in a diagnosis, the watchdog and its heartbeat, aborting the job.

Started by ``init_process_group`` and stopped by ``destroy_process_group``:

- a **timeout** (a wait past its deadline) asks the other ranks of the group, over the
  control channel, where they are, and raises ``DistTimeoutError`` saying the op, the
  group, its sequence number, how long it waited, which ranks have not reached it and
  what they do instead.  A timed-out collective leaves the group's ranks out of step,
  so the group is marked broken: later calls on it raise ``GroupBrokenError`` at once.
- the **watchdog** thread checks in-flight operations against the group's timeout even
  when nobody waits on them, and reports them the same way; the control thread watches
  the watchdog's **heartbeat** and reports a watchdog that is itself stuck.
- an exception that escapes to ``sys.excepthook`` prints a rank-tagged traceback and
  **aborts the MPI job**, so ``mpiexec``/``srun`` end instead of the other ranks waiting
  forever (``SPMD_ABORT_ON_EXCEPTION=0`` or ``pg_options={"abort_on_exception": False}``
  turns it off).

Settings come from ``init_process_group(pg_options={...})``, else from the environment
(``SPMD_DEBUG``, ``SPMD_ABORT_ON_EXCEPTION``, ``SPMD_DUMP_DIR``,
``SPMD_FLIGHT_RECORDER_SIZE``, ``SPMD_WATCHDOG``, ``SPMD_WATCHDOG_INTERVAL``,
``SPMD_HEARTBEAT_TIMEOUT``, ``SPMD_QUERY_TIMEOUT``), else from the defaults of Config.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import linecache
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from mpi4py import MPI

from spmd.backends.checked import checking
from spmd.core import flight_recorder as _fr
from spmd.core import wait as _wait
from spmd.core import work as _work
from spmd.core.errors import DistTimeoutError
from spmd.core.lines import write_lines
from spmd.core.optable import is_p2p
from spmd.core.settings import Config
from spmd.runtime import debug
from spmd.runtime.control import Channel
from spmd.runtime.group import world_state

__all__ = ["Config", "config", "diagnose", "reports", "start", "stop"]

_monotonic = time.monotonic


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class _Runtime:
    """What start() creates."""

    def __init__(self) -> None:
        self.config = Config()
        self.channel: Channel | None = None
        self.watchdog: _Watchdog | None = None
        self.prev_hook: ExceptHook | None = None
        self.dumped_at = -1e9      # when a peer's request last made this rank dump
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.size = MPI.COMM_WORLD.Get_size()


_rt = _Runtime()
reports: collections.deque = collections.deque(maxlen=64)   # recent reports, for tests
_atexit_registered = False


def config() -> Config:
    """The settings in effect (defaults before init)."""
    return _rt.config


def start(world, cfg: Config) -> None:
    """Called by init_process_group on every rank, after WORLD exists."""
    global _atexit_registered
    _rt.config = cfg
    _rt.rank, _rt.size = world._rank, world._size
    if cfg.flight_recorder_size > 0:
        if _fr.recorder.size != _fr.ring_size(cfg.flight_recorder_size):
            _fr.recorder.resize(cfg.flight_recorder_size)
        _work.add_observer(_fr.recorder)
    else:  # off: no per-call cost, and no sequence numbers in diagnoses
        _work.remove_observer(_fr.recorder)
    _wait.set_diagnosis(_diagnose_timeout)
    _fr.recorder.groups_source = lambda: (world_state.world, list(world_state.groups))
    _fr.recorder.dump_dir = cfg.dump_dir
    debug.set_debug_level(cfg.debug)
    _rt.channel = Channel(world._comm, _answer, _tick)
    if cfg.watchdog:
        _rt.watchdog = _Watchdog(cfg.watchdog_interval)
    if sys.excepthook is not _excepthook:
        _rt.prev_hook = sys.excepthook
        sys.excepthook = _excepthook
    if not _atexit_registered:
        # Runs before mpi4py's MPI_Finalize (registered earlier): threads must not be in
        # an MPI call when MPI goes away.
        atexit.register(stop)
        _atexit_registered = True
    if cfg.debug != "OFF" and world._rank == 0:
        write_lines(f"[rank 0] spmd reliability settings: {dataclasses.asdict(cfg)}; MPI thread "
                    f"level {'multiple' if _rt.channel.threaded else 'below multiple'}",
                    sys.stderr)


def stop() -> None:
    """Called by destroy_process_group (and at exit): stop the threads, free the channel."""
    if _rt.watchdog is not None:
        _rt.watchdog.close()
        _rt.watchdog = None
    if _rt.channel is not None:
        _rt.channel.close()
        _rt.channel = None
    if sys.excepthook is _excepthook:
        sys.excepthook = _rt.prev_hook or sys.__excepthook__
    _rt.prev_hook = None


# ----------------------------------------------------------------------------- where

ABORT_GRACE = 0.5  # seconds between an uncaught exception's traceback and MPI_Abort

# spmd/ (this file is spmd/runtime/watchdog.py): frames in it are the library's, not the user's.
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = sysconfig.get_paths().get("stdlib", "\0")


def _is_library(filename: str) -> bool:
    return filename.startswith((_SPMD_DIR, _STDLIB, "<frozen")) or "site-packages" in filename


def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return rel if not rel.startswith("..") else filename


def frame_location(frame) -> str:
    """``file:line in func: source`` of the innermost frame outside libraries, with the
    spmd call it is in, if any."""
    inside = None
    f = frame
    while f is not None and _is_library(f.f_code.co_filename):
        if f.f_code.co_filename.startswith(_SPMD_DIR):
            inside = f.f_code.co_name
        f = f.f_back
    if f is None:
        f, inside = frame, None
    code = f.f_code
    line = linecache.getline(code.co_filename, f.f_lineno).strip()
    where = f"{_short(code.co_filename)}:{f.f_lineno} in {code.co_name}" + (f": {line}" if line else "")
    return f"in spmd.{inside}, called from {where}" if inside else f"at {where}"


def _frame_of(frames: dict[int, FrameType], thread: threading.Thread) -> FrameType | None:
    """``thread``'s frame in ``frames`` (``sys._current_frames()``); None for a thread
    that has no ident yet (started, not yet running) or no frame any more."""
    ident = thread.ident
    return None if ident is None else frames.get(ident)


def where() -> str:
    """Where this process is: its main thread, and other threads inside spmd calls."""
    frames = sys._current_frames()
    main = threading.main_thread()
    frame = _frame_of(frames, main)
    out = ["main thread " + frame_location(frame) if frame is not None else "main thread has exited"]
    for t in threading.enumerate():
        frame = _frame_of(frames, t)
        if t is main or frame is None or t.name.startswith("spmd-"):
            continue
        loc = frame_location(frame)
        if loc.startswith("in spmd."):
            out.append(f"thread {t.name} {loc}")
    return "; ".join(out[:4])


# ----------------------------------------------------------------------------- diagnosis

def group_key(g) -> dict:
    same = [x for x in list(world_state.groups) if x._name == g._name and x._ranks == g._ranks]
    index = next((i for i, x in enumerate(same) if x is g), 0)
    return {"name": g._name, "ranks": list(g._ranks), "index": index}


def _find_group(key: dict):
    same = [x for x in list(world_state.groups)
            if x._name == key["name"] and list(x._ranks) == key["ranks"]]
    return same[key["index"]] if len(same) > key["index"] else None


def _answer(request: dict) -> dict:
    """A peer asks where this rank is (runs on the control thread)."""
    if request.get("q") != "state":
        return {"error": f"unknown query {request.get('q')!r}"}
    g = _find_group(request["group"])
    out: dict = {"where": where()}
    if g is None:
        out["no_group"] = True
        out["elsewhere"] = [_fr.brief(e, _monotonic()) for e in _fr.recorder.in_flight()][-3:]
    else:
        out.update(_fr.recorder.group_summary(g, request.get("seq")))
        out["broken"] = g._error
        pending = checking.get(g)
        if pending is not None:  # in a debug-mode fingerprint exchange: it reached the op
            op, seq, t0 = pending
            b = {"op": op, "seq": seq, "kind": "collective", "group": g._name,
                 "state": "comparing arguments (debug mode)", "age": round(_monotonic() - t0, 3),
                 "took": None}
            out["seq"] = max(out["seq"], seq)
            out["current"] = [b] + out["current"]
            if request.get("seq") == seq:
                out["at_seq"] = b
    # Every rank that times out asks every other one: dump once per burst, not n times.
    if request.get("dump") and _rt.config.dump_dir and _monotonic() - _rt.dumped_at > 10.0:
        _rt.dumped_at = _monotonic()
        try:
            out["dump"] = _fr.dump(_rt.config.dump_dir, f"asked by rank {request.get('from')}: "
                                   f"{request.get('reason', '')}")
        except OSError as exc:
            out["dump"] = f"failed: {exc}"
    return out


def _who(g, rank: int) -> str:
    r = g._group_rank(rank)
    return f"rank {rank}" if r == rank else f"rank {rank} (group rank {r})"


def _op_text(b: dict | None, here: str) -> str:
    if b is None:
        return "none"
    where = "" if b["group"] == here else f" on group {b['group']}"
    return f"{b['op']} #{b['seq']}{where}"


def _peer_text(g, rank: int, rep: dict | None, target: int | None, op: str,
               kind: str = "collective") -> str:
    who = _who(g, rank)
    if rep is None:
        return f"{who}: not responding (no answer on the control channel within " \
               f"{_rt.config.query_timeout:g} s: dead, or stuck without releasing the GIL)"
    if "error" in rep:
        return f"{who}: could not answer ({rep['error']})"
    parts = []
    if rep.get("no_group"):
        parts.append(f"has no group {g._name} (not created yet, or destroyed)")
    elif kind == "p2p":
        cur = [c for c in rep.get("current", []) if c["kind"] == "p2p"]
        parts.append(f"{rep.get('p2p_seq', 0)} point-to-point ops started on {g._name}; " +
                     ("in flight: " + ", ".join(f"{c['op']} #{c['seq']} (started {c['age']:.1f} "
                                                "s ago)" for c in cur) if cur else "none in flight"))
    else:
        last = rep.get("last")
        if last is not None:
            parts.append(f"last finished {_op_text(last, g._name)} "
                         f"{last['age'] - (last['took'] or 0):.1f} s ago")
        cur = [c for c in rep.get("current", []) if c["kind"] == "collective"]
        if last is None and rep.get("seq", 0) <= len(cur):
            parts.append(f"no collective on {g._name} finished yet")
        elif last is None:
            parts.append("its last finished collective is older than its flight recorder")
        parts.append("in flight here: " + ", ".join(
            f"{c['op']} #{c['seq']} (started {c['age']:.1f} s ago)" for c in cur)
            if cur else f"nothing in flight on {g._name}")
        at = rep.get("at_seq")
        if target is not None and at is not None and at["op"] != op:
            parts.append(f"MISMATCH: its #{target} is {at['op']}, not {op} (SPMD_DEBUG=DETAIL "
                         "checks every call)")
    for e in rep.get("elsewhere", []):
        parts.append(f"in flight on group {e['group']}: {e['op']} #{e['seq']} "
                     f"(started {e['age']:.1f} s ago)")
    parts.append(rep.get("where", "location unknown"))
    return f"{who}: " + "; ".join(parts)


# Where an operation that every rank reached is stuck, by the engine that runs it.
_STUCK_IN = {
    "MPI": "it is stuck inside MPI (a rank may be blocked in it by an op on another group)",
    "shared memory": "it is stuck inside the shared-memory engine (a rank may be blocked in "
                     "it by an op on another group)",
    "NCCL": "it is stuck inside NCCL on the GPU (a rank's stream may be blocked by earlier "
            "GPU work, or NCCL by an op on another communicator)",
}
_ALONE = {
    "NCCL": "this rank is the only member, and its GPU has not finished the operation: NCCL "
            "or GPU work queued before it on the stream is stuck",
}


def diagnose(op: str, g, seq: int | None, kind: str, waited: float, source: str,
             engine: str = _fr.MPI_ENGINE) -> str:
    """The text of a timeout: what this rank waited for on which engine, and where every
    other member is."""
    me = g._ranks[g._rank]
    what = "" if seq is None else \
        f"collective #{seq} " if kind == "collective" else f"point-to-point op #{seq} "
    lines = [(f"{op}: did not complete within {waited:.1f} s ({what}on group {g._name}, "
              f"{engine}, group timeout {g._timeout:g} s) [rank {g._rank}, group {g._name}]")]
    ch = _rt.channel
    peers = [r for r in g._ranks if r != me]
    if not peers:
        lines.append("  " + _ALONE.get(engine, "this rank is the only member; the operation "
                                               "can never complete"))
        return "\n".join(lines)
    if ch is None or not ch.threaded:
        lines.append("  where the other ranks are is unknown: the control channel needs "
                     "MPI_THREAD_MULTIPLE")
        return "\n".join(lines)
    request = {"q": "state", "group": group_key(g), "seq": seq, "from": me,
               "dump": bool(_rt.config.dump_dir), "reason": f"{op} #{seq} timed out on rank {me}"}
    replies = ch.query(peers, request, _rt.config.query_timeout)
    if kind == "collective" and seq is not None:
        behind = [r for r in peers if r in replies and "error" not in replies[r]
                  and (replies[r].get("no_group") or replies[r].get("seq", 0) < seq)]
        silent = [r for r in peers if r not in replies or "error" in replies[r]]
        reached = [r for r in peers if r not in behind and r not in silent]
        other = [r for r in reached if (replies[r].get("at_seq") or {}).get("op", op) != op]
        if behind or silent:
            lines.append(f"  ranks that have not reached {op} #{seq}:"
                         if behind else "  ranks that did not say where they are:")
            for r in behind + silent:
                lines.append("    " + _peer_text(g, r, replies.get(r), seq, op))
        elif other:
            lines.append(f"  every rank reached collective #{seq}, but not every rank called "
                         f"{op}: the ranks called different collectives")
        else:
            lines.append(f"  every rank reached {op} #{seq}; " +
                         _STUCK_IN.get(engine, f"it is stuck inside {engine}"))
        lines.append(f"  reached it: {_who(g, me)} (this rank)" +
                     "".join(f", {_who(g, r)}" for r in reached))
        for r in other:
            lines.append("    " + _peer_text(g, r, replies[r], seq, op))
    else:
        lines.append("  the other ranks:")
        for r in peers:
            lines.append("    " + _peer_text(g, r, replies.get(r), None, op, kind))
    return "\n".join(lines)


def handle_timeout(op: str, g, seq: int | None, kind: str, waited: float, source: str,
                   engine: str = _fr.MPI_ENGINE) -> str:
    """Diagnose, break the group (collectives), dump the flight recorder; the message."""
    text = diagnose(op, g, seq, kind, waited, source, engine)
    if kind == "collective" and g._error is None:
        g._error = f"{op} #{seq} timed out on rank {_rt.rank} after {waited:.1f} s"
        text += f"\n  group {g._name} is now broken: later calls on it raise GroupBrokenError"
    if kind != "collective" and source == "wait":
        return text  # a receive can still complete: no dump for a polling wait(timeout)
    try:
        path = _fr.dump(_rt.config.dump_dir, f"{op} #{seq} on {g._name} timed out")
    except OSError as exc:
        text += f"\n  flight recorder dump failed: {exc}"
    else:
        if path is not None:
            text += (f"\n  flight recorder dumps in {_rt.config.dump_dir}; merge them with "
                     f"python -m spmd.tools.fr_trace {_rt.config.dump_dir}")
    return text


def _diagnose_timeout(op: str, g, seq: int | None, kind: str, waited: float, source: str,
                      work) -> str:
    """The one wait helper's hook: the diagnosis of any wait that timed out."""
    engine = _fr.MPI_ENGINE
    if work is not None:
        engine = work.engine
        e = getattr(work, "_fr", None)
        if e is not None:
            e[_fr.TIMED_OUT] = True
            seq, kind = e[_fr.SEQ], e[_fr.COUNTER].kind
        else:
            kind = "p2p" if is_p2p(op) else "collective"
    elif seq is None and kind == "collective":  # a wait before the op's Work exists
        seq = _fr.next_seq(g)
    text = handle_timeout(op, g, seq, kind, waited, source, engine)
    if source != "wait":
        text += f"\n  (timed out {source})"
    return text


def report(text: str) -> None:
    """Print a rank-tagged report to stderr (and keep it in ``reports``)."""
    reports.append(text)
    tag = f"[rank {_rt.rank}] "
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)


# ----------------------------------------------------------------------------- watchdog

class _Watchdog:
    """Checks in-flight operations against their group's timeout; beats a heartbeat."""

    def __init__(self, interval: float):
        self.interval = interval
        self.heartbeat = 0
        self.beat_at = _monotonic()
        self.stuck_reported = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="spmd-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            self.heartbeat += 1
            self.beat_at = _monotonic()
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - keep watching
                failures += 1
                if failures <= 3:
                    report(f"spmd watchdog: check failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Report the operations past their group's timeout.  ``in_flight`` has asked
        the GPU about device operations first: one that finished there is not in flight
        even if nobody has looked at its Work."""
        now = _monotonic()
        for e in _fr.recorder.in_flight():
            g = e[_fr.GROUP]
            if e[_fr.TIMED_OUT] or g._comm is None:
                continue
            limit = g._timeout
            age = now - e[_fr.T0]
            # A waiting thread reports its own timeout; the grace lets it go first.
            if age > limit + min(max(1.0, 0.05 * limit), 30.0) and e[_fr.T1] is None:
                e[_fr.TIMED_OUT] = True
                op, seq, engine, device = e[_fr.OP], e[_fr.SEQ], e[_fr.ENGINE], e[_fr.DEVICE]
                text = handle_timeout(op, g, seq, e[_fr.COUNTER].kind, age, "watchdog", engine)
                where = "in flight" if device is None else f"running on the GPU ({engine})"
                if device is not None:
                    device[0].abort_timed_out(op, seq)
                    text += f"\n  the group's {engine} communicator was aborted"
                report(f"spmd watchdog: {op} #{seq} on group {g._name} is still {where} "
                       f"{age:.1f} s after it started and nobody waits for it:\n{text}")

    def close(self) -> None:
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


def _tick() -> None:
    """The heartbeat monitor, on the control thread's every poll."""
    wd = _rt.watchdog
    if wd is None:
        return
    silent = _monotonic() - wd.beat_at
    if silent <= _rt.config.heartbeat_timeout + wd.interval:  # it sleeps an interval per beat
        wd.stuck_reported = False
        return
    if wd.stuck_reported:
        return
    wd.stuck_reported = True
    frame = _frame_of(sys._current_frames(), wd.thread)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)\n"
    report(f"spmd heartbeat monitor: the watchdog thread has not beaten for {silent:.1f} s "
           f"(heartbeat_timeout {_rt.config.heartbeat_timeout:g} s); timeouts of operations "
           f"nobody waits on go unnoticed. It is stuck at:\n{stack.rstrip()}")
    try:
        _fr.dump(_rt.config.dump_dir, "watchdog heartbeat lost")
    except OSError:
        pass


# ----------------------------------------------------------------------------- abort

def _excepthook(exc_type, exc, tb) -> None:
    """Uncaught exception: rank-tagged traceback, then abort the whole MPI job."""
    if not _rt.config.abort_on_exception:
        (_rt.prev_hook or sys.__excepthook__)(exc_type, exc, tb)
        return
    tag = f"[rank {_rt.rank}] "
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    with contextlib.suppress(Exception):  # a closed stdout must not stop the abort
        sys.stdout.flush()
    write_lines("\n".join(tag + line for line in text.splitlines()), sys.stderr)
    if _rt.size > 1:
        if _rt.config.dump_dir and not issubclass(exc_type, DistTimeoutError):  # done already
            try:
                _fr.dump(_rt.config.dump_dir, f"uncaught {exc_type.__name__}")
            except OSError:
                pass
        sys.stderr.write(f"{tag}spmd: uncaught {exc_type.__name__}: aborting the MPI job so no "
                         "rank waits forever (SPMD_ABORT_ON_EXCEPTION=0 turns this off)\n")
        sys.stderr.flush()
        # The launcher forwards output through pipes and stops reading them when the
        # abort reaches it: give it a moment to pass the traceback on first.
        time.sleep(ABORT_GRACE)
        MPI.COMM_WORLD.Abort(1)
    sys.stderr.flush()
