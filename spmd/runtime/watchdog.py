"""The watchdog thread: it checks in-flight operations against their group's timeout
even when nobody waits on them, and reports them as a waiting rank would (holding a GPU
communicator, so the op's stream stays blocked: ``spmd.runtime.abort``); on an MPI with
ULFM it asks which ranks died (``failures.watch``); it beats a heartbeat that the
control thread watches (``heartbeat_check``), which reports a watchdog that is itself
stuck."""

from __future__ import annotations

import sys
import threading
import time
import traceback

from spmd.backends.mpi import orphans
from spmd.core import flight_recorder
from spmd.runtime import failures
from spmd.runtime.abort import after_device_timeout, stays_up_after_device_timeout
from spmd.runtime.diagnosis import handle_timeout
from spmd.runtime.locations import frame_of
from spmd.runtime.reliability import report, state

__all__ = ["Watchdog", "heartbeat_check"]

_monotonic = time.monotonic


class Watchdog:
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
        errors = 0
        while not self._stop.wait(self.interval):
            self.heartbeat += 1
            self.beat_at = _monotonic()
            try:
                failures.watch()
                self.check()
            except Exception as exc:  # noqa: BLE001 - keep watching
                errors += 1
                if errors <= 3:
                    report(f"spmd watchdog: check failed: {type(exc).__name__}: {exc}")

    def check(self) -> None:
        """Report the operations past their group's timeout.  ``in_flight`` has asked
        the GPU about device operations first: one that finished there is not in flight
        even if nobody has looked at its Work.  Also lets go of given-up MPI ops that
        MPI has finished with."""
        orphans.reap()
        now = _monotonic()
        for e in flight_recorder.recorder.in_flight():
            g = e.group
            if e.timed_out or g.comm is None or g.failed is not None:
                continue
            limit = g.timeout
            age = now - e.t0
            # A waiting thread reports its own timeout; the grace lets it go first.
            if age > limit + min(max(1.0, 0.05 * limit), 30.0) and e.t1 is None:
                flight_recorder.recorder.mark_timed_out(e.number)
                op, seq, engine, device = e.op, e.seq, e.engine, e.device
                # The policy is read once: the report below tells the program what
                # follows, and what follows must be that (the program may change the
                # policy once it has seen the report).
                stays_up = stays_up_after_device_timeout()
                text = handle_timeout(op, g, seq, e.kind, age, "watchdog", engine)
                where = "in flight" if device is None else f"running on the GPU ({engine})"
                if device is not None:
                    # Held, never aborted here: aborting lets the stream the program's
                    # reads wait on go on, and hand them the op's outputs.
                    device[0].hold(f"{op} #{seq} timed out (found by the watchdog)")
                    text += (f"\n  the group's {engine} communicator is held, not aborted: "
                             "the op's stream stays blocked until "
                             + ("the group is destroyed" if stays_up else "the process ends"))
                report(f"spmd watchdog: {op} #{seq} on group {g.name} is still {where} "
                       f"{age:.1f} s after it started and nobody waits for it:\n{text}")
                after_device_timeout(engine, op, seq, stays_up=stays_up)

    def close(self) -> None:
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


def heartbeat_check() -> None:
    """The heartbeat monitor, on the control thread's every poll."""
    wd = state.watchdog
    if wd is None:
        return
    silent = _monotonic() - wd.beat_at
    if silent <= state.config.heartbeat_timeout + wd.interval:  # it sleeps an interval per beat
        wd.stuck_reported = False
        return
    if wd.stuck_reported:
        return
    wd.stuck_reported = True
    frame = frame_of(sys._current_frames(), wd.thread)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)\n"
    report(f"spmd heartbeat monitor: the watchdog thread has not beaten for {silent:.1f} s "
           f"(heartbeat_timeout {state.config.heartbeat_timeout:g} s); timeouts of operations "
           f"nobody waits on go unnoticed. It is stuck at:\n{stack.rstrip()}")
    try:
        flight_recorder.dump(state.config.dump_dir, "watchdog heartbeat lost")
    except OSError:
        pass
