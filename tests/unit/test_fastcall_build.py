"""The compiled call path is built wherever a C compiler is (its MPI behaviour:
tests/engines/test_fastcall.py)."""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig

import pytest

from spmd.backends.mpi import fastcall


def test_the_extension_is_built_where_a_compiler_is():
    """pip builds spmd.backends.mpi._fastcall where a C compiler and Python's headers are present; a
    missing build would silently leave only the Python path tested."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    compiler = shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc")
    if not (headers and compiler):
        pytest.skip("no C compiler or no Python headers: the Python path is the only one")
    import spmd.backends.mpi._fastcall as _fastcall  # noqa: F401 - the import is the check

    # (fastcall.compiled is set when a group binds it, at init_process_group: not here)
    assert fastcall._module is _fastcall, fastcall.reason


def test_an_extension_of_another_version_turns_the_path_off(monkeypatch):
    """An extension built from other sources (bind's keywords differ) leaves the Python
    path in charge with the reason said, instead of failing spmd's import."""
    class Stale:
        def bind(self, *, functions, handle_size, in_place):   # an older set of keywords
            raise AssertionError("not reached: spmd passes keywords this bind lacks")

    if fastcall._module is None:
        pytest.skip("the extension is not built")
    monkeypatch.setenv("SPMD_FASTCALL", "1")
    monkeypatch.setattr(fastcall, "_module", Stale())
    monkeypatch.setattr(fastcall, "compiled", None)
    monkeypatch.setattr(fastcall, "reason", "")
    fastcall.bind()
    assert fastcall.compiled is None
    assert "does not match spmd" in fastcall.reason and "unexpected keyword" in fastcall.reason


def test_the_build_lists_every_file_of_the_extension():
    """pyproject.toml names each C file of the extension as a source and each header as a
    dependency (which also puts it in the sdist): a file left out fails a fresh build, or
    a changed header leaves a stale one."""
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        modules = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    (ext,) = [m for m in modules if m["name"] == "spmd.backends.mpi._fastcall"]
    here = os.path.join(root, "spmd", "backends", "mpi")

    def on_disk(pattern):
        return sorted(os.path.relpath(f, root).replace(os.sep, "/")
                      for f in glob.glob(os.path.join(here, pattern)))

    assert sorted(ext["sources"]) == on_disk("_fastcall*.c")
    assert sorted(ext["depends"]) == on_disk("_fastcall*.h")
