"""The package face: ``spmd/__init__.py`` only declares the public API.

Every name of ``spmd.__all__`` resolves; the type checkers' view (``spmd/__init__.pyi``)
names the same objects as the run-time list; a public module's short name
(``spmd.mesh``) is the very module of its long one (``spmd.layouts.mesh``), whichever
is imported first.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest

import spmd

PACKAGE = pathlib.Path(spmd.__file__).parent
INIT = PACKAGE / "__init__.py"
STUB = PACKAGE / "__init__.pyi"
# What spmd/ holds at its top besides the packages of the layers and the short names.
TOP_FILES = {"__init__", "__main__", "_version"}


def _short_modules() -> dict[str, str]:
    """{short name: long name} of the public modules that live deeper than spmd.<name>."""
    modules = {name: getattr(spmd, name) for name in spmd.__all__}
    return {name: module.__name__ for name, module in modules.items()
            if isinstance(module, types.ModuleType) and module.__name__ != f"spmd.{name}"}


def _stub_names() -> dict[str, str]:
    """{name: the dotted path it is imported from} in spmd/__init__.pyi, and
    {alias: name} for its assignments."""
    out = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Assign):
            [target] = node.targets
            assert isinstance(target, ast.Name) and isinstance(node.value, ast.Name)
            out[target.id] = node.value.id
    return out


def _resolve(dotted: str) -> object:
    module, _, attribute = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except AttributeError:     # a submodule its package has not imported
        return importlib.import_module(dotted)


def test_every_public_name_resolves_and_is_listed_by_dir():
    assert len(spmd.__all__) > 100 and len(set(spmd.__all__)) == len(spmd.__all__)
    missing = [name for name in spmd.__all__ if getattr(spmd, name, None) is None]
    assert not missing
    assert set(spmd.__all__) | {"_make_nccl_premul_sum", "__version__"} <= set(dir(spmd))
    assert spmd._make_nccl_premul_sum is spmd.make_premul_sum
    assert callable(spmd.spawn) and spmd.spawn.__module__ == "spmd.spawn.parent"


def test_the_stub_names_the_objects_of_the_runtime_list():
    stub = _stub_names()
    public = set(stub) - {"__version__", "_make_nccl_premul_sum"}
    assert public == set(spmd.__all__), (
        "spmd/__init__.pyi and spmd.__all__ differ: "
        f"only in the stub {sorted(public - set(spmd.__all__))}, "
        f"only at run time {sorted(set(spmd.__all__) - public)}")
    wrong = [f"{name}: stub {stub[name]}" for name in spmd.__all__
             if _resolve(stub[name]) is not getattr(spmd, name)]
    assert not wrong, "the stub imports another object than spmd gives:\n" + "\n".join(wrong)
    assert getattr(spmd, stub["_make_nccl_premul_sum"]) is spmd._make_nccl_premul_sum


def test_short_module_names_are_the_modules_themselves():
    short = _short_modules()
    assert {"group", "mesh", "parallel_state", "errors", "trace"} <= set(short)
    for name, long in short.items():
        module = importlib.import_module(f"spmd.{name}")
        assert module is sys.modules[long] is getattr(spmd, name), name
        assert module.__spec__.name == long, name
    from spmd.mesh import DeviceMesh
    assert DeviceMesh is spmd.DeviceMesh


def test_spmd_holds_a_file_for_each_short_name_and_no_other_module():
    files = {p.stem for p in PACKAGE.glob("*.py")} - TOP_FILES
    assert files == set(_short_modules())


@pytest.mark.parametrize("first", ["short", "long", "attribute"])
def test_short_and_long_names_agree_whichever_comes_first(first):
    """In a new interpreter, so that no earlier import decides it."""
    lines = {"short": "import spmd.{0}; from spmd.{0} import *",
             "long": "import {1}",
             "attribute": "from spmd import {0}"}[first]
    pairs = sorted(_short_modules().items())
    code = textwrap.dedent(f"""
        import importlib, sys
        pairs = {pairs!r}
        for short, long in pairs:
            exec({lines!r}.format(short, long), {{}})
        for short, long in pairs:
            module = importlib.import_module("spmd." + short)
            assert module is sys.modules[long] is getattr(sys.modules["spmd"], short), short
            assert module.__spec__.name == long, short
        print(len(pairs))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(len(pairs))


def test_the_package_init_only_declares():
    source = INIT.read_text()
    assert len(source.splitlines()) <= 150
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.ImportFrom)}
    assert "ast" not in imported and "__file__" not in source   # reads no source at import
    assert "meta_path" not in source                             # no import hooks
