"""3D parallelism: pipeline, data and tensor parallel training on a (pp, dp, tp) mesh.

Run: mpiexec -n 8 python examples/three_d.py

The model is a stack of N_BLOCKS MLP blocks (D -> HIDDEN -> D), trained with SGD.  The
8 ranks form a 2 x 2 x 2 mesh laid out row-major, rank = 4 pp + 2 dp + tp, so the two
ranks of a tp group are neighbours: tensor parallelism talks in every block's forward
and backward, the most of the three, and neighbouring ranks are the likeliest to share
a node.  The three pieces are the other examples' own:

- pp (pp_1f1b.py): the blocks are cut into stages run with the 1F1B schedule; a rank
  exchanges activations and gradients with the rank of the other stage that has its
  dp and tp coordinates, which is exactly its pp group.
- tp (tp_mlp.py): every block is a ParallelMLP sharded over the tp group.
- dp (dp_mlp.py): each replica trains on its slice of the batch; the replicas of one
  (pp, tp) shard average their gradients over the dp group in buckets.  Gradients are
  final only in the last micro-batch's backward, so that is where buckets are marked
  ready, and their all_reduces overlap the rest of that backward.

Check: the loss curve and the final parameters (each rank's shards) equal full-batch
training of the unsharded model on one process.
"""

import _mlp
import numpy as np
from pp_1f1b import StageLink, run_1f1b
from tp_mlp import ParallelMLP

import spmd as dist

MESH, DIMS = (2, 2, 2), ("pp", "dp", "tp")
D, HIDDEN, N_BLOCKS = 8, 16, 4
BATCH, N_MICRO = 16, 4             # global batch; micro-batches per replica and step
STEPS, LR, BUCKET_BYTES = 6, 0.1, 1024


def mesh_groups():
    """The pp, dp and tp groups of this rank, from spmd's DeviceMesh."""
    if not hasattr(dist, "init_device_mesh"):
        return mesh_groups_fallback()
    mesh = dist.init_device_mesh("cpu", MESH, mesh_dim_names=DIMS)
    return [mesh.get_group(name) for name in DIMS]


def mesh_groups_fallback():
    """The same groups built by hand, for an spmd without init_device_mesh: along each
    dimension, the ranks that differ only in that coordinate form one group."""
    grid = np.arange(np.prod(MESH)).reshape(MESH)
    groups = []
    for dim, size in enumerate(MESH):
        ranks = np.moveaxis(grid, dim, -1).reshape(-1, size).tolist()
        groups.append(dist.new_subgroups_by_enumeration(ranks, group_desc=DIMS[dim])[0])
    return groups


def main():
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != np.prod(MESH):
        raise ValueError(f"three_d runs on {np.prod(MESH)} ranks (a {MESH} mesh), not {world}")
    pp, dp, tp = mesh_groups()
    stage, n_stages = dist.get_rank(pp), dist.get_world_size(pp)
    replica, n_replicas = dist.get_rank(dp), dist.get_world_size(dp)

    # Every rank builds the same data and the same full model, and trains it serially.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, D))
    target = np.sin(x)
    acts = (True, False) * N_BLOCKS    # block b is layers 2b (tanh) and 2b + 1 (linear)
    params = _mlp.init_params((D, HIDDEN) * N_BLOCKS + (D,), seed=1)
    ref_losses, ref_params = _mlp.train_serial(params, acts, x, target, STEPS, LR)

    # This rank's part: its stage's blocks, its tp shard of each, its dp slice of the batch.
    per_stage = N_BLOCKS // n_stages
    mine = range(stage * per_stage, (stage + 1) * per_stage)
    blocks = [ParallelMLP(*params[4 * b:4 * b + 4], group=tp) for b in mine]
    stage_params = [p for block in blocks for p in block.params]
    # DDP's buckets over the dp group; the gradients are views into the bucket buffers.
    reducer = dist.BucketReducer([np.zeros_like(p) for p in stage_params],
                                 bucket_cap_mb=BUCKET_BYTES / (1 << 20), group=dp,
                                 gradient_as_bucket_view=True)
    grads = reducer.grads
    for j, block in enumerate(blocks):
        block.grads = grads[4 * j:4 * j + 4]
    rows = slice(replica * BATCH // n_replicas, (replica + 1) * BATCH // n_replicas)
    xs = x[rows].reshape(N_MICRO, -1, D)
    ts = target[rows].reshape(N_MICRO, -1, D)
    link = StageLink(xs.shape[1:], xs.shape[1:], group=pp)
    first, last = link.prev is None, link.next is None
    stash, loss_grads = {}, {}
    step_loss = np.zeros(1)

    def forward_step(i, h):
        h = xs[i] if first else h
        stash[i] = []
        for block in blocks:
            z, hidden = block.forward(h)
            stash[i].append((h, hidden))
            h = z
        if last:
            loss, loss_grads[i] = _mlp.mse(h, ts[i], scale=1.0 / N_MICRO)
            step_loss[0] += loss / N_MICRO
        return h

    def backward_step(i, dy):
        dy = loss_grads.pop(i) if last else dy
        saved = stash.pop(i)
        for j in reversed(range(len(blocks))):
            dy = blocks[j].backward(*saved[j], dy)
            if i == N_MICRO - 1:       # block j's gradients are complete: reduce them now
                for k in reversed(range(4 * j, 4 * j + 4)):
                    reducer.mark_ready(k)
        return dy

    losses = np.zeros(STEPS)
    for step in range(STEPS):
        for g in grads:                # the blocks accumulate over micro-batches
            g[...] = 0.0
        step_loss[0] = 0.0
        run_1f1b(link, N_MICRO, forward_step, backward_step)
        reducer.wait()
        _mlp.sgd(stage_params, grads, LR)
        losses[step] = step_loss[0]

    # The last stage's replicas hold their slices' losses: average them, then hand the
    # curve to the first stage along the pp group.
    dist.all_reduce(losses, op=dist.ReduceOp.AVG, group=dp)
    dist.broadcast(losses, group=pp, group_src=n_stages - 1)
    pairs = [(losses, ref_losses)]
    for b, block in zip(mine, blocks):
        W1, b1, W2, b2 = ref_params[4 * b:4 * b + 4]
        c = block.cols
        pairs += zip(block.params, (W1[:, c], b1[c], W2[c], b2))
    # Every rank judges the same numbers, so all pass or all raise together.
    err = np.array([max(np.abs(a - b).max() for a, b in pairs)])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    coords = (stage, replica, dist.get_rank(tp))
    ok = np.array([all(np.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in pairs)
                   and coords == np.unravel_index(rank, MESH)])    # the row-major layout
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok[0]:
        raise AssertionError(f"rank {rank}/{world} three_d: max error {err[0]:.3g}, "
                             f"(pp, dp, tp) coordinates {coords}")
    _mlp.say(f"rank {rank}/{world} three_d OK max_err={err[0]:.2e} (pp, dp, tp) = {coords} "
             f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
