"""A small numpy MLP with a hand-written backward pass, shared by the parallel examples.

Parameters are one flat list ``[W0, b0, W1, b1, ...]`` (layer i owns ``params[2i]`` and
``params[2i + 1]``), so optimisers and gradient buckets can treat them as plain arrays.
Layer i computes ``y = x @ W + b``, followed by tanh where ``acts[i]`` is true.
Gradients accumulate (``grad += ...``), as torch's ``.grad`` does, so the same code
serves one batch and a sum over micro-batches.
"""

import sys
from itertools import pairwise

import numpy as np


def say(line: str) -> None:
    """Print one line whole: one write with its newline, so ranks' lines never mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def init_params(sizes, seed):
    """Weights for layers ``sizes[0] -> sizes[1] -> ...``, scaled to keep tanh unsaturated."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in pairwise(sizes):
        params.append(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in))
        params.append(0.1 * rng.standard_normal(fan_out))
    return params


def tanh_but_last(n_layers):
    """The usual activation pattern: tanh after every layer except the output layer."""
    return (True,) * (n_layers - 1) + (False,)


def layer_forward(W, b, x, act):
    y = x @ W + b
    return np.tanh(y) if act else y


def layer_backward(W, x, y, dy, act, gW, gb):
    """Add this layer's weight gradients into ``gW``/``gb``; return the input gradient."""
    da = dy * (1.0 - y * y) if act else dy
    gW += x.T @ da
    gb += da.sum(axis=0)
    return da @ W.T


def forward(params, x, acts):
    """Every layer's input and the final output: ``[x, y0, y1, ...]`` (kept for backward)."""
    outs = [x]
    for i, act in enumerate(acts):
        outs.append(layer_forward(params[2 * i], params[2 * i + 1], outs[-1], act))
    return outs


def backward(params, outs, dy, grads, acts, on_layer=None):
    """Backward through every layer, last first; ``on_layer(i)`` is called as soon as
    layer i's gradients are final (where data parallelism starts communicating)."""
    for i in reversed(range(len(acts))):
        dy = layer_backward(params[2 * i], outs[i], outs[i + 1], dy, acts[i],
                            grads[2 * i], grads[2 * i + 1])
        if on_layer is not None:
            on_layer(i)
    return dy


def mse(y, target, scale=1.0):
    """Mean squared error over all elements and its gradient (times ``scale``)."""
    diff = y - target
    return float(np.mean(diff * diff)), (scale * 2.0 / diff.size) * diff


def sgd(params, grads, lr):
    for p, g in zip(params, grads):
        p -= lr * g


def train_serial(params, acts, x, target, steps, lr):
    """Full-batch SGD on one process: the reference every parallel run must reproduce.

    Returns:
        (loss before each step, trained parameters); ``params`` is not modified.
    """
    params = [p.copy() for p in params]
    losses = []
    for _ in range(steps):
        grads = [np.zeros_like(p) for p in params]
        outs = forward(params, x, acts)
        loss, dy = mse(outs[-1], target)
        backward(params, outs, dy, grads, acts)
        sgd(params, grads, lr)
        losses.append(loss)
    return np.array(losses), params


def regression_problem(sizes, batch, steps, lr):
    """The data, activations and initial weights every rank builds alike from fixed
    seeds, and the serial training run the parallel one must match:
    (x, target, acts, params, ref_losses, ref_params)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, sizes[0]))
    target = np.sin(x @ rng.standard_normal((sizes[0], sizes[-1])))
    acts = tanh_but_last(len(sizes) - 1)
    params = init_params(sizes, seed=1)
    ref_losses, ref_params = train_serial(params, acts, x, target, steps, lr)
    return x, target, acts, params, ref_losses, ref_params
