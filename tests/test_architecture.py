"""The layers of spmd: imports point down only, and no module is on an import circle.

Every ``import``/``from`` of an spmd module counts, at any depth (imports inside
functions too).  A module that is not in ``LAYERS`` fails the test: give it a layer.
See README.md, "Architecture".
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spmd"

# Layer of every module (a package's modules take the package's layer unless listed).
LAYERS = {
    1: ["spmd._version", "spmd.errors", "spmd.ops", "spmd.dtypes", "spmd.arrays", "spmd._gpu",
        "spmd.futures", "spmd._wait", "spmd.work", "spmd.optable", "spmd.context",
        "spmd.backend_registry", "spmd.packing", "spmd.nodes", "spmd.launch",
        "spmd._control", "spmd.flight_recorder", "spmd._stores", "spmd._filestore", "spmd._tcpstore",
        "spmd.store", "spmd._bootstrap", "spmd._lines", "spmd._typing",
        "spmd.settings"],
    2: ["spmd.backends"],
    3: ["spmd.group", "spmd.world", "spmd.watchdog", "spmd.debug"],
    4: ["spmd.collectives", "spmd.p2p", "spmd.objects", "spmd.coalescing", "spmd.persistent",
        "spmd.monitored_barrier", "spmd.bucket_reducer", "spmd.torch"],
    5: ["spmd.mesh", "spmd.parallel_state", "spmd.topology", "spmd.mpmd", "spmd.spawn",
        "spmd._spawn_child", "spmd.checkpoint", "spmd._shard", "spmd._ckpt_plan", "spmd._mpiio",
        "spmd._mesh_args", "spmd._mesh_layout",
        "spmd._megatron_layout"],
    6: ["spmd.bench", "spmd._bench_report", "spmd._bench_gpu", "spmd.cli", "spmd.__main__", "spmd.comms_log",
        "spmd.testing",
        "spmd.trace", "spmd.fr_trace", "spmd"],
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _edges(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                full = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else (node.module or "")
                targets = [full] + [f"{full}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                target = known(t) if t.split(".")[0] == "spmd" else None
                if target is not None and target != mod:
                    edges[mod].add(target)
    # "from . import x" from inside spmd names the package too; the package is the top.
    for mod in edges:
        if mod != "spmd":
            edges[mod].discard("spmd")
    return edges


def _layer(mod: str) -> int | None:
    best = None
    for layer, names in LAYERS.items():
        for name in names:
            inside = mod.startswith(name + ".") and name != "spmd"  # the package: itself only
            if (mod == name or inside) and (
                    best is None or len(name) > len(best[1])):
                best = (layer, name)
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if _layer(m) is None)
    assert not missing, f"modules without a layer in tests/test_architecture.py: {missing}"


def test_imports_point_down_only():
    mods = _modules()
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, targets in _edges(mods).items() for t in sorted(targets)
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert not upward, "imports that point up:\n  " + "\n  ".join(upward)


def test_no_import_circle():
    edges = _edges(_modules())

    def reach(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    circles = sorted(m for m in edges if m in reach(m))
    assert not circles, f"modules on an import circle: {circles}"


def test_no_file_over_600_lines():
    long = sorted(f"{p.relative_to(ROOT.parent)}: {n}" for p in ROOT.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 600)
    assert not long, f"files over 600 lines (split them by concept): {long}"
