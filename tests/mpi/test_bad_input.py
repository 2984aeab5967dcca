"""Bad input raises a clear error on the calling rank before anything is sent.

Each check runs on every rank; afterwards a real collective proves that no rank
was left half-way through a call (a stray message would break it)."""

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def _ro(shape=(4,), dtype=np.float32):
    a = np.zeros(shape, dtype)
    a.flags.writeable = False
    return a


def _where(dist):
    return rf"\[rank {dist.get_rank()}, group WORLD\]"


def _still_in_step(dist):
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == dist.get_world_size()


def test_wrong_types(dist):
    w = _where(dist)
    with pytest.raises(TypeError, match=rf"all_reduce: tensor must be a numpy array \(or a cupy "
                       rf"array, .*\), got list \(wrap it with numpy.asarray\) {w}"):
        dist.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match=r"all_reduce: tensor has unsupported dtype object"):
        dist.all_reduce(np.array([1, "a"], dtype=object))
    with pytest.raises(TypeError, match="unsupported dtype"):
        dist.broadcast(np.zeros(2, np.longdouble), src=0)
    with pytest.raises(TypeError, match="op must be a ReduceOp, got str"):
        dist.all_reduce(np.zeros(2), op="sum")
    with pytest.raises(TypeError, match="tensor_list must be a list of numpy arrays, got ndarray"):
        dist.all_gather(np.zeros(2), np.zeros(2))
    _still_in_step(dist)


def test_bitwise_and_complex_rules(dist):
    w = _where(dist)
    with pytest.raises(TypeError, match=rf"all_reduce: ReduceOp.BAND needs an integer or bool dtype, got float32 {w}"):
        dist.all_reduce(np.zeros(2, np.float32), op=dist.ReduceOp.BAND)
    with pytest.raises(TypeError, match="ReduceOp.MAX is not defined for complex"):
        dist.all_reduce(np.zeros(2, np.complex64), op=dist.ReduceOp.MAX)
    with pytest.raises(TypeError, match="ReduceOp.AVG is not defined for bool"):
        dist.all_reduce(np.zeros(2, bool), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="PREMUL_SUM needs a floating point"):
        dist.reduce_scatter_tensor(np.zeros(1, np.int32), np.zeros(dist.get_world_size(), np.int32),
                                   op=dist.make_premul_sum(2.0))
    with pytest.raises(ValueError, match="PREMUL_SUM needs a factor"):
        dist.all_reduce(np.zeros(2), op=dist.ReduceOp.PREMUL_SUM)
    _still_in_step(dist)


def test_read_only_outputs(dist):
    n = dist.get_world_size()
    w = _where(dist)
    with pytest.raises(ValueError, match=rf"all_reduce: tensor is read-only; the result is written into it {w}"):
        dist.all_reduce(_ro())
    with pytest.raises(ValueError, match="read-only"):
        dist.broadcast(_ro(), src=0)
    with pytest.raises(ValueError, match=r"output_tensor is read-only"):
        dist.all_gather_into_tensor(_ro((4 * n,)), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"tensor_list\[0\] is read-only"):
        dist.all_gather([_ro()] * n, np.zeros(4, np.float32))
    # read-only inputs are fine
    out = np.zeros(4 * n, np.float32)
    dist.all_gather_into_tensor(out, _ro())
    assert not out.any()


def test_sizes_and_lengths(dist):
    n, me = dist.get_world_size(), dist.get_rank()
    w = _where(dist)
    with pytest.raises(ValueError, match=rf"all_gather_into_tensor: output_tensor has {4 * n + 1} "
                       rf"elements, expected world_size \({n}\) x input \(4\) = {4 * n} {w}"):
        dist.all_gather_into_tensor(np.zeros(4 * n + 1), np.zeros(4))
    with pytest.raises(TypeError, match="output_tensor has dtype float32, expected float64"):
        dist.all_gather_into_tensor(np.zeros(4 * n, np.float32), np.zeros(4))
    with pytest.raises(ValueError, match=rf"tensor_list has {n + 1} arrays, expected {n} \(the group size\)"):
        dist.all_gather([np.zeros(4)] * (n + 1), np.zeros(4))
    with pytest.raises(ValueError, match=rf"tensor_list\[{me}\] has 3 elements, expected 4"):
        dist.all_gather([np.zeros(3)] * n, np.zeros(4))
    with pytest.raises(ValueError, match=rf"input has {n * 4} elements, expected world_size"):
        dist.reduce_scatter_tensor(np.zeros(3), np.zeros(n * 4))
    with pytest.raises(ValueError, match="gather_list is required on the destination"):
        dist.gather(np.zeros(2), None, dst=me)
    if n > 1:
        with pytest.raises(ValueError, match="must be None or empty on ranks other than"):
            dist.gather(np.zeros(2), [np.zeros(2)] * n, dst=(me + 1) % n)
    with pytest.raises(ValueError, match=r"scatter_list\[0\] has 3 elements, expected 2"):
        dist.scatter(np.zeros(2), [np.zeros(3)] * n, src=me)
    with pytest.raises(ValueError, match="src=.* is not a member"):
        dist.broadcast(np.zeros(2), src=n)
    with pytest.raises(ValueError, match=r"give either src or group_src, not both"):
        dist.broadcast(np.zeros(2), src=0, group_src=0)
    with pytest.raises(ValueError, match=r"src \(a global rank\) or group_src"):
        dist.broadcast(np.zeros(2))
    with pytest.raises(ValueError, match=r"group_dst=-1 is out of range"):
        dist.reduce(np.zeros(2), group_dst=-1)
    _still_in_step(dist)


def test_all_to_all_checks(dist):
    n, me = dist.get_world_size(), dist.get_rank()
    with pytest.raises(ValueError, match=rf"input_split_sizes adds up to {n + 1}, expected {n}"):
        dist.all_to_all_single(np.zeros(n), np.zeros(n), [1] * n, [1] * (n - 1) + [2])
    with pytest.raises(ValueError, match=rf"output_split_sizes has {n + 1} entries, expected {n}"):
        dist.all_to_all_single(np.zeros(n), np.zeros(n), [1] * (n + 1), [1] * n)
    with pytest.raises(ValueError, match="non-negative ints"):
        dist.all_to_all_single(np.zeros(n), np.zeros(n), [-1] + [1] * (n - 1), [1] * n)
    if n > 1:
        with pytest.raises(ValueError, match="not divisible by the group size"):
            dist.all_to_all_single(np.zeros(n + 1), np.zeros(n + 1))
    with pytest.raises(ValueError, match="rows of input have 2 elements but rows of output have 3"):
        dist.all_to_all_single(np.zeros((n, 3)), np.zeros((n, 2)))
    with pytest.raises(ValueError, match="at least one dimension"):
        dist.all_to_all_single(np.zeros(()), np.zeros(()))
    with pytest.raises(ValueError, match=rf"input_tensor_list\[{me}\] has 2 elements but "
                       rf"output_tensor_list\[{me}\] has 1"):
        dist.all_to_all([np.zeros(1)] * n, [np.zeros(2)] * n)
    with pytest.raises(TypeError, match="dtype int64, expected float64"):
        dist.all_to_all([np.zeros(1)] * n, [np.zeros(1, np.int64)] * n)
    _still_in_step(dist)


def test_coalesced_checks(dist):
    n = dist.get_world_size()
    with pytest.raises(ValueError, match="tensors is empty"):
        dist.all_reduce_coalesced([])
    with pytest.raises(ValueError, match=rf"output_tensor_lists must be a list of {n} lists"):
        dist.all_gather_coalesced([[np.zeros(1)]] * (n + 1), [np.zeros(1)])
    with pytest.raises(ValueError, match=r"output_tensor_lists\[0\]\[0\] is float64 with 2 "
                       r"elements, expected float64 with 1"):
        dist.all_gather_coalesced([[np.zeros(2)]] * n, [np.zeros(1)])
    _still_in_step(dist)


def test_empty_arrays_do_not_hang(dist):
    n = dist.get_world_size()
    for fn in (lambda: dist.all_reduce(np.zeros(0)),
               lambda: dist.broadcast(np.zeros((0, 3)), src=0),
               lambda: dist.all_gather_into_tensor(np.zeros(0), np.zeros(0)),
               lambda: dist.reduce_scatter_tensor(np.zeros(0), np.zeros(0)),
               lambda: dist.all_to_all_single(np.zeros((0, 2)), np.zeros((0, 2))),
               lambda: dist.all_gather([np.zeros(0)] * n, np.zeros(0))):
        assert fn() is None
    _still_in_step(dist)
