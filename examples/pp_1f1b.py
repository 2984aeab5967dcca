"""Pipeline parallelism with the 1F1B schedule (PipeDream-Flush, as in Megatron-LM).

Run: mpiexec -n 4 python examples/pp_1f1b.py

The LAYERS layers of an MLP are cut into contiguous stages, one per rank, and the batch
into N_MICRO micro-batches.  Activations flow forward from stage to stage and gradients
flow back, over point-to-point messages between neighbours; the last stage computes
the loss.  Stage s of P runs:

- warm-up: P - s - 1 forwards, so that by the time the last stage has finished its
  first forward, every stage has work queued;
- steady state: one forward, then one backward (of the oldest micro-batch in flight);
- cool-down: the backwards still owed.

Same bubble as running all forwards and then all backwards (GPipe), but a stage keeps
the activations of at most P - s micro-batches, not of all N_MICRO.

In the steady state a stage sends its output to the next stage and receives a gradient
from it in one batch_isend_irecv (and, going backward, sends a gradient and receives
the next input): each pair is posted together because the neighbour is doing the
mirror-image pair, so neither waits on the other's send before posting its receive.

Check: the loss and every gradient, accumulated over the micro-batches, equal the
serial model's over the same micro-batches (computed on every rank).
"""

import _mlp
import numpy as np

import spmd as dist

LAYERS, WIDTH = 12, 16        # 12 layers split evenly over 1, 2, 3, 4 or 6 stages
N_MICRO, MICRO = 6, 4         # micro-batches per batch, rows per micro-batch


class StageLink:
    """A pipeline stage's messages to its neighbours in ``group`` (ranks in stage order).

    Activations go to the next stage, gradients to the previous one.  The first stage
    has no previous stage and the last no next: calls towards them do nothing and
    receive None.  Every message between two stages in one direction has the same
    kind, so MPI's in-order matching pairs them up without tags.
    """

    def __init__(self, in_shape, out_shape, group=None):
        self.group = group
        self.stage, self.n_stages = dist.get_rank(group), dist.get_world_size(group)
        self.prev = self.stage - 1 if self.stage > 0 else None
        self.next = self.stage + 1 if self.stage < self.n_stages - 1 else None
        self.in_shape, self.out_shape = in_shape, out_shape

    def _exchange(self, send=None, send_to=None, recv_shape=None, recv_from=None):
        ops, buf = [], None
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, send, group=self.group, group_peer=send_to))
        if recv_from is not None:
            buf = np.empty(recv_shape)
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=recv_from))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return buf

    def recv_forward(self):
        return self._exchange(recv_shape=self.in_shape, recv_from=self.prev)

    def send_forward(self, y):
        self._exchange(send=y, send_to=self.next)

    def recv_backward(self):
        return self._exchange(recv_shape=self.out_shape, recv_from=self.next)

    def send_backward(self, dx):
        self._exchange(send=dx, send_to=self.prev)

    def send_forward_recv_backward(self, y):
        return self._exchange(y, self.next, self.out_shape, self.next)

    def send_backward_recv_forward(self, dx):
        return self._exchange(dx, self.prev, self.in_shape, self.prev)


def run_1f1b(link, n_micro, forward_step, backward_step):
    """Run every micro-batch's forward and backward on this stage in 1F1B order.

    ``forward_step(i, x)`` gets the previous stage's output for micro-batch i (None on
    the first stage) and returns this stage's output; ``backward_step(i, dy)`` gets the
    gradient of that output (None on the last stage, which starts from its loss) and
    returns the gradient of this stage's input.  Backwards run in micro-batch order.
    """
    warmup = min(link.n_stages - link.stage - 1, n_micro)
    steady = n_micro - warmup
    for i in range(warmup):
        link.send_forward(forward_step(i, link.recv_forward()))
    x = link.recv_forward() if steady else None
    for k in range(steady):
        # Forward micro-batch warmup + k, then backward micro-batch k.
        dy = link.send_forward_recv_backward(forward_step(warmup + k, x))
        dx = backward_step(k, dy)
        if k < steady - 1:
            x = link.send_backward_recv_forward(dx)
        else:
            link.send_backward(dx)
    for k in range(steady, n_micro):
        link.send_backward(backward_step(k, link.recv_backward()))


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world > LAYERS:
        raise ValueError(f"{LAYERS} layers cannot fill {world} stages")

    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((N_MICRO, MICRO, WIDTH))
    targets = np.sin(inputs)
    acts = _mlp.tanh_but_last(LAYERS)
    params = _mlp.init_params((WIDTH,) * (LAYERS + 1), seed=1)

    # The serial reference, on every rank: the same micro-batches, gradients accumulated.
    ref_grads = [np.zeros_like(p) for p in params]
    ref_loss = 0.0
    for i in range(N_MICRO):
        outs = _mlp.forward(params, inputs[i], acts)
        loss, dy = _mlp.mse(outs[-1], targets[i], scale=1.0 / N_MICRO)
        _mlp.backward(params, outs, dy, ref_grads, acts)
        ref_loss += loss / N_MICRO

    # This rank's stage: layers lo..hi-1 (uneven when world does not divide LAYERS).
    lo, hi = rank * LAYERS // world, (rank + 1) * LAYERS // world
    stage_params = [p.copy() for p in params[2 * lo:2 * hi]]
    stage_acts = acts[lo:hi]
    grads = [np.zeros_like(p) for p in stage_params]
    link = StageLink((MICRO, WIDTH), (MICRO, WIDTH))
    first, last = link.prev is None, link.next is None
    stash, loss_grads = {}, {}            # per micro-batch: layer outputs, d(loss)/d(output)
    peak = [0]
    total = np.zeros(1)                   # the batch loss (on the last stage)

    def forward_step(i, x):
        outs = _mlp.forward(stage_params, inputs[i] if first else x, stage_acts)
        stash[i] = outs
        peak[0] = max(peak[0], len(stash))
        if last:
            loss, loss_grads[i] = _mlp.mse(outs[-1], targets[i], scale=1.0 / N_MICRO)
            total[0] += loss / N_MICRO
        return outs[-1]

    def backward_step(i, dy):
        dy = loss_grads.pop(i) if last else dy
        return _mlp.backward(stage_params, stash.pop(i), dy, grads, stage_acts)

    run_1f1b(link, N_MICRO, forward_step, backward_step)

    dist.broadcast(total, src=world - 1)
    pairs = [(total, np.array([ref_loss]))] + list(zip(grads, ref_grads[2 * lo:2 * hi]))
    # Every rank judges the same numbers, so all pass or all raise together.
    err = np.array([max(np.abs(a - b).max() for a, b in pairs)])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    # 1F1B's memory bound: stage s never holds more than P - s micro-batches.
    ok = np.array([all(np.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in pairs)
                   and peak[0] == min(world - rank, N_MICRO)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok[0]:
        raise AssertionError(f"rank {rank}/{world} pp_1f1b: max error {err[0]:.3g}, "
                             f"{peak[0]} micro-batches in flight")
    _mlp.say(f"rank {rank}/{world} pp_1f1b OK max_err={err[0]:.2e} layers {lo}:{hi} "
             f"in_flight={peak[0]} loss={total[0]:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
