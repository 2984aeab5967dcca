"""Each SPMD_* setting the test put in this job's environment, checked by its documented
effect (tests/jobs/test_settings_effects.py says which job sets which, and to what).

Every rank prints "rank R EFFECT NAME=VALUE" for each setting whose effect it saw (the
timeout's and the query's: rank 0, which waits); an effect not seen raises (and the job
fails).  Run with 2 ranks."""
import os
import sys
import threading
import time
from datetime import timedelta

import numpy as np

GPU = "SPMD_DEVICE_DOUBLE_LAG" in os.environ   # the device double's settings need it
if GPU:
    from spmd.testing import device_double

    device_double.install()

import spmd  # noqa: E402 - after the double is installed
from spmd.backends import gpu_aware_mpi  # noqa: E402
from spmd.backends.mpi import fastcall, packing, persistent  # noqa: E402
from spmd.backends.shm import thresholds  # noqa: E402
from spmd.core import flight_recorder, wait  # noqa: E402
from spmd.runtime import reliability  # noqa: E402
from spmd.runtime.group import default_group  # noqa: E402
from spmd.runtime.world import get_node_local_rank  # noqa: E402

spmd.init_process_group(backend="cpu:mpi,cuda:nccl" if GPU else None)
rank, n = spmd.get_rank(), spmd.get_world_size()
assert n == 2, "run with 2 ranks"


def setting(name):
    return os.environ.get(name)


def seen(name):
    sys.stdout.write(f"rank {rank} EFFECT {name}={os.environ[name]}\n")
    sys.stdout.flush()


# -- what init made of the settings ------------------------------------------------------

if setting("SPMD_DEBUG") == "DETAIL":
    assert spmd.get_debug_level() == spmd.DebugLevel.DETAIL
    try:   # the last rank calls with another shape: every rank raises before sending
        spmd.all_reduce(np.ones(4 if rank == n - 1 else 3))
    except spmd.CollectiveMismatchError as exc:
        assert "shape" in str(exc), exc
    else:
        raise AssertionError("SPMD_DEBUG=DETAIL: a mismatched all_reduce did not raise")
    seen("SPMD_DEBUG")

if setting("SPMD_SHM") is not None:
    status = thresholds.status(default_group("setting_effects").engine_for("cpu"))
    want = {"0": "off (SPMD_SHM=0)", "force": "force:"}[setting("SPMD_SHM")]
    assert status.startswith(want), status
    seen("SPMD_SHM")

if setting("SPMD_FASTCALL") is not None:
    if setting("SPMD_FASTCALL") == "0":
        assert fastcall.compiled is None and fastcall.reason == "turned off (SPMD_FASTCALL=0)"
    else:
        assert fastcall.compiled is not None, fastcall.reason
    seen("SPMD_FASTCALL")

if setting("SPMD_PERSISTENT") == "0":
    assert not persistent.available()
    x = np.ones(3)
    plan = spmd.persistent.all_reduce(x)   # still runs, without MPI's persistent ops
    plan.start().wait()
    assert np.array_equal(x, np.full(3, float(n))), x
    seen("SPMD_PERSISTENT")

if setting("SPMD_PSEUDO_NODE_SIZE") == "1":
    assert get_node_local_rank() == 0   # every rank a node of its own (else rank 1: 1)
    seen("SPMD_PSEUDO_NODE_SIZE")

if setting("SPMD_WAIT") is not None:
    assert wait.yields is (setting("SPMD_WAIT") == "yield"), wait.yields
    assert (wait.nap_after < 0) is (setting("SPMD_WAIT") == "spin"), wait.nap_after
    seen("SPMD_WAIT")

if setting("SPMD_CUDA_AWARE_MPI") is not None:
    support = gpu_aware_mpi.mpi_gpu_support()
    assert support.aware is (setting("SPMD_CUDA_AWARE_MPI") == "1"), support
    assert "SPMD_CUDA_AWARE_MPI" in support.reason, support.reason
    seen("SPMD_CUDA_AWARE_MPI")

if setting("SPMD_FUSION_BYTES") is not None:
    limit = int(setting("SPMD_FUSION_BYTES"))
    assert packing.get_bucket_bytes() == limit
    arrays = [np.full(limit // 8, float(k + rank)) for k in range(3)]
    pieces = packing.buckets(arrays)
    assert len(pieces) == 3, pieces   # one array of `limit` bytes per fused collective
    spmd.all_reduce_coalesced(arrays)
    for k, a in enumerate(arrays):
        assert np.array_equal(a, np.full(limit // 8, float(n * k + n * (n - 1) // 2))), a
    seen("SPMD_FUSION_BYTES")

# -- the flight recorder and the watchdog ----------------------------------------------------

if setting("SPMD_FLIGHT_RECORDER_SIZE") is not None:
    for _ in range(30):
        spmd.all_reduce(np.ones(2))
    snap = flight_recorder.recorder.snapshot()
    size = int(setting("SPMD_FLIGHT_RECORDER_SIZE"))
    # It keeps the last `size` ops; 0 turns it off (nothing recorded).
    assert len(snap["entries"]) == size and (size == 0 or snap["capacity"] == size), \
        (snap["capacity"], len(snap["entries"]))
    seen("SPMD_FLIGHT_RECORDER_SIZE")

wd = reliability.state.watchdog
if setting("SPMD_WATCHDOG") == "0":
    assert wd is None, wd
    assert not [t for t in threading.enumerate() if "watchdog" in t.name], threading.enumerate()
    seen("SPMD_WATCHDOG")

if setting("SPMD_WATCHDOG_INTERVAL") is not None:
    interval = float(setting("SPMD_WATCHDOG_INTERVAL"))
    beats = wd.heartbeat
    time.sleep(20 * interval)
    # 20 beats at this interval (at the default 1 s, none or one); a loaded machine
    # may hold the thread off the CPU for some of them.
    assert wd.heartbeat - beats >= 5, wd.heartbeat - beats
    seen("SPMD_WATCHDOG_INTERVAL")

if setting("SPMD_HEARTBEAT_TIMEOUT") is not None:
    release = threading.Event()
    seen_reports = len(reliability.reports)
    check = wd.check
    wd.check = lambda: release.wait(10)   # the watchdog stuck inside its check
    deadline = time.monotonic() + 8
    found = []
    while not found and time.monotonic() < deadline:
        found = [r for r in list(reliability.reports)[seen_reports:]
                 if "heartbeat monitor" in r and
                 f"heartbeat_timeout {float(setting('SPMD_HEARTBEAT_TIMEOUT')):g} s" in r]
        time.sleep(0.05)
    release.set()
    wd.check = check
    assert found, list(reliability.reports)[seen_reports:]
    seen("SPMD_HEARTBEAT_TIMEOUT")

# -- the device double -----------------------------------------------------------------------

if GPU:
    import spmd.core.cuda as _gpu
    from spmd.testing.device_double import _device

    cp = _gpu.cupy_or_none()   # the double's

    lag = float(setting("SPMD_DEVICE_DOUBLE_LAG"))
    spmd.all_reduce(cp.ones(4, cp.float32))    # the NCCL communicator is made
    device_double.runtime.deviceSynchronize()
    t0 = time.monotonic()
    x = cp.full(4, float(rank + 1), cp.float32)
    spmd.all_reduce(x)
    device_double.runtime.deviceSynchronize()
    took = time.monotonic() - t0
    assert np.array_equal(cp.asnumpy(x), np.full(4, 3.0, np.float32)), x
    if lag > 0:
        assert took >= lag, took   # the kernel's simulated time at least
    else:
        assert _device.device.lag == 0.0
    seen("SPMD_DEVICE_DOUBLE_LAG")
    if setting("SPMD_DEVICE_DOUBLE_DIR") is not None:
        assert os.listdir(setting("SPMD_DEVICE_DOUBLE_DIR")), "the double wrote nothing there"
        seen("SPMD_DEVICE_DOUBLE_DIR")

# -- the timeout and the diagnosis's query: last, the group is left behind ------------------

if setting("SPMD_TIMEOUT") is not None:
    timeout = float(setting("SPMD_TIMEOUT"))
    assert spmd.GroupMember.WORLD.timeout == timedelta(seconds=timeout)
    spmd.barrier()
    query = float(setting("SPMD_QUERY_TIMEOUT") or 3.0)
    hold = timeout + query + 1.5
    if rank == 0:
        # A receive nobody sends to: DistTimeoutError after the default group's timeout,
        # then the diagnosis asks rank 1, which holds the interpreter and cannot answer
        # within the query timeout.
        t0 = time.monotonic()
        try:
            spmd.recv(np.empty(1), src=1)
        except spmd.DistTimeoutError as exc:
            took = time.monotonic() - t0
            text = str(exc)
        else:
            raise AssertionError("SPMD_TIMEOUT: a receive nobody sends to returned")
        assert f"did not complete within {timeout:.1f} s" in text, text
        assert took >= timeout, took
        seen("SPMD_TIMEOUT")
        if setting("SPMD_QUERY_TIMEOUT") is not None:
            assert f"no answer on the control channel within {query:g} s" in text, text
            assert took >= timeout + query, took
            seen("SPMD_QUERY_TIMEOUT")
        time.sleep(max(0.0, hold - took) + 0.5)
    else:
        # Hold the interpreter (no thread switch) while rank 0 times out and asks.
        sys.setswitchinterval(hold + 5)
        end = time.monotonic() + hold
        while time.monotonic() < end:
            pass
        sys.setswitchinterval(0.005)

sys.stdout.write(f"rank {rank} setting_effects OK\n")
sys.stdout.flush()
spmd.destroy_process_group()
