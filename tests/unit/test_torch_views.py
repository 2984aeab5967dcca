"""The torch backend's numpy views of CPU tensors, kept per tensor: handed out again only
while they still describe the tensor's memory, and never past the tensor's life."""

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from spmd.torch import _tensors  # noqa: E402 - after the skip without torch
from spmd.torch._tensors import host_in, host_out, views  # noqa: E402

GROUP = SimpleNamespace(rank=0, name="WORLD")   # what an error names


def _out(t, reduces=True):
    return host_out(t, "all_reduce", "tensor", GROUP, reduces)


def _describes(a: np.ndarray, t) -> bool:
    """Whether numpy array ``a`` is exactly tensor ``t``'s memory, shape and values."""
    return (a.__array_interface__["data"][0] == t.data_ptr() and a.shape == tuple(t.shape)
            and np.array_equal(a, t.detach().float().numpy() if t.dtype is torch.bfloat16
                               else t.detach().numpy()))


@pytest.fixture(autouse=True)
def _fresh():
    views._by_id.clear()
    yield
    views._by_id.clear()


def test_a_small_tensor_gets_its_view_again():
    t = torch.arange(6, dtype=torch.float32)
    a = _out(t)
    assert _out(t) is a and host_in(t, "broadcast", "tensor", GROUP) is a
    a[0] = 42.0   # the view is the tensor's memory
    assert t[0].item() == 42.0
    g = torch.ones(3, requires_grad=True)   # kept under the tensor, not its detached alias
    assert _out(g) is _out(g)


@pytest.mark.parametrize("change", ["resize", "set_", "data", "transpose", "dtype"])
def test_a_changed_tensor_gets_a_new_view(change):
    """Whatever changes where a tensor's memory is or how it is laid out makes a new
    view, one that describes the tensor as it is now."""
    t = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    old = _out(t)
    if change == "resize":
        t.resize_(2, 3)
    elif change == "set_":
        t.set_(torch.full((4, 4), 7.0))
    elif change == "data":
        t.data = torch.full((4, 4), 3.0, dtype=torch.float64)
    elif change == "transpose":   # same address, same shape, other strides
        t.t_()
    else:
        t.data = t.data.view(torch.int32)
    new = _out(t)
    assert new is not old
    if change == "transpose":
        assert new.strides != old.strides and np.array_equal(new, old.T)
    else:
        assert _describes(new, t)


def test_storage_freed_and_regrown_is_seen_where_it_moved():
    """FSDP frees a parameter by resizing its storage to 0 and grows it back later: the
    view handed out is always the tensor's current memory."""
    t = torch.arange(8, dtype=torch.float32)
    _out(t)
    storage = t.untyped_storage()
    storage.resize_(0)
    storage.resize_(32)
    t.copy_(torch.arange(8, dtype=torch.float32) * 2)
    a = _out(t)
    assert _describes(a, t)


def test_what_is_not_kept():
    big = torch.zeros(views.MAX_BYTES // 4 + 1)
    strided = torch.zeros(4, 4)[:, 1]
    conj = torch.zeros(3, dtype=torch.complex64).conj()
    fp8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
    for t in (big, strided, fp8):
        _out(t, reduces=False)
    host_in(conj, "broadcast", "tensor", GROUP)
    assert len(views) == 0
    # a dtype numpy lacks stays refused by reducing ops, also after it was moved
    with pytest.raises(TypeError, match="moves but cannot reduce"):
        _out(fp8)


@pytest.mark.parametrize("make", [lambda: torch.ones(4), lambda: torch.ones(4, requires_grad=True),
                                  lambda: torch.ones(4, dtype=torch.bfloat16)],
                         ids=["plain", "requires_grad", "bfloat16"])
def test_an_entry_goes_with_its_tensor(make):
    """A kept view never keeps its tensor alive (torch keeps a tensor's Python object
    while its C++ tensor is referenced: a view made from the tensor itself would)."""
    t = make()
    _out(t, reduces=False)
    assert len(views) == 1
    alive = weakref.ref(t)
    del t
    assert alive() is None
    gc.collect()
    assert len(views) == 0


def test_the_number_kept_is_bounded(monkeypatch):
    monkeypatch.setattr(_tensors._Views, "MAX_ENTRIES", 8)
    tensors = [torch.ones(2) for _ in range(20)]
    for t in tensors:
        _out(t)
    assert 0 < len(views) <= 8
    assert all(_describes(_out(t), t) for t in tensors)
