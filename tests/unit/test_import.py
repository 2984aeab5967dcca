"""Importing spmd starts nothing: no MPI until a name that needs it is used
(mpi4py's own rule: ``from mpi4py import MPI`` is what starts it), and every public name
still resolves.  Each check runs in a new interpreter; tests/unit/test_package_face.py
checks the names themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str) -> str:
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_spmd_loads_no_mpi():
    assert _run("""
        import sys, spmd
        from spmd import DistError, ReduceOp, __version__
        print("mpi4py.MPI" in sys.modules, ReduceOp.SUM.name, __version__ == spmd.__version__)
    """) == "False SUM True"


def test_import_torch_starts_no_mpi_through_the_entry_point():
    pytest.importorskip("torch")
    assert _run("""
        import sys, torch, torch.distributed as dist
        import spmd.torch           # registers again, explicitly: still no MPI
        print("SPMD" in dist.Backend._plugins, "mpi4py.MPI" in sys.modules)
    """) == "True False"


def test_every_public_name_resolves_and_init_starts_mpi():
    assert _run("""
        import sys, spmd
        missing = [n for n in spmd.__all__ if getattr(spmd, n, None) is None]
        assert not missing, missing
        import spmd.group       # a short module name (tests/unit/test_package_face.py)
        spmd.init_process_group()
        from mpi4py import MPI
        print(MPI.Is_initialized(), spmd.get_world_size(), spmd.group.WORLD is not None)
        spmd.destroy_process_group()
    """) == "True 1 True"


def test_a_program_of_its_own_mpi_after_import_spmd_works_as_with_mpi4py_alone():
    assert _run("""
        import spmd
        from mpi4py import MPI          # starts MPI, as it always does
        print(MPI.Is_initialized(), MPI.COMM_WORLD.Get_size())
    """) == "True 1"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'all_reduse'"):
        import spmd

        spmd.all_reduse  # noqa: B018



def test_spawn_is_the_function_whatever_was_imported_first():
    assert _run("""
        import spmd.spawn.parent        # the subpackage first: spmd.spawn stays the function
        import spmd
        from spmd.spawn import ProcessRaisedException, spawn
        print(spmd.spawn is spawn, callable(spmd.spawn), ProcessRaisedException.__name__)
    """) == "True True ProcessRaisedException"
