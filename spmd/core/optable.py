"""The op table: every operation spmd runs, declared once.

An entry says what the op is: collective or point-to-point (which sequence numbers it
takes, so collective numbers line up across ranks), the arguments of its engine
method, the fields debug mode compares across the group (its fingerprint), and how
nccl-tests' bus bandwidth scales for it.  The debug wrapper, the flight recorder,
timelines, the comms log, bench and the engine interface read it.

Adding an op: one ``_op(...)`` line below, one method per engine that supports it
(``spmd.backends.base.Engine`` raises NotImplementedError naming op and engine for
the others), and the public function that validates and calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd.core.context import GroupContext

__all__ = ["OpSpec", "OPS", "ENGINE_OPS", "P2P_OPS", "is_p2p", "bus_factor", "work_bytes"]

Fingerprint = Callable[..., "tuple[dict, dict | None]"]


@dataclass(frozen=True)
class OpSpec:
    """One operation.

    Attributes:
        name: the op's name in Works, messages, traces and dumps.
        kind: ``"collective"`` or ``"p2p"``.
        params: the engine method's arguments (empty for ops no engine runs).
        fingerprint: ``fingerprint(group, **arguments) -> (fields, pairs)``: what every
            rank of the group must agree on (``pairs``: per-peer sizes, or None).
        bus: ``"all_reduce"``, ``"one_of_n"`` or ``"one"``: nccl-tests' bus factor.
        share_output: each rank's output is one n-th of the op's size.
    """

    name: str
    kind: str
    params: tuple[str, ...] = ()
    fingerprint: Fingerprint | None = None
    bus: str = "one"
    share_output: bool = False


def _reduce_op_name(op: Any) -> str:
    return getattr(op, "name", None) or repr(op)


def _array(a: Any) -> dict:
    return {"dtype": a.dtype.name, "shape": list(a.shape)}


def _root(group: GroupContext, root: int) -> dict:
    return {"root": group.ranks[root]}


def _split_counts(group: GroupContext, out: Any, a: Any, output_counts: Any, input_counts: Any) -> dict:
    n = group.size
    send = list(input_counts) if input_counts is not None else [a.size // n] * n
    recv = list(output_counts) if output_counts is not None else [out.size // n] * n
    return {"send": send, "recv": recv}


OPS: dict[str, OpSpec] = {}


def _op(name: str, kind: str = "collective", params: tuple[str, ...] = (),
        fingerprint: Fingerprint | None = None, bus: str = "one",
        share_output: bool = False) -> None:
    OPS[name] = OpSpec(name, kind, params, fingerprint, bus, share_output)


# Engine operations: what every engine implements (roots and peers are group ranks).
_op("broadcast", params=("tensor", "root"),
    fingerprint=lambda g, tensor, root: ({**_array(tensor), **_root(g, root)}, None))
_op("all_reduce", params=("tensor", "op"), bus="all_reduce",
    fingerprint=lambda g, tensor, op: ({**_array(tensor), "reduce_op": _reduce_op_name(op)}, None))
_op("all_reduce_coalesced", params=("tensors", "op"), bus="all_reduce",
    fingerprint=lambda g, tensors, op: ({"dtypes": [t.dtype.name for t in tensors],
                                         "shapes": [list(t.shape) for t in tensors],
                                         "reduce_op": _reduce_op_name(op)}, None))
_op("reduce", params=("tensor", "root", "op"),
    fingerprint=lambda g, tensor, root, op: ({**_array(tensor), **_root(g, root),
                                              "reduce_op": _reduce_op_name(op)}, None))
_op("all_gather", params=("outputs", "tensor"), bus="one_of_n",
    fingerprint=lambda g, outputs, tensor: ({"dtype": tensor.dtype.name,
                                             "sizes": [o.size for o in outputs]}, None))
_op("all_gather_into_tensor", params=("output", "tensor"), bus="one_of_n",
    fingerprint=lambda g, output, tensor: (_array(tensor), None))
_op("all_gather_coalesced", params=("output_lists", "inputs"), bus="one_of_n",
    fingerprint=lambda g, output_lists, inputs: ({"dtypes": [x.dtype.name for x in inputs],
                                                  "shapes": [list(x.shape) for x in inputs]},
                                                 None))
_op("gather", params=("tensor", "outputs", "root"), bus="one_of_n",
    fingerprint=lambda g, tensor, outputs, root: ({**_array(tensor), **_root(g, root)}, None))
_op("scatter", params=("tensor", "inputs", "root"), bus="one_of_n", share_output=True,
    fingerprint=lambda g, tensor, inputs, root: ({**_array(tensor), **_root(g, root)}, None))
_op("reduce_scatter", params=("output", "inputs", "op"), bus="one_of_n", share_output=True,
    fingerprint=lambda g, output, inputs, op: ({"dtype": output.dtype.name,
                                                "sizes": [x.size for x in inputs],
                                                "reduce_op": _reduce_op_name(op)}, None))
_op("reduce_scatter_tensor", params=("output", "tensor", "op"), bus="one_of_n",
    share_output=True,
    fingerprint=lambda g, output, tensor, op: ({**_array(tensor),
                                                "reduce_op": _reduce_op_name(op)}, None))
_op("all_to_all", params=("outputs", "inputs"), bus="one_of_n",
    fingerprint=lambda g, outputs, inputs: ({"dtype": outputs[0].dtype.name},
                                            {"send": [x.size for x in inputs],
                                             "recv": [o.size for o in outputs]}))
_op("all_to_all_single", params=("output", "tensor", "output_counts", "input_counts"),
    bus="one_of_n",
    fingerprint=lambda g, output, tensor, output_counts, input_counts: (
        {"dtype": tensor.dtype.name}, _split_counts(g, output, tensor, output_counts,
                                                    input_counts)))
_op("barrier", fingerprint=lambda g: ({}, None))
_op("send", "p2p", params=("tensor", "peer", "tag"))
_op("recv", "p2p", params=("tensor", "peer", "tag"))

# Operations built on the engines or on the group's communicator directly.  Those
# with a fingerprint check themselves in debug mode (spmd.backends.checked.check_call,
# check_link_call for links); their arguments are the public function's, validated.
_op("isend", "p2p")
_op("irecv", "p2p")
_op("all_gather_object", fingerprint=lambda g: ({}, None))
_op("gather_object", fingerprint=lambda g, root: (_root(g, root), None))
_op("broadcast_object_list",
    fingerprint=lambda g, object_list, root: ({**_root(g, root), "length": len(object_list)},
                                              None))
_op("scatter_object_list", fingerprint=lambda g, root: (_root(g, root), None))
# Point to point, like send/recv: one peer, not the group, so nothing to compare.
for _name in ("send_object_list", "recv_object_list"):
    _op(_name, "p2p")

# Persistent plans: checked as the collective they plan, with the plan's number in its
# group (``plan``), when the plan is made and at every start().
for _name in ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce",
              "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier"):
    _planned = OPS[_name]
    _op(f"persistent.{_name}", fingerprint=_planned.fingerprint, bus=_planned.bus,
        share_output=_planned.share_output)

# MPMD links.  Their broadcasts are collective over both programs and compare their
# fingerprint across every rank of both (``src`` is a rank of ``src_program``); the
# rest are point to point.
for _name in ("Link.isend", "Link.irecv", "Link.send", "Link.recv", "Link.send_object",
              "Link.recv_object"):
    _op(_name, "p2p")
_op("Link.broadcast", "p2p",
    fingerprint=lambda g, tensor, src, src_program: (
        {"src_program": src_program, "src": src, **_array(tensor)}, None))
_op("Link.broadcast_object", "p2p",
    fingerprint=lambda g, src, src_program: ({"src_program": src_program, "src": src}, None))

ENGINE_OPS = tuple(name for name, spec in OPS.items() if spec.params or name == "barrier")
P2P_OPS = frozenset(name for name, spec in OPS.items() if spec.kind == "p2p")


def is_p2p(op: str) -> bool:
    """True for point-to-point operations (they do not take collective numbers)."""
    return op in P2P_OPS


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests' formulas)."""
    spec = OPS.get(op)
    bus = spec.bus if spec is not None else "one"
    if bus == "all_reduce":
        return 2.0 * (n - 1) / n
    if bus == "one_of_n":
        return (n - 1) / n
    return 1.0


def _nbytes(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return int(getattr(x, "nbytes", 0) or 0)


def work_bytes(work: Any) -> int:
    """The size of the operation a Work runs (call it before the Work completes): the
    largest buffer one rank holds, as nccl-tests counts it (the array of an all-reduce,
    broadcast, reduce or send; the gathered output of an all-gather; the input of a
    reduce-scatter or an all-to-all)."""
    op = work.op
    spec = OPS.get(op)
    share = spec is not None and spec.share_output
    outputs = work.outputs
    if outputs and len(outputs) == 1 and hasattr(outputs[0], "nbytes"):  # most ops
        size = outputs[0].nbytes
        return size * work.group.size if share else size
    size = _nbytes(outputs) if outputs else 0
    if size == 0 and work.keep is not None:
        # gather on a non-root rank: only the buffer it sends is known
        size = _nbytes(work.keep) * (work.group.size if op == "gather" else 1)
    elif share:
        size *= work.group.size
    return size
