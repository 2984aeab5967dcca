"""The layers of spmd are its folders: imports point down only, and no module is on an import circle.

Every ``import``/``from`` of an spmd module counts, at any depth (imports inside
functions too).  Every module lives in a layer's package; a new package needs a layer
here (docs/architecture.md shows the same tree).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "spmd"

# The short names the package gives public modules that live deeper: spmd/mesh.py makes
# ``import spmd.mesh`` spmd.layouts.mesh (tests/unit/test_package_face.py).
SHORT_NAMES = {f"spmd.{name}" for name in (
    "coalescing", "comms_log", "errors", "futures", "group", "mesh", "mpmd", "parallel_state",
    "persistent", "topology", "trace")}

# The packages of each layer, bottom up.  A module takes the layer of its package.
LAYERS = {
    1: ["spmd.core"],                                   # foundations
    2: ["spmd.store"],                                  # key-value stores
    3: ["spmd.backends"],                               # engines
    4: ["spmd.runtime"],                                # groups, world, watchdog
    5: ["spmd.api", "spmd.training"],                   # what programs call
    6: ["spmd.layouts", "spmd.checkpoint", "spmd.spawn"],
    7: ["spmd.tools", "spmd.testing", "spmd", "spmd.__main__", *sorted(SHORT_NAMES),
        "spmd.torch"],   # the torch backend calls spmd's public face, as a program does
}
# The only modules outside a layer's package: the version (read by the build), the
# package itself and its short names.
TOP_LEVEL = {"spmd", "spmd.__main__", "spmd._version"} | SHORT_NAMES


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
                # "from pkg import x": x, where x is a module of pkg; else pkg itself
                # (the top package's names are its face: "from spmd import all_reduce"
                # inside spmd is an import of the top layer, and is seen as one).
                targets = [t if known(t) == t else full
                           for t in (f"{full}.{a.name}" for a in node.names)]
            else:
                continue
            for t in targets:
                target = known(t) if t.split(".")[0] == "spmd" else None
                if target is not None and target != mod:
                    edges[mod].add(target)
    return edges


def _layer(mod: str) -> int | None:
    if mod == "spmd._version":
        return 1
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
    assert not missing, f"modules without a layer in tests/unit/test_architecture.py: {missing}"


def test_every_module_lives_in_a_package_of_its_concept():
    loose = sorted(m for m in _modules() if m.count(".") == 1 and m not in TOP_LEVEL
                   and not (ROOT / m.split(".")[1] / "__init__.py").exists())
    assert not loose, f"modules at the top of spmd/ (put them in a layer's package): {loose}"


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


def test_no_file_holds_two_concepts_by_its_length():
    # One concept a file, whatever its length; past 600 lines of Python or 800 of C a
    # file has held a second concept every time this project looked.
    limits = {".py": 600, ".c": 800, ".h": 800}
    long = sorted(f"{p.relative_to(ROOT.parent)}: {n} (at most {limits[p.suffix]})"
                  for p in ROOT.rglob("*") if p.suffix in limits
                  if (n := len(p.read_text().splitlines())) > limits[p.suffix])
    assert not long, f"files too long (split them by concept): {long}"


def test_c_code_reads_no_python_attribute_by_name():
    """State crosses into C as arguments or in objects C owns (mpi4py's rule): a C
    function that looked up a Python attribute by name would turn itself off without a
    word the day that attribute is renamed."""
    lookups = ("GetAttr", "SetAttr", "HasAttr", "LookupAttr", "CallMethod", "DelAttr")
    found = []
    for path in sorted(ROOT.rglob("*.c")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(f"PyObject_{name}" in line for name in lookups):
                found.append(f"{path.relative_to(ROOT.parent)}:{number}: {line.strip()}")
    assert sorted(ROOT.rglob("*.c")), "no C source found: the check would pass vacuously"
    assert not found, "\n".join(found)


# Modules whose job is MPI itself: the engines that run on it and the rest of backends/
# (node splits, the start-up exchange, the control channel, the job as a whole, joining
# replacements, finalizing), world setup and communicator creation, shrinking and
# healing, MPI-IO, spawn's ranks, and the tools that compare with or report on MPI.
MPI_MODULES = {
    "spmd.backends.mpi.engine", "spmd.backends.mpi.fastcall", "spmd.backends.mpi.packing",
    "spmd.backends.mpi.work", "spmd.backends.mpi.persistent", "spmd.backends.mpi.objects",
    "spmd.backends.mpi.link",                           # MPMD links: intercommunicators
    "spmd.backends.mpi.routes",                         # the MPI datatype and op of each call
    "spmd.backends.mpi.faults",                         # ULFM: revoke, shrink, failed ranks
    "spmd.backends.mpi.orphans",                        # given-up requests: cancel, hold
    "spmd.backends.mpi.nodes",                          # Split_type: which ranks share a node
    "spmd.backends.mpi.control",                        # the control channel's messages
    "spmd.backends.mpi.job",                            # COMM_WORLD, MPI_APPNUM, MPI_Abort
    "spmd.backends.mpi.replacement",                    # Merge, Split: a spawned process joins
    "spmd.backends.mpi.recoverable_spawn",              # Open MPI's PMIx spawn, its library
    "spmd.backends.mpi.finalize",                       # mpi4py.rc.finalize, before MPI starts
    "spmd.backends.setup",                              # first-use set-up: its Ibarrier gate
    "spmd.backends.reduction",                          # the MPI ops of each reduction
    "spmd.backends.bootstrap",                          # the start-up exchange's sequence
    "spmd.backends.shm.algorithms", "spmd.backends.shm.reduce", "spmd.backends.shm.window",
    "spmd.backends.cuda_mpi", "spmd.backends.gpu_aware_mpi",
    "spmd.backends.checked",                            # debug mode's own communicator
    "spmd.runtime.world", "spmd.runtime.group", "spmd.layouts.mesh_groups",  # Split, Create_group
    "spmd.runtime.shrink",                              # the survivors' communicator
    "spmd.runtime.heal",                                # Spawn, Merge, the healed world
    "spmd.checkpoint.mpiio", "spmd.checkpoint.save_load",
    "spmd.spawn.child",                                 # the ranks; the caller has no MPI
    "spmd.tools.bench", "spmd.tools.bench_gpu", "spmd.tools.bench_timing",
    "spmd.tools.bench_torch", "spmd.tools.cli", "spmd.tools.trace",
}


def _mpi4py_imports(tree: ast.AST, typing_too: bool) -> list[int]:
    """The lines of the import statements in ``tree`` that name mpi4py (at any depth:
    inside functions too); with ``typing_too`` False, those under ``if TYPE_CHECKING:``
    left out."""
    typing_only = set() if typing_too else {
        id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
        and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for n in ast.walk(block)}
    lines = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "mpi4py" or n.startswith("mpi4py.") for n in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_mpi_only_where_mpi_is_the_job():
    """mpi4py is imported (at any depth; type annotations under TYPE_CHECKING aside)
    only by the modules listed above; a module that stops needing it leaves the list,
    one that starts needing it fails here."""
    importing = {mod for mod, path in _modules().items()
                 if _mpi4py_imports(ast.parse(path.read_text()), typing_too=False)}
    expected = MPI_MODULES
    assert importing == expected, (f"import mpi4py, not listed: {sorted(importing - expected)}; "
                                   f"listed, no longer import it: {sorted(expected - importing)}")


# Where MPI may be imported freely: the engines' layer, the tools that measure it, and
# the two modules that make the world and its groups.  Everywhere else MPI is reached
# through them, and the files that still import it stay few.
MPI_HOMES = ("backends/", "tools/", "runtime/world.py", "runtime/group.py")
MPI_IMPORTERS_ELSEWHERE_MAX = 8


def _mpi_importers_elsewhere(root: pathlib.Path) -> list[str]:
    """Files under ``root`` outside MPI_HOMES with any import statement that names
    mpi4py (type-checking ones too), as ``spmd/path:line`` of the first."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(MPI_HOMES):
            continue
        lines = _mpi4py_imports(ast.parse(path.read_text()), typing_too=True)
        if lines:
            found.append(f"spmd/{rel}:{lines[0]}")
    return found


def test_mpi_sealed_in_backends_but_for_a_few_files():
    """At most MPI_IMPORTERS_ELSEWHERE_MAX files outside backends/, tools/,
    runtime/world.py and runtime/group.py import mpi4py at all (an import under
    TYPE_CHECKING counts: it still ties the file to MPI's types)."""
    found = _mpi_importers_elsewhere(ROOT)
    assert len(found) <= MPI_IMPORTERS_ELSEWHERE_MAX, (
        f"{len(found)} files outside {', '.join(MPI_HOMES)} import mpi4py (at most "
        f"{MPI_IMPORTERS_ELSEWHERE_MAX}; reach MPI through backends/ instead):\n  "
        + "\n  ".join(found))


def test_the_mpi_import_count_sees_every_kind_of_import(tmp_path):
    """The count above finds a plain, a dotted, a nested and a TYPE_CHECKING import, and
    passes over files in MPI_HOMES, a relative import and a mention in a string."""
    files = {
        "core/plain.py": "import mpi4py\n",
        "core/dotted.py": "import os, mpi4py.util.pkl5\n",
        "core/nested.py": "def f():\n    from mpi4py import MPI\n    return MPI\n",
        "core/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from mpi4py import MPI\n"),
        "core/none.py": "'from mpi4py import MPI'\nfrom . import mpi4py\n",
        "backends/engine.py": "from mpi4py import MPI\n",
        "runtime/world.py": "from mpi4py import MPI\n",
        "runtime/other.py": "x = 1\n\n\nfrom mpi4py import MPI\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _mpi_importers_elsewhere(tmp_path) == [
        "spmd/core/dotted.py:1", "spmd/core/nested.py:2", "spmd/core/plain.py:1",
        "spmd/core/typed.py:3", "spmd/runtime/other.py:4"]


def _foreign_private_reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """``x._name`` in ``path`` where x is not self/cls and the module defines no
    ``_name`` of its own (no def, class, slot, assignment): a read of another module's
    object's private attribute."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    own.add(target.id)
                    if target.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                        own.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.attr not in own:
            # (self/cls: its own; sys._getframe and sys._current_frames: CPython documents them)
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "sys"):
                continue
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_few_reads_of_other_modules_private_attributes_each_with_its_reason():
    """Reads of another module's objects' private attributes stay below 30, and each
    says why on its line or the line above (a comment)."""
    reads, silent = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for lineno, text in _foreign_private_reads(path):
            reads += 1
            here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                silent.append(f"{path.relative_to(ROOT.parent)}:{lineno}: {text}")
    assert reads < 30, reads
    assert not silent, "\n".join(silent)
