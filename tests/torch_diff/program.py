"""One fixed sequence of collectives, run through torch.distributed or through spmd.

    torchrun --standalone --nproc-per-node N program.py --impl torch --out DIR
    mpiexec -n N python program.py --impl spmd --out DIR

Every rank runs the same deterministic sequence (written once, through a small
adapter) and saves every result it sees to ``DIR/rank{R}.npz``; tests/jobs/test_torch_diff.py
checks that both implementations saved the same arrays, bit for bit.  Inputs are
small integers, so every result is exact.

Keys are ``op/group/mode/case...``; group is ``world`` or ``sub`` (a subgroup made by
``new_group`` from an unsorted rank list that leaves out global rank 0), mode is
``sync`` or ``async`` (``async_op=True`` then ``wait()``).  Each collective's return
value is saved too (``.../ret``: ``None``, or for ``async_op=True`` the handle's type
and what its ``wait()`` returned, e.g. ``Work.wait:True``); strings and Python objects
are saved as their ``repr`` (numpy unicode arrays).

Strided (non-contiguous) views are passed as they are to spmd everywhere.  gloo
ignores the strides of some of them and reads or writes the underlying memory as if
it were contiguous (wrong results, no error): the tensor of all_reduce, broadcast and
reduce, the output and scatter_list pieces of scatter, the output of reduce_scatter.
There the torch side hands gloo a contiguous copy and copies the result back
(``dense``/``write_back``), which gives torch's documented semantics.

Left out because gloo (torch 2.13) refuses them, so there is nothing to compare:

- ReduceOp.AVG on integer and bool tensors ("result type Float can't be cast");
  AVG on floating and complex tensors is compared.
- ReduceOp.PREMUL_SUM (``_make_nccl_premul_sum``) on any dtype.
- bitwise ops on floating/complex tensors; PRODUCT, MIN, MAX on complex tensors
  (errors in torch as well; only SUM and AVG are compared for complex64).
- gather of complex tensors ("Invalid scalar type").
- all_gather and all_to_all with sizes that differ between ranks (uneven
  ``reduce_scatter`` is supported by gloo and compared).
- all_gather_into_tensor with a stacked output ``[n, *input.shape]`` or a 0-d input;
  reduce_scatter_tensor with a stacked input (a fatal CHECK in gloo).
- all_reduce_coalesced with mixed dtypes.
- non-contiguous tensors in all_to_all_single, send/recv and the other p2p ops.
- recv_object_list with src=None (gloo times out); recv_object_list on a non-member.
- bfloat16 (numpy has no bfloat16 without ml_dtypes; ``Tensor.numpy()`` refuses it),
  uint16/32/64 (not gloo types).

gloo stores bool SUM results as bytes other than 0/1 (True + True -> 2); bool
results are therefore saved as 0/1 (any nonzero byte is True).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from datetime import timedelta

import numpy as np

TIMEOUT = timedelta(seconds=120)

FLOATS = ["float32", "float64", "float16"]
INTS = ["int32", "int64", "uint8", "int8"]
DTYPES = FLOATS + INTS + ["bool", "complex64"]
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
COMPLEX_OPS = ["SUM", "AVG"]


def reduce_ops(dtype: str) -> list[str]:
    if dtype in FLOATS:
        return FLOAT_OPS
    if dtype == "complex64":
        return COMPLEX_OPS
    return INT_OPS  # ints and bool


def short_ops(dtype: str) -> list[str]:
    """A few ops per dtype for the collectives that are not all_reduce."""
    if dtype == "complex64":
        return ["SUM"]
    if dtype in FLOATS:
        return ["SUM", "MAX", "PRODUCT"]
    return ["SUM", "MIN", "BXOR"]


def kind_for(op: str) -> str:
    return {"PRODUCT": "prod", "BAND": "bits", "BOR": "bits", "BXOR": "bits"}.get(op, "gen")


def vals(shape, dtype: str, rank: int, kind: str = "gen", salt: int = 0) -> np.ndarray:
    """Deterministic small-integer data, different per rank and per salt."""
    shape = tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    i = np.arange(size, dtype=np.int64)
    dt = np.dtype(dtype)
    if dt == np.bool_:
        if kind == "prod":
            v = (i + rank + salt) % 3 != 0
        else:
            v = (i * 5 + rank * 3 + salt) % 7 % 2 == 1
        return v.reshape(shape)
    if kind == "prod":  # products of up to 4 ranks stay small
        if dt.kind == "u":
            v = 1 + (i + rank + salt) % 2
        else:
            v = np.array([1, 2, -1, -2])[(i + rank + salt) % 4]
    elif kind == "bits":
        v = (i * 37 + rank * 91 + salt * 13 + 5) % 256
        if dt.kind == "i":
            v = v - 128
            if dt.itemsize >= 4:
                v = v * 65793 + (i * 2654435761 + rank * 40503) % (1 << 20)
    elif kind == "wrap":  # sums overflow (integers wrap around)
        if dt == np.uint8:
            v = 200 + rank * 17 + i
        elif dt == np.int8:
            v = 100 + rank * 13 + i
        else:  # about max/2 each: two ranks overflow
            top = int(np.iinfo(dt).max) // 2
            return np.array([top - 8 + rank * 3 + k for k in range(size)], dt).reshape(shape)
    else:
        v = (i * 7 + rank * 3 + salt * 5 + 1) % 11
        if dt.kind in "fc":
            v = v - 5
            v = np.where(v >= 0, v + 1, v)  # no zeros: no -0.0 from MIN/MAX/PRODUCT
        elif dt.kind == "i":
            v = v - 5
    out = v.astype(dt) if dt.kind != "c" else (v + 1j * ((i * 3 + rank + salt) % 5 - 2)).astype(dt)
    return out.reshape(shape)


# ----------------------------------------------------------------------------- adapters


class TorchImpl:
    name = "torch"

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        dist.init_process_group("gloo", timeout=TIMEOUT)

    def T(self, a: np.ndarray):
        return self.torch.from_numpy(np.array(a, copy=True))

    def N(self, t) -> np.ndarray:
        a = np.array(t.detach().numpy(), copy=True)
        return a.view(np.uint8) != 0 if a.dtype == np.bool_ else a

    def is_array(self, x) -> bool:
        return isinstance(x, self.torch.Tensor)

    def dense(self, t):
        """What to hand gloo where it mishandles strided tensors: a contiguous copy."""
        return t if t.is_contiguous() else t.contiguous()

    def write_back(self, t, passed) -> None:
        if passed is not t:
            t.copy_(passed)

    def premul(self, factor):  # not used with gloo, kept for symmetry
        return self.dist._make_nccl_premul_sum(factor)


class SpmdImpl:
    name = "spmd"

    def __init__(self):
        import spmd

        self.dist = spmd
        spmd.init_process_group(timeout=TIMEOUT)

    def T(self, a: np.ndarray):
        return np.array(a, copy=True)

    def N(self, a) -> np.ndarray:
        a = np.array(a, copy=True)
        return a.view(np.uint8) != 0 if a.dtype == np.bool_ else a

    def is_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def dense(self, a):  # spmd gets the strided array itself
        return a

    def write_back(self, a, passed) -> None:
        pass


# ----------------------------------------------------------------------------- the sequence

# Layouts of a tensor argument: name, shape of the underlying tensor, view of it.
PLAIN = [("1d", (5,), None), ("2d", (2, 3), None), ("0d", (), None)]
VIEWS = [("T", (3, 4), lambda a: a.transpose(1, 0)), ("step", (10,), lambda a: a[1::2])]
LAYOUTS = PLAIN + VIEWS


def obj(rank: int, salt: int):
    return {"rank": rank, "salt": salt, "list": [rank, rank * 0.5, "x" * (rank + 1)],
            "tuple": (rank, None, rank % 2 == 0), "nested": {"k": [salt] * (rank % 3)},
            "bytes": bytes([rank, salt % 256])}


class Sequence:
    def __init__(self, impl):
        self.I = impl
        self.d = impl.dist
        self.R: dict[str, np.ndarray] = {}
        self.rank = self.d.get_rank()
        self.n = self.d.get_world_size()

    # -- recording
    def rec(self, key: str, x) -> None:
        if key in self.R:
            raise KeyError(f"duplicate result key {key}")
        self.R[key] = self.I.N(x)

    def rec_s(self, key: str, value) -> None:
        if key in self.R:
            raise KeyError(f"duplicate result key {key}")
        self.R[key] = np.array(value if isinstance(value, str) else repr(value))

    def desc(self, x) -> str:
        """A result as a string: arrays/tensors by dtype and shape, lists recursively."""
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(self.desc(y) for y in x) + "]"
        if self.I.is_array(x):
            return f"array({str(x.dtype).replace('torch.', '')}, {tuple(x.shape)})"
        return repr(x)

    def call(self, key: str, fn, mode: str, fix=(), norm=None, **kw) -> None:
        """Run a collective in ``mode`` and record what it returned (for async_op=True:
        the handle's type and what its wait() returned).  ``fix``: (tensor, what was
        passed instead) pairs to copy back afterwards (see ``dense``)."""
        if mode == "async":
            w = fn(async_op=True, **kw)
            value = None if w is None else w.wait()
            if norm is not None:
                value = norm(value)
            # the handle's API class (an engine's Work subclass is a Work, as torch's is)
            kind = None if w is None else next(
                (c.__name__ for c in type(w).__mro__ if c.__name__ in ("Work", "Future")),
                type(w).__name__)
            ret = "None" if w is None else f"{kind}.wait:{self.desc(value)}"
        else:
            ret = self.desc(fn(**kw))
        self.rec_s(key + "/ret", ret)
        for t, passed in fix:
            self.I.write_back(t, passed)

    def make(self, layout, dtype, rank, kind="gen", salt=0):
        """(base, view): a tensor of the layout's shape and the view the op gets."""
        _, shape, fn = layout
        base = self.I.T(vals(shape, dtype, rank, kind, salt))
        return base, (fn(base) if fn else base)

    def rec_view(self, key, base, view, layout) -> None:
        self.rec(key, view)
        if layout[2] is not None:  # the rest of the underlying tensor must be untouched
            self.rec(key + "/base", base)

    # -- the program
    def run(self) -> dict:
        d, n, r = self.d, self.n, self.rank
        self.rec_s("info/rank", r)
        self.rec_s("info/world_size", n)
        # A subgroup given as an unsorted list without global rank 0 (all of it at n=1).
        sub_ranks = list(range(n - 1, 0, -1)) if n > 1 else [0]
        sub = d.new_group(ranks=sub_ranks)
        self.groups = [("world", None), ("sub", sub)]
        self.rec_s("info/sub/rank", d.get_rank(sub))
        self.rec_s("info/sub/world_size", d.get_world_size(sub))
        if d.get_rank(sub) >= 0:
            self.rec_s("info/sub/ranks", d.get_process_group_ranks(sub))
            self.rec_s("info/sub/group_rank_of", [d.get_group_rank(sub, g) for g in sub_ranks])
            self.rec_s("info/sub/global_rank_of",
                       [d.get_global_rank(sub, i) for i in range(d.get_world_size(sub))])
        else:
            self.non_member(sub)
        for gname, g in self.groups:
            me = d.get_rank(g)
            if me < 0:
                continue
            ctx = (gname, g, me, d.get_world_size(g), d.get_process_group_ranks(g) if g else
                   list(range(n)))
            for mode in ("sync", "async"):
                self.broadcast(ctx, mode)
                self.all_reduce(ctx, mode)
                self.reduce(ctx, mode)
                self.all_gather(ctx, mode)
                self.all_gather_into_tensor(ctx, mode)
                self.gather(ctx, mode)
                self.scatter(ctx, mode)
                self.reduce_scatter(ctx, mode)
                self.reduce_scatter_tensor(ctx, mode)
                self.all_to_all(ctx, mode)
                self.all_to_all_single(ctx, mode)
                self.coalesced(ctx, mode)
                self.call(f"barrier/{gname}/{mode}", d.barrier, mode, group=g)
            if ctx[3] > 1:
                self.p2p(ctx)
            self.objects(ctx)
        d.barrier()
        self.call("barrier/world/explicit", d.barrier, "sync", group=d.GroupMember.WORLD)
        d.destroy_process_group()
        return self.R

    def non_member(self, sub) -> None:
        """Calls on a group this rank is not in: warn, do nothing, return None (-1 for recv)."""
        d = self.d
        t = self.I.T(vals((3,), "float32", self.rank))
        self.call("nonmember/all_reduce", d.all_reduce, "sync", tensor=t, group=sub)
        self.call("nonmember/all_reduce_async", d.all_reduce, "async", tensor=t, group=sub)
        self.call("nonmember/broadcast", d.broadcast, "sync", tensor=t, src=1, group=sub)
        self.rec("nonmember/tensor", t)
        self.rec_s("nonmember/recv", d.recv(tensor=t, src=1, group=sub))
        lst = [None]
        self.rec_s("nonmember/all_gather_object", repr(d.all_gather_object(lst, 1, group=sub)))
        self.rec_s("nonmember/all_gather_object/list", lst)

    def cases(self, mode):
        """Layouts: all of them in sync mode, one plain and one view in async mode."""
        return LAYOUTS if mode == "sync" else [LAYOUTS[1], LAYOUTS[3]]

    def dtypes(self, mode):
        return DTYPES if mode == "sync" else ["float32", "int64", "bool", "float16"]

    # -- collectives
    def broadcast(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for lay in self.cases(mode):
                for how, kw in (("src", {"src": ranks[-1]}), ("group_src", {"group_src": 0})):
                    key = f"broadcast/{gname}/{mode}/{dt}/{lay[0]}/{how}"
                    base, t = self.make(lay, dt, self.rank)
                    p = self.I.dense(t)  # gloo ignores the strides of the tensor
                    self.call(key, self.d.broadcast, mode, tensor=p, group=g, fix=[(t, p)], **kw)
                    self.rec_view(key, base, t, lay)

    def all_reduce(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        R = self.d.ReduceOp
        for dt in self.dtypes(mode):
            for op in reduce_ops(dt):
                for lay in self.cases(mode):
                    key = f"all_reduce/{gname}/{mode}/{dt}/{op}/{lay[0]}"
                    base, t = self.make(lay, dt, self.rank, kind_for(op))
                    p = self.I.dense(t)  # gloo ignores the strides of the tensor
                    self.call(key, self.d.all_reduce, mode, tensor=p, op=getattr(R, op), group=g,
                              fix=[(t, p)])
                    self.rec_view(key, base, t, lay)
            if dt in INTS and mode == "sync":
                key = f"all_reduce/{gname}/{mode}/{dt}/SUM/wrap"
                t = self.I.T(vals((4,), dt, self.rank, "wrap"))
                self.call(key, self.d.all_reduce, mode, tensor=t, group=g)
                self.rec(key, t)
        # default op, empty tensor
        t = self.I.T(vals((2, 2), "float64", self.rank))
        self.call(f"all_reduce/{gname}/{mode}/default_op", self.d.all_reduce, mode, tensor=t, group=g)
        self.rec(f"all_reduce/{gname}/{mode}/default_op", t)
        t = self.I.T(np.zeros((0, 3), np.float32))
        self.call(f"all_reduce/{gname}/{mode}/empty", self.d.all_reduce, mode, tensor=t, group=g)
        self.rec(f"all_reduce/{gname}/{mode}/empty", t)

    def reduce(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        R = self.d.ReduceOp
        for dt in self.dtypes(mode):
            for op in short_ops(dt):
                for lay in self.cases(mode):
                    for how, kw, root in (("dst", {"dst": ranks[-1]}, gn - 1),
                                          ("group_dst", {"group_dst": 0}, 0)):
                        key = f"reduce/{gname}/{mode}/{dt}/{op}/{lay[0]}/{how}"
                        base, t = self.make(lay, dt, self.rank, kind_for(op))
                        p = self.I.dense(t)  # gloo ignores the strides of the tensor
                        self.call(key, self.d.reduce, mode, tensor=p, op=getattr(R, op), group=g,
                                  fix=[(t, p)], **kw)
                        if me == root:  # elsewhere torch leaves the tensor unspecified
                            self.rec_view(key, base, t, lay)

    def all_gather(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for lay in self.cases(mode):
                key = f"all_gather/{gname}/{mode}/{dt}/{lay[0]}"
                base, t = self.make(lay, dt, self.rank)
                outs = [self.I.T(vals(t.shape, dt, self.rank, salt=50 + i)) for i in range(gn)]
                self.call(key, self.d.all_gather, mode, tensor_list=outs, tensor=t, group=g)
                for i, o in enumerate(outs):
                    self.rec(f"{key}/{i}", o)
                self.rec_view(key + "/in", base, t, lay)
            # outputs that are views: rows (contiguous) and columns (strided) of one tensor
            for how in ("rows", "cols"):
                key = f"all_gather/{gname}/{mode}/{dt}/out_{how}"
                t = self.I.T(vals((3,), dt, self.rank, salt=1))
                if how == "rows":
                    big = self.I.T(vals((gn, 3), dt, self.rank, salt=60))
                    outs = [big[i] for i in range(gn)]
                else:
                    big = self.I.T(vals((3, gn + 1), dt, self.rank, salt=60))
                    outs = [big[:, i] for i in range(gn)]
                self.call(key, self.d.all_gather, mode, tensor_list=outs, tensor=t, group=g)
                self.rec(key, big)

    def all_gather_into_tensor(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for lay in self.cases(mode):
                if lay[1] == ():  # gloo refuses a 0-d input
                    continue
                key = f"all_gather_into_tensor/{gname}/{mode}/{dt}/{lay[0]}"
                base, t = self.make(lay, dt, self.rank)
                shape = (gn * t.shape[0],) + tuple(t.shape[1:])
                out = self.I.T(vals(shape, dt, self.rank, salt=70))
                self.call(key, self.d.all_gather_into_tensor, mode, output_tensor=out,
                          input_tensor=t, group=g)
                self.rec(key, out)
                self.rec_view(key + "/in", base, t, lay)

    def gather(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            if dt == "complex64":  # gloo: "Invalid scalar type"
                continue
            for lay in self.cases(mode):
                for how, kw, root in (("dst", {"dst": ranks[-1]}, gn - 1),
                                      ("group_dst", {"group_dst": 0}, 0),
                                      ("default", {}, 0 if g is None else None)):
                    if root is None:  # the default dst, global rank 0, is not in sub
                        continue
                    key = f"gather/{gname}/{mode}/{dt}/{lay[0]}/{how}"
                    base, t = self.make(lay, dt, self.rank)
                    outs = None
                    if me == root:
                        outs = [self.I.T(vals(t.shape, dt, self.rank, salt=80 + i)) for i in range(gn)]
                    self.call(key, self.d.gather, mode, tensor=t, gather_list=outs, group=g, **kw)
                    for i, o in enumerate(outs or []):
                        self.rec(f"{key}/{i}", o)
                    self.rec_view(key + "/in", base, t, lay)

    def scatter(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for lay in self.cases(mode):
                for how, kw, root in (("src", {"src": ranks[-1]}, gn - 1),
                                      ("group_src", {"group_src": 0}, 0),
                                      ("default", {}, 0 if g is None else None)):
                    if root is None:
                        continue
                    key = f"scatter/{gname}/{mode}/{dt}/{lay[0]}/{how}"
                    base, t = self.make(lay, dt, self.rank, salt=3)
                    ins = None
                    if me == root:
                        # the pieces are columns of one tensor when possible (strided)
                        if t.ndim == 1:
                            big = self.I.T(vals((t.shape[0], gn), dt, self.rank, salt=90))
                            ins = [big[:, i] for i in range(gn)]
                        else:
                            ins = [self.I.T(vals(t.shape, dt, self.rank, salt=90 + i))
                                   for i in range(gn)]
                    # gloo ignores the strides of the output and of the pieces
                    p = self.I.dense(t)
                    ins = ins and [self.I.dense(x) for x in ins]
                    self.call(key, self.d.scatter, mode, tensor=p, scatter_list=ins, group=g,
                              fix=[(t, p)], **kw)
                    self.rec_view(key, base, t, lay)

    def reduce_scatter(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        R = self.d.ReduceOp
        for dt in self.dtypes(mode):
            for op in short_ops(dt):
                for shape_of in (lambda i: (3,), lambda i: (2, 3), lambda i: (), lambda i: (i + 1,)):
                    label = "x".join(map(str, shape_of(0))) or "0d"
                    if shape_of(0) != shape_of(1):
                        label = "uneven"
                    key = f"reduce_scatter/{gname}/{mode}/{dt}/{op}/{label}"
                    ins = [self.I.T(vals(shape_of(i), dt, self.rank, kind_for(op), salt=i))
                           for i in range(gn)]
                    out = self.I.T(vals(shape_of(me), dt, self.rank, salt=40))
                    self.call(key, self.d.reduce_scatter, mode, output=out, input_list=ins,
                              op=getattr(R, op), group=g)
                    self.rec(key, out)
            if mode == "sync":  # a strided output
                key = f"reduce_scatter/{gname}/{mode}/{dt}/SUM/out_T"
                big = self.I.T(vals((3, 2), dt, self.rank, salt=41))
                out = big.transpose(1, 0)
                ins = [self.I.T(vals((2, 3), dt, self.rank, salt=i)) for i in range(gn)]
                p = self.I.dense(out)  # gloo ignores the strides of the output
                self.call(key, self.d.reduce_scatter, mode, output=p, input_list=ins, group=g,
                          fix=[(out, p)])
                self.rec(key, big)

    def reduce_scatter_tensor(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        R = self.d.ReduceOp
        for dt in self.dtypes(mode):
            for op in short_ops(dt):
                for shape in ((3,), (2, 3)):
                    key = f"reduce_scatter_tensor/{gname}/{mode}/{dt}/{op}/{len(shape)}d"
                    inp = self.I.T(vals((gn * shape[0],) + shape[1:], dt, self.rank, kind_for(op)))
                    out = self.I.T(vals(shape, dt, self.rank, salt=42))
                    self.call(key, self.d.reduce_scatter_tensor, mode, output=out, input=inp,
                              op=getattr(R, op), group=g)
                    self.rec(key, out)
                    self.rec(key + "/in", inp)

    def all_to_all(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for shape in ((3,), (2, 2), (), "cols"):
                label = "cols" if shape == "cols" else ("x".join(map(str, shape)) or "0d")
                key = f"all_to_all/{gname}/{mode}/{dt}/{label}"
                if shape == "cols":  # strided inputs and outputs
                    bin_ = self.I.T(vals((3, gn), dt, self.rank, salt=7))
                    bout = self.I.T(vals((3, gn + 1), dt, self.rank, salt=8))
                    ins = [bin_[:, i] for i in range(gn)]
                    outs = [bout[:, i] for i in range(gn)]
                else:
                    ins = [self.I.T(vals(shape, dt, self.rank, salt=i)) for i in range(gn)]
                    outs = [self.I.T(vals(shape, dt, self.rank, salt=20 + i)) for i in range(gn)]
                self.call(key, self.d.all_to_all, mode, output_tensor_list=outs,
                          input_tensor_list=ins, group=g)
                if shape == "cols":
                    self.rec(key, bout)
                else:
                    for i, o in enumerate(outs):
                        self.rec(f"{key}/{i}", o)

    def all_to_all_single(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        for dt in self.dtypes(mode):
            for tail in ((), (3,)):
                for how in ("even", "splits", "zeros"):
                    key = f"all_to_all_single/{gname}/{mode}/{dt}/{len(tail) + 1}d/{how}"
                    kw = {}
                    if how == "even":
                        rows_in = rows_out = 2 * gn
                    else:
                        # rank a sends f(a, b) rows to b; f symmetric, so b expects f(b, a)
                        f = (lambda a, b: a + b + 1) if how == "splits" else (lambda a, b: (a + b) % 3)
                        ins_ = [f(me, i) for i in range(gn)]
                        kw = {"input_split_sizes": ins_, "output_split_sizes": [f(i, me) for i in range(gn)]}
                        rows_in = rows_out = sum(ins_)
                    inp = self.I.T(vals((rows_in,) + tail, dt, self.rank))
                    out = self.I.T(vals((rows_out,) + tail, dt, self.rank, salt=30))
                    self.call(key, self.d.all_to_all_single, mode, output=out, input=inp, group=g, **kw)
                    self.rec(key, out)

    def coalesced(self, ctx, mode):
        gname, g, me, gn, ranks = ctx
        R = self.d.ReduceOp
        for dt in ("float32", "int64"):
            for op in ("SUM", "MAX"):
                key = f"all_reduce_coalesced/{gname}/{mode}/{dt}/{op}"
                ts = [self.I.T(vals(s, dt, self.rank, salt=k)) for k, s in enumerate([(3,), (2, 2), ()])]
                self.call(key, self.d.all_reduce_coalesced, mode, tensors=ts, op=getattr(R, op), group=g)
                for k, t in enumerate(ts):
                    self.rec(f"{key}/{k}", t)
            key = f"all_gather_coalesced/{gname}/{mode}/{dt}"
            ins = [self.I.T(vals(s, dt, self.rank, salt=k)) for k, s in enumerate([(3,), (2, 2)])]
            outs = [[self.I.T(vals(x.shape, dt, self.rank, salt=10 + i)) for x in ins] for i in range(gn)]
            # torch's Future holds output_tensor_lists, except on a group of one, where it
            # holds the flat list of that one rank's outputs; spmd always returns the lists.
            def nest(v):
                return [v] if gn == 1 and v and not isinstance(v[0], list) else v

            self.call(key, self.d.all_gather_coalesced, mode, output_tensor_lists=outs,
                      input_tensor_list=ins, group=g, norm=nest)
            for i, lst in enumerate(outs):
                for k, o in enumerate(lst):
                    self.rec(f"{key}/{i}/{k}", o)

    # -- point to point
    def p2p(self, ctx):
        gname, g, me, gn, ranks = ctx
        d = self.d
        right, left = ranks[(me + 1) % gn], ranks[(me - 1) % gn]
        # a ring of blocking send/recv: even group ranks send first, odd ones receive first
        for dt in DTYPES:
            for shape in ((4,), (2, 3), ()):
                for how in ("global", "group"):
                    key = f"sendrecv/{gname}/{dt}/{len(shape)}d/{how}"
                    t = self.I.T(vals(shape, dt, self.rank, salt=2))
                    buf = self.I.T(vals(shape, dt, self.rank, salt=3))
                    tag = 5 + len(shape)
                    if how == "global":
                        skw, rkw = {"dst": right}, {"src": left}
                    else:
                        skw, rkw = {"group_dst": (me + 1) % gn}, {"group_src": (me - 1) % gn}

                    # snd and rcv run in this iteration only: the loop variables are current.
                    def snd():
                        self.rec_s(key + "/send_ret", d.send(tensor=t, group=g, tag=tag, **skw))  # noqa: B023

                    def rcv():
                        self.rec_s(key + "/recv_ret", d.recv(tensor=buf, group=g, tag=tag, **rkw))  # noqa: B023

                    if me % 2:
                        rcv(), snd()
                    else:
                        snd(), rcv()
                    self.rec(key, buf)
        # recv from any source returns the sender's global rank
        for k, (sender, receiver) in enumerate(((1, 0), (gn - 1, 0), (0, gn - 1))):
            key = f"recv_any/{gname}/{k}"
            buf = self.I.T(np.zeros(3, np.int64))
            if me == sender:
                d.send(tensor=self.I.T(vals((3,), "int64", self.rank)), dst=ranks[receiver], group=g)
            elif me == receiver:
                self.rec_s(key + "/ret", d.recv(tensor=buf, group=g))
                self.rec(key, buf)
            d.barrier(group=g)
        # isend/irecv between every pair, tags telling the messages apart
        for dt in ("float32", "int32", "bool", "float16"):
            key = f"isend_irecv/{gname}/{dt}"
            works, bufs = [], {}
            for i in range(gn):
                if i == me:
                    continue
                bufs[i] = self.I.T(vals((2, 2), dt, self.rank, salt=60 + i))
                works.append(d.irecv(tensor=bufs[i], src=ranks[i], group=g, tag=100 + i))
            for i in range(gn):
                if i != me:
                    t = self.I.T(vals((2, 2), dt, self.rank, salt=i))
                    works.append(d.isend(tensor=t, group_dst=i, group=g, tag=100 + me))
            self.rec_s(key + "/wait", [w.wait() for w in works])
            for i, b in bufs.items():
                self.rec(f"{key}/{i}", b)
        # batch_isend_irecv: a ring both ways, peers as global ranks and as group ranks
        for how in ("peer", "group_peer"):
            key = f"batch_isend_irecv/{gname}/{how}"
            P, dist = d.P2POp, d
            from_left = self.I.T(vals((3,), "float64", self.rank, salt=70))
            from_right = self.I.T(vals((3,), "float64", self.rank, salt=71))
            to_right = self.I.T(vals((3,), "float64", self.rank, salt=72))
            to_left = self.I.T(vals((3,), "float64", self.rank, salt=73))

            def peer(i):  # used in this iteration only
                return {"peer": ranks[i]} if how == "peer" else {"group_peer": i}  # noqa: B023

            ops = [P(dist.irecv, from_left, group=g, tag=1, **peer((me - 1) % gn)),
                   P(dist.isend, to_right, group=g, tag=1, **peer((me + 1) % gn)),
                   P(dist.irecv, from_right, group=g, tag=2, **peer((me + 1) % gn)),
                   P(dist.isend, to_left, group=g, tag=2, **peer((me - 1) % gn))]
            works = d.batch_isend_irecv(ops)
            self.rec_s(key + "/wait", [w.wait() for w in works])
            self.rec(key + "/from_left", from_left)
            self.rec(key + "/from_right", from_right)

    # -- objects
    def objects(self, ctx):
        gname, g, me, gn, ranks = ctx
        d = self.d
        lst = [None] * gn
        self.rec_s(f"all_gather_object/{gname}/ret", d.all_gather_object(lst, obj(self.rank, 1), group=g))
        self.rec_s(f"all_gather_object/{gname}", lst)
        for how, kw, root in (("dst", {"dst": ranks[-1]}, gn - 1), ("group_dst", {"group_dst": 0}, 0),
                              ("default", {}, 0 if g is None else None)):
            if root is None:
                continue
            key = f"gather_object/{gname}/{how}"
            lst = [None] * gn if me == root else None
            self.rec_s(key + "/ret", d.gather_object(obj(self.rank, 2), object_gather_list=lst, group=g, **kw))
            if me == root:
                self.rec_s(key, lst)
        for how, kw, root in (("src", {"src": ranks[-1]}, gn - 1), ("group_src", {"group_src": 0}, 0),
                              ("default", {}, 0 if g is None else None)):
            if root is None:
                continue
            key = f"broadcast_object_list/{gname}/{how}"
            lst = [obj(self.rank, 3), self.rank, "r" * self.rank]
            self.rec_s(key + "/ret", d.broadcast_object_list(lst, group=g, **kw))
            self.rec_s(key, lst)
            key = f"scatter_object_list/{gname}/{how}"
            out = [None]
            ins = [obj(self.rank, 10 + i) for i in range(gn)] if me == root else None
            self.rec_s(key + "/ret", d.scatter_object_list(out, ins, group=g, **kw))
            self.rec_s(key, out)
        if gn > 1:
            for k, (sender, receiver, how) in enumerate(((1, 0, "global"), (0, gn - 1, "group"))):
                key = f"send_object_list/{gname}/{k}"
                if me == sender:
                    kw = {"dst": ranks[receiver]} if how == "global" else {"group_dst": receiver}
                    self.rec_s(key + "/send_ret", d.send_object_list([obj(self.rank, 4), k], group=g, **kw))
                elif me == receiver:
                    kw = {"src": ranks[sender]} if how == "global" else {"group_src": sender}
                    lst = [None, None]
                    self.rec_s(key + "/recv_ret", d.recv_object_list(lst, group=g, **kw))
                    self.rec_s(key, lst)
                d.barrier(group=g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("torch", "spmd"), required=True)
    p.add_argument("--out", required=True, help="directory for rank{R}.npz")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")  # non-member and deprecation warnings
    impl = TorchImpl() if args.impl == "torch" else SpmdImpl()
    rank = impl.dist.get_rank()
    results = Sequence(impl).run()
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
