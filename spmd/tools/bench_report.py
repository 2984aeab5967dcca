"""What ``spmd bench`` prints and writes: ratios, target checks, table, JSON, plot."""

from __future__ import annotations

import json

from spmd.core.lines import write_lines
from spmd.tools.comms_log import format_size

__all__ = ["add_ratios", "targets", "table", "write_json", "plot"]

BASE = "mpi4py"
TORCH = "torch-gloo"
OURS = "spmd"
TORCH_OURS = "torch-spmd"

# The targets the bench checks (issue: "Performance and observability").
LATENCY_BOUND = 1.3        # spmd / mpi4py time at the smallest size, at most
# ... and for the calls every training step makes (issue "one way through the house":
# 8 B all_reduce, broadcast and send/recv, flight recorder on), at most this.
HOT_LATENCY_BOUND = 1.1
HOT_OPS = ("all_reduce", "broadcast", "send_recv")
BANDWIDTH_BOUND = 0.97     # spmd / mpi4py bandwidth from 1 MiB on, at least
BANDWIDTH_FROM = 1024**2
TORCH_SMALL_BOUND = 20.0   # torch / spmd time at the smallest size, at least
TORCH_LARGE_BOUND = 1.0    # torch / spmd time at the largest size, at least
FUSION_BOUND = 10.0        # separate / fused time, at least
# The torch backend (issue: "spmd as a torch.distributed backend"), torch tensors on both
# sides: gloo / torch-spmd time for all_reduce at the smallest size, and at every size.
TORCH_BACKEND_SMALL_BOUND = 20.0
TORCH_BACKEND_ANY_BOUND = 1.0


def _by_size(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        out.setdefault(r["op"], {}).setdefault(r["bytes"], {})[r["impl"]] = r
    return out


def add_ratios(results: list[dict]) -> None:
    """Set ``vs_mpi4py`` (time / mpi4py's time) on every row and ``torch_over_spmd``
    (torch's time / spmd's) on spmd rows."""
    for by_size in _by_size(results).values():
        for impls in by_size.values():
            base = impls.get(BASE)
            torch_row = impls.get(TORCH)
            for r in impls.values():
                r["vs_mpi4py"] = r["median_us"] / base["median_us"] if base else None
            ours = impls.get(OURS)
            if ours is not None:
                ours["torch_over_spmd"] = (torch_row["median_us"] / ours["median_us"]
                                           if torch_row else None)


def targets(doc: dict) -> list[dict]:
    """Each target of the issue, measured: ``{name, op, bytes, measured, measured_p10,
    bound, met}``.  ``measured`` compares medians (and decides ``met``);
    ``measured_p10`` compares p10s, which a machine busy with other work disturbs less."""
    out = []

    def add(name, op, nbytes, num, den, bound, at_least):
        measured = num["median_us"] / den["median_us"]
        out.append({"name": name, "op": op, "bytes": nbytes, "measured": measured,
                    "measured_p10": num["p10_us"] / den["p10_us"], "bound": bound,
                    "met": measured >= bound if at_least else measured <= bound})

    def worst(by_size, sizes, num, den):
        """The size at which ``num``'s time over ``den``'s is smallest."""
        return min(sizes, key=lambda s: by_size[s][num]["median_us"] / by_size[s][den]["median_us"])

    ops = _by_size(doc["results"])
    for op, by_size in ops.items():
        sizes = sorted(s for s, impls in by_size.items() if OURS in impls and BASE in impls)
        if not sizes:
            continue
        small, large = sizes[0], sizes[-1]
        add("latency: spmd / mpi4py time", op, small, by_size[small][OURS],
            by_size[small][BASE], HOT_LATENCY_BOUND if op in HOT_OPS else LATENCY_BOUND, False)
        big = [s for s in sizes if s >= BANDWIDTH_FROM]
        if big:
            w = worst(by_size, big, BASE, OURS)
            add("bandwidth: spmd / mpi4py (worst size >= 1 MiB)", op, w,
                by_size[w][BASE], by_size[w][OURS], BANDWIDTH_BOUND, True)
        checks = [(small, "speed-up over torch gloo, smallest size", TORCH_SMALL_BOUND)]
        if large != small:
            checks.append((large, "speed-up over torch gloo, largest size", TORCH_LARGE_BOUND))
        for nbytes, name, bound in checks:
            t = by_size[nbytes].get(TORCH)
            if t is not None:
                add(name, op, nbytes, t, by_size[nbytes][OURS], bound, True)
    for op, by_size in ops.items():
        sizes = sorted(s for s, impls in by_size.items() if TORCH in impls and TORCH_OURS in impls)
        if not sizes:
            continue
        if op == "all_reduce":
            add("torch backend: torch-gloo / torch-spmd time, smallest size", op, sizes[0],
                by_size[sizes[0]][TORCH], by_size[sizes[0]][TORCH_OURS],
                TORCH_BACKEND_SMALL_BOUND, True)
        w = worst(by_size, sizes, TORCH, TORCH_OURS)
        add("torch backend: torch-gloo / torch-spmd time (worst size)", op, w,
            by_size[w][TORCH], by_size[w][TORCH_OURS], TORCH_BACKEND_ANY_BOUND, True)
    fusion = {row["impl"]: row for row in doc.get("fusion", [])}
    separate = fusion.get("spmd all_reduce x N")
    # coalescing_manager is timed but has no fusion target: each call recorded in its
    # block is a Python call (about 1 us, half a small all_reduce's cost), so 256 of them
    # cost more than the fused all-reduce they become, however fast that is.
    for impl in ("spmd all_reduce_coalesced", "spmd persistent all_reduce_coalesced"):
        if separate and impl in fusion:
            add(f"fusion: {impl} vs separate all_reduce", "all_reduce",
                fusion[impl]["array_bytes"], separate, fusion[impl], FUSION_BOUND, True)
    return out


def _t(us: float) -> str:
    if us < 1000:
        return f"{us:.2f} us"
    if us < 1e6:
        return f"{us / 1e3:.3f} ms"
    return f"{us / 1e6:.3f} s"


def table(doc: dict) -> str:
    env = doc["environment"]
    n = env["world_size"]
    lines = [f"spmd bench: {n} rank(s) on {env['hosts']} host(s), {env['dtype']}, "
             f"{env['mpi_library']} (MPI {env['mpi_standard']}), mpi4py {env['mpi4py']}, "
             f"torch {env['torch'] or '-'}"
             + (f" ({env['torch_note']})" if env.get("torch_note") else "")
             + (f"; spmd's call path: {env['call_path']}" if env.get("call_path") else ""),
             "time: per call, slowest rank, median [p10 p90]; send_recv: one way (half a "
             "round trip); busbw as nccl-tests; x mpi4py: time / mpi4py's time"]
    head = (f"{'size':>10s}  {'impl':16s} {'median':>11s} {'p10':>11s} {'p90':>11s} "
            f"{'algbw GB/s':>10s} {'busbw GB/s':>10s} {'x mpi4py':>9s}")
    for op, by_size in _by_size(doc["results"]).items():
        lines += ["", f"== {op}", head, "-" * len(head)]
        for nbytes, impls in by_size.items():
            label = format_size(nbytes) if op != "barrier" else "-"
            for impl, r in impls.items():
                ratio = f"{r['vs_mpi4py']:.2f}" if r.get("vs_mpi4py") else "-"
                lines.append(f"{label:>10s}  {impl:16s} {_t(r['median_us']):>11s} "
                             f"{_t(r['p10_us']):>11s} {_t(r['p90_us']):>11s} "
                             f"{r['algbw_gbps']:10.3f} {r['busbw_gbps']:10.3f} {ratio:>9s}")
                label = ""
    if doc.get("fusion"):
        f0 = doc["fusion"][0]
        lines += ["", f"== fusion: {f0['arrays']} all-reduces of {format_size(f0['array_bytes'])}"
                  " each, per batch",
                  f"{'impl':38s} {'median':>11s} {'p10':>11s} {'p90':>11s} {'speed-up':>9s}"]
        for r in doc["fusion"]:
            lines.append(f"{r['impl']:38s} {_t(r['median_us']):>11s} {_t(r['p10_us']):>11s} "
                         f"{_t(r['p90_us']):>11s} {r['speedup_vs_separate']:8.1f}x")
    if doc.get("targets"):
        lines += ["", "== targets (medians decide; the same ratio from p10s in brackets)"]
        for t in doc["targets"]:
            size = format_size(t["bytes"]) if t["op"] != "barrier" else "-"
            lines.append(f"{'met ' if t['met'] else 'MISS'}  {t['op']:24s} {size:>9s}  "
                         f"{t['name']}: {t['measured']:.2f} (bound {t['bound']:g}; "
                         f"from p10s {t['measured_p10']:.2f})")
    return "\n".join(lines)


def write_json(doc: dict, path: str) -> None:
    if path == "-":
        write_lines(json.dumps(doc, indent=1))
        return
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def plot(doc: dict, path: str) -> None:
    """Latency and bus bandwidth vs size, one line per implementation, one row per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_op = {op: s for op, s in _by_size(doc["results"]).items() if op != "barrier"}
    rows = max(1, len(by_op))
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.2 * rows), squeeze=False)
    env = doc["environment"]
    # One colour per implementation on every row (send/recv has no persistent line).
    every = sorted({i for by_size in by_op.values() for v in by_size.values() for i in v},
                   key=_impl_order)
    colour = {impl: f"C{k}" for k, impl in enumerate(every)}
    for (op, by_size), (ax_t, ax_b) in zip(by_op.items(), axes):
        impls = sorted({i for v in by_size.values() for i in v}, key=_impl_order)
        for impl in impls:
            pts = [(s, v[impl]) for s, v in sorted(by_size.items()) if impl in v]
            xs = [s for s, _ in pts]
            style = {"marker": ".", "label": impl, "color": colour[impl]}
            ax_t.plot(xs, [r["median_us"] for _, r in pts], **style)
            ax_b.plot(xs, [r["busbw_gbps"] for _, r in pts], **style)
        for ax, ylabel in ((ax_t, "time per call (us)"), (ax_b, "busbw (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.set_title(op)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.legend(fontsize=8)
    fig.suptitle(f"spmd bench: {env['world_size']} ranks, {env['dtype']}, {env['mpi_library']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _impl_order(name: str) -> int:
    order = ("spmd", "spmd-persistent", "mpi4py", "torch-gloo", "torch-spmd")
    return order.index(name) if name in order else len(order)
