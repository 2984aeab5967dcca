"""torch CPU tensors go the numpy way: results land in the tensor's own memory."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytestmark = pytest.mark.mpi


def test_all_reduce_and_broadcast_on_tensors(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((2, 3), float(me), dtype=torch.float32)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2, 3), float(sum(range(n)))))
    b = torch.arange(4, dtype=torch.bfloat16) * (me + 1)
    dist.broadcast(b, src=0)
    assert torch.equal(b, torch.arange(4, dtype=torch.bfloat16))
    h = torch.ones(3, dtype=torch.bfloat16)
    dist.all_reduce(h, op=dist.ReduceOp.AVG)
    assert torch.equal(h, torch.ones(3, dtype=torch.bfloat16))


def test_views_grad_and_mixed(dist):
    me, n = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(4, 4, requires_grad=True)
    col = w.detach()[:, 1]  # a strided view of a leaf that requires grad
    col.fill_(me)
    dist.all_reduce(col)
    assert torch.equal(w.detach()[:, 1], torch.full((4,), float(sum(range(n)))))
    assert float(w.detach()[:, 0].abs().sum()) == 0.0
    out = np.zeros(2 * n, np.int64)
    dist.all_gather_into_tensor(out, torch.tensor([me, me]))  # tensor in, ndarray out
    np.testing.assert_array_equal(out, np.repeat(np.arange(n), 2))
    with pytest.raises(TypeError, match="must be a numpy array"):
        dist.all_reduce(torch.ones(2).tolist())


def test_tensors_without_dense_memory_get_spmd_errors(dist):
    """A sparse, quantized or meta tensor handed to spmd's own API: spmd's error, not
    torch's or numpy's words."""
    me = dist.get_rank()
    for bad, says in [(torch.eye(3).to_sparse(), r"layout torch\.sparse_coo"),
                      (torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
                       r"quantized tensor"),
                      (torch.ones(3, device="meta"), r"meta device")]:
        with pytest.raises(TypeError, match=rf"^all_reduce: tensor .*{says}.*\[rank {me}, "
                           r"group WORLD\]"):
            dist.all_reduce(bad)
