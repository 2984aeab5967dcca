"""Tensor parallelism: an MLP whose two linear layers are split across ranks (Megatron-LM).

Run: mpiexec -n 4 python examples/tp_mlp.py

The MLP is  z = tanh(x @ W1 + b1) @ W2 + b2  with a hidden layer of HIDDEN units, and
rank r of the group owns the hidden units ``cols`` (a contiguous 1/size of them):

- fc1 is column-parallel: rank r keeps the columns W1[:, cols] (and b1[cols]) and
  computes its slice of the hidden layer, h = tanh(x @ W1[:, cols] + b1[cols]), with no
  communication, because tanh works element by element.
- fc2 is row-parallel: rank r keeps the rows W2[cols] that consume exactly its hidden
  slice, so h @ W2[cols] is its share of a sum over the hidden units; one all_reduce
  adds the shares, and b2 (replicated) is added once, after it.

Backward runs the same way in reverse.  The output gradient dz is the same on every
rank, so the gradients of the local rows and columns need no communication; the input
gradient is again a sum over hidden units, dx = sum_r dh_r @ W1[:, cols_r].T, which
needs an all_reduce.  It is started with async_op=True before the weight gradients are
computed, so the two overlap.  One all_reduce forward and one backward per MLP is all
the communication tensor parallelism adds.

Check: the output, the loss, each rank's gradient shards and the input gradient equal
the serial MLP's (the corresponding slices of its gradients), computed on every rank.
"""

import _mlp
import numpy as np

import spmd as dist

BATCH, D_IN, HIDDEN = 6, 8, 24      # HIDDEN divisible by 1, 2, 3, 4, 6, 8


class ParallelMLP:
    """fc1 (column-parallel) -> tanh -> fc2 (row-parallel) over the ranks of ``group``.

    Built from the full weights on every rank; each rank keeps only its shard.
    ``params`` is ``[W1[:, cols], b1[cols], W2[cols], b2]``; ``grads`` has the same
    shapes and is accumulated into.  Every rank of ``group`` must call forward and
    backward together (each makes one all_reduce).
    """

    def __init__(self, W1, b1, W2, b2, group=None):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        hidden = W1.shape[1]
        if hidden % size:
            raise ValueError(f"hidden size {hidden} does not split evenly over {size} ranks")
        self.cols = slice(rank * hidden // size, (rank + 1) * hidden // size)
        self.group = group
        self.params = [W1[:, self.cols].copy(), b1[self.cols].copy(),
                       W2[self.cols].copy(), b2.copy()]
        self.grads = [np.zeros_like(p) for p in self.params]

    def forward(self, x):
        """Return the full output (on every rank) and this rank's hidden slice."""
        W1, b1, W2, b2 = self.params
        h = np.tanh(x @ W1 + b1)
        z = h @ W2                                  # this rank's share of the sum
        dist.all_reduce(z, group=self.group)
        z += b2                                     # once, not once per rank
        return z, h

    def backward(self, x, h, dz):
        """Accumulate this rank's weight gradients; return the full input gradient."""
        W1, _, W2, _ = self.params
        gW1, gb1, gW2, gb2 = self.grads
        dh = (dz @ W2.T) * (1.0 - h * h)
        dx = dh @ W1.T                              # this rank's share of the sum
        work = dist.all_reduce(dx, group=self.group, async_op=True)
        gW2 += h.T @ dz
        gb2 += dz.sum(axis=0)
        gW1 += x.T @ dh
        gb1 += dh.sum(axis=0)
        work.wait()
        return dx


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D_IN))
    target = rng.standard_normal((BATCH, D_IN))
    params = _mlp.init_params((D_IN, HIDDEN, D_IN), seed=1)

    # The serial reference, on every rank.
    acts = _mlp.tanh_but_last(2)
    outs = _mlp.forward(params, x, acts)
    ref_loss, dy = _mlp.mse(outs[-1], target)
    ref_grads = [np.zeros_like(p) for p in params]
    ref_dx = _mlp.backward(params, outs, dy, ref_grads, acts)

    mlp = ParallelMLP(*params)
    z, h = mlp.forward(x)
    loss, dz = _mlp.mse(z, target)
    dx = mlp.backward(x, h, dz)

    c = mlp.cols
    pairs = [(z, outs[-1]), (np.array(loss), np.array(ref_loss)), (dx, ref_dx),
             (mlp.grads[0], ref_grads[0][:, c]), (mlp.grads[1], ref_grads[1][c]),
             (mlp.grads[2], ref_grads[2][c]), (mlp.grads[3], ref_grads[3])]
    # Every rank judges the same numbers, so all pass or all raise together.
    err = np.array([max(np.abs(a - b).max() for a, b in pairs)])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    ok = np.array([all(np.allclose(a, b, rtol=1e-12, atol=1e-14) for a, b in pairs)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok[0]:
        raise AssertionError(f"rank {rank}/{world} tp_mlp: max error {err[0]:.3g}")
    _mlp.say(f"rank {rank}/{world} tp_mlp OK max_err={err[0]:.2e} hidden units "
             f"{c.start}:{c.stop} of {HIDDEN}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
