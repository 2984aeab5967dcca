"""spmd's errors leave the torch backend as torch's: ``except dist.DistBackendError``
catches a dead rank, a broken group and a timeout, and spmd's own classes still do."""

import pickle
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
import torch.distributed as dist  # noqa: E402 - after the skip without torch

import spmd  # noqa: E402
from spmd.torch import _errors  # noqa: E402
from spmd.torch._process_group import TORCH_OPS, SpmdProcessGroup  # noqa: E402
from spmd.torch._work import SpmdWork  # noqa: E402

# spmd's error -> torch's class that must catch it
FACES = [
    (spmd.ProcessFailedError("all_reduce: rank(s) [3] died", (3,), (3,), "all_reduce",
                             "WORLD", 0), dist.DistBackendError),
    (spmd.GroupBrokenError("broadcast: group WORLD is broken"), dist.DistBackendError),
    (spmd.DistTimeoutError("all_reduce: did not complete within 3.0 s"), dist.DistBackendError),
    (spmd.DistBackendError("MPI_ERR_OTHER"), dist.DistBackendError),
    (spmd.CollectiveMismatchError("rank 1 entered broadcast"), dist.DistBackendError),
    (spmd.DistNetworkError("connection refused"), dist.DistNetworkError),
    (spmd.DistStoreError("get: timed out"), dist.DistStoreError),
]


@pytest.mark.parametrize("exc, torch_class", FACES, ids=lambda v: type(v).__name__)
def test_each_error_becomes_its_torch_face_and_stays_itself(exc, torch_class):
    spmd_class = type(exc)
    try:
        raise exc
    except spmd.DistError as caught:
        before = caught.__traceback__
        same = _errors.as_torch_error(caught)
    assert same is exc and isinstance(exc, torch_class) and isinstance(exc, spmd_class)
    assert exc.__traceback__ is before
    assert type(exc).__module__ == "spmd.torch._errors"
    if isinstance(exc, spmd.ProcessFailedError):
        assert (exc.failed_ranks, exc.group_ranks, exc.op) == ([3], [3], "all_reduce")
    if isinstance(exc, spmd.DistTimeoutError):
        assert isinstance(exc, TimeoutError)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)


def test_other_errors_pass_unchanged():
    for exc in (ValueError("x"), RuntimeError("y"), TypeError("z")):
        assert type(_errors.as_torch_error(exc)) is type(exc)


class _FailingWork:
    """An spmd Work whose op failed: a rank died while it waited."""

    def __init__(self, exc):
        self._exc = exc

    def wait(self, timeout=None):
        raise self._exc

    def is_completed(self):
        return True

    def exception(self):
        return self._exc


def test_a_work_that_fails_raises_torchs_error():
    group = SimpleNamespace(name="WORLD", context=SimpleNamespace(timeout=30.0))
    exc = spmd.ProcessFailedError("all_reduce: rank(s) [2] died", (2,), (2,), "all_reduce",
                                  "WORLD", 0)
    work = SpmdWork([_FailingWork(exc)], [], "all_reduce", group)
    with pytest.raises(dist.DistBackendError) as err:
        work.wait()
    assert err.value is exc and isinstance(err.value, spmd.ProcessFailedError)
    assert work.exception() is exc
    # a Work tested, not waited (what a future's poller does), keeps the same error
    polled = SpmdWork([_FailingWork(spmd.GroupBrokenError("broken"))], [], "barrier", group)
    assert polled.is_completed() and not polled.is_success()
    assert isinstance(polled.exception(), dist.DistBackendError)


def test_an_op_that_refuses_to_start_raises_torchs_error():
    class Refusing(SpmdProcessGroup):
        def __init__(self):
            dist.ProcessGroup.__init__(self, 0, 2)

    def refuse(*args, **kwargs):
        raise spmd.GroupBrokenError("all_reduce: group WORLD is broken since a timeout")

    group = Refusing()
    method = _errors.raising_torch_errors(refuse)
    with pytest.raises(dist.DistBackendError, match="is broken since a timeout"):
        method(group, [torch.ones(1)])
    with pytest.raises(ValueError):   # not between ranks: unchanged
        _errors.raising_torch_errors(lambda: int("x"))()


# Methods of the class that are not ops: identity, coalescing's start, lifecycle,
# reconfiguring (its errors are argument and state errors of one rank).
NOT_OPS = {"getBackendName", "name", "_get_backend_name", "getGroupName", "setGroupName",
           "getGroupDesc", "setGroupDesc", "_set_group_name", "_set_group_desc",
           "_get_backend", "start_coalescing", "_start_coalescing", "shutdown", "abort",
           "get_reconfigure_handle", "reconfigure", "__init__", "__repr__"}


def test_every_op_torch_calls_raises_torchs_errors():
    """A method of torch's ProcessGroup that the spmd group defines is an op that
    raises torch's errors, unless it is listed above as no op (a new op is caught)."""
    defined = {name for name, value in vars(SpmdProcessGroup).items()
               if callable(value) and hasattr(dist.ProcessGroup, name)}
    ops = defined - NOT_OPS
    assert ops <= set(TORCH_OPS), f"not wrapped: {sorted(ops - set(TORCH_OPS))}"
    for name in TORCH_OPS:
        method = vars(SpmdProcessGroup)[name]
        assert getattr(method, "__wrapped__", None) is not None, name
