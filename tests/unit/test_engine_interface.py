"""The engine interface and the op table say the same thing.

``spmd.backends.base.Engine`` declares one method per op of
``spmd.core.optable.ENGINE_OPS``, with the arguments the op's table entry names (debug
mode's wrapper, the flight recorder and bench read the table; engines and the type
checker read the class), and the shared-memory engine declares the thresholds its
settings set.  Plain pytest, no MPI job.
"""

from __future__ import annotations

import inspect
import types

import pytest

from spmd.backends.base import Engine
from spmd.backends.checked import CheckedEngine
from spmd.backends.shm.engine import ShmEngine
from spmd.backends.shm.thresholds import Thresholds
from spmd.core.optable import ENGINE_OPS, OPS

# Engine's methods that are not ops of the table.
NOT_OPS = {"run", "failure", "shutdown", "abort", "on_split", "batch_p2p", "fused_start"}


def _declared_ops() -> list[str]:
    return [name for name, member in vars(Engine).items()
            if inspect.isfunction(member) and not name.startswith("_") and name not in NOT_OPS]


def test_device_backend_declares_exactly_the_engine_ops():
    declared = _declared_ops()
    assert sorted(declared) == sorted(ENGINE_OPS), (
        f"declared but not in ENGINE_OPS: {sorted(set(declared) - set(ENGINE_OPS))}; "
        f"in ENGINE_OPS but not declared: {sorted(set(ENGINE_OPS) - set(declared))}")
    assert declared == list(ENGINE_OPS), "declare the ops in the op table's order"


@pytest.mark.parametrize("name", ENGINE_OPS)
def test_each_op_takes_the_parameters_of_its_table_entry(name):
    params = list(inspect.signature(getattr(Engine, name)).parameters.values())
    assert params[0].name == "self"
    assert tuple(p.name for p in params[1:]) == OPS[name].params
    for p in params[1:]:
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}: {p.name}"
        assert p.default is inspect.Parameter.empty, f"{name}: {p.name} has a default"
        assert p.annotation is not inspect.Parameter.empty, f"{name}: {p.name} is not annotated"


@pytest.mark.parametrize("name", ENGINE_OPS)
def test_an_op_an_engine_lacks_raises_naming_op_engine_rank_and_group(name):
    engine = Engine(types.SimpleNamespace(rank=3, name="g7"))
    engine.name = "toy"
    with pytest.raises(NotImplementedError) as info:
        getattr(engine, name)(*[None] * len(OPS[name].params))
    assert str(info.value) == f"{name}: the toy backend does not implement it [rank 3, group g7]"


def test_debug_wrapper_wraps_every_engine_op():
    for name in ENGINE_OPS:
        method = vars(CheckedEngine).get(name)
        assert inspect.isfunction(method), f"CheckedEngine does not wrap {name}"
        assert method.__name__ == name


def test_shm_engine_declares_the_thresholds_its_settings_set():
    declared = {n for n in ShmEngine.__annotations__ if n.endswith(("_from", "_to"))}
    assert set(Thresholds._fields) == declared
