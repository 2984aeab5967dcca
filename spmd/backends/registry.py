"""Backend names and the registry of backend factories: which engine serves which device.

``Backend`` is torch's name for a validated backend string (``"mpi"``, ``"nccl"``,
``"cpu:mpi,cuda:nccl"``); the tables map each name (and device) to what makes a group's
engine: the built-in engines are declared here (``BUILT_IN``), users add their own with
:func:`~spmd.register_backend`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from spmd.core import cuda as _gpu
from spmd.core.context import GroupContext

__all__ = ["Backend", "register_backend", "DEVICES"]

DEVICES = ("cpu", "cuda")

# The built-in engines, (name, device) -> "module:class", imported when a group first
# meets an array of that device: a program of host arrays never loads CuPy, and naming an
# engine starts no MPI.  "mpi" has a class per device (for cuda arrays: GPU-aware MPI, or
# staging through host memory).
BUILT_IN: dict[tuple[str, str], str] = {
    ("mpi", "cpu"): "spmd.backends.host:HostEngine",
    ("mpi", "cuda"): "spmd.backends.cuda_mpi:CudaMPIEngine",
    ("nccl", "cuda"): "spmd.backends.nccl.engine:NCCLEngine",
}
# c10d's default for GPU arrays, decided at a group's first one (checking NCCL sooner would
# load CuPy in every run): NCCL where it can run here, else MPI.
UNDEFINED = "undefined"

# User backends (register_backend): name -> factory(group) -> engine, and their devices.
backend_factories: dict[str, Callable] = {}
backend_devices: dict[str, tuple[str, ...]] = {}
# Debug mode: wraps each new engine so its calls are checked across ranks (None: off).
wrapper: Callable | None = None


class Backend(str):
    """A backend name, validated: ``"mpi"``, ``"nccl"`` or a per-device map such as
    ``"cpu:mpi,cuda:nccl"``.

    ``"gloo"`` is accepted as another name for MPI on host arrays, so code written for
    torch's CPU backend ports unchanged.
    """

    UNDEFINED = "undefined"
    MPI = "mpi"
    NCCL = "nccl"
    GLOO = "gloo"

    def __new__(cls, name: str):
        if not isinstance(name, str):
            raise TypeError(f"Backend: expected a str, got {type(name).__name__}")
        value = name.strip().lower()
        cls.device_map(value)
        return super().__new__(cls, value)

    @staticmethod
    def device_map(spec: str) -> dict[str, str]:
        """``"cpu:mpi,cuda:nccl"`` -> ``{"cpu": "mpi", "cuda": "nccl"}``."""
        spec = spec.strip().lower()
        known = ("mpi", "nccl", "gloo", *backend_devices)
        if ":" not in spec:
            if spec == "undefined":  # init's default: the GPU backend is picked lazily
                return {"cpu": "mpi", "cuda": "undefined"}
            if spec not in known:
                raise ValueError(f"Backend: unknown backend {spec!r}; expected one of {known} "
                                 "or a per-device map like 'cpu:mpi,cuda:nccl'")
            if spec == "nccl":
                return {"cuda": "nccl"}
            if spec == "gloo":
                return {"cpu": "mpi"}
            if spec in backend_devices:
                return {device: spec for device in backend_devices[spec]}
            return {"cpu": "mpi", "cuda": "mpi"}
        out: dict[str, str] = {}
        for part in spec.split(","):
            device, sep, name = part.strip().partition(":")
            if not sep or device not in DEVICES or name not in known:
                raise ValueError(f"Backend: cannot parse {part!r} in {spec!r}; expected "
                                 f"device:backend with device in {DEVICES} and backend in {known}")
            if device in out:
                raise ValueError(f"Backend: device {device!r} appears twice in {spec!r}")
            out[device] = "mpi" if name == "gloo" else name
        return out


def register_backend(name: str, factory: Callable[[Any], Any],
                     devices: Iterable[str] | None = None) -> None:
    """Make ``name`` usable in backend strings: ``init_process_group(backend=name)``,
    ``"cpu:mpi,cuda:<name>"``, ``new_group(backend=...)``.

    Args:
        name: the backend's name (case-insensitive); it must not be taken.
        factory: ``factory(context) -> spmd.backends.base.Engine``, called once per
            group and device the first time an array of that device meets the group, with
            the group's :class:`spmd.core.context.GroupContext` (``context.comm`` is its
            MPI communicator; ``rank``, ``size``, ``ranks``, ``name``, ``timeout`` are
            plain values).
        devices: the devices it serves, from ``("cpu", "cuda")`` (both if None).

    Raises:
        ValueError: the name is taken or malformed, or a device is unknown.
        TypeError: ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name.strip().isidentifier():
        raise ValueError(f"register_backend: name must be an identifier, got {name!r}")
    key = name.strip().lower()
    if key in names() or key == "gloo":
        raise ValueError(f"register_backend: backend {key!r} is already registered")
    if not callable(factory):
        raise TypeError(f"register_backend: factory must be callable, got {type(factory).__name__}")
    devs = DEVICES if devices is None else tuple(str(d).lower() for d in devices)
    if not devs or any(d not in DEVICES for d in devs):
        raise ValueError(f"register_backend: devices must be a non-empty subset of {DEVICES}, "
                         f"got {devices!r}")
    backend_factories[key] = factory
    backend_devices[key] = devs
    setattr(Backend, key.upper(), key)


Backend.register_backend = staticmethod(register_backend)  # type: ignore[attr-defined]


def names() -> list[str]:
    """Every backend name a group can be made with: the built-in ones and the users'."""
    return sorted({name for name, _ in BUILT_IN} | {UNDEFINED} | set(backend_factories))


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here (None when it can)."""
    if name not in names():
        return "it is not registered"
    if name == "nccl":
        return _gpu.nccl_problem()
    return None


def make_engine(group: GroupContext, device: str):
    """A new engine of ``group`` for ``device`` arrays (its ProcessGroup keeps it)."""
    name = Backend.device_map(group.backend_name).get(device)
    if name is None:
        raise RuntimeError(f"no backend handles {device} arrays in group {group.name} "
                           f"(backend {group.backend_name!r})")
    if name == UNDEFINED:
        name = "nccl" if unavailable("nccl") is None else "mpi"
    factory = backend_factories.get(name)
    if factory is None:
        module, _, cls = BUILT_IN[(name, device)].partition(":")
        factory = getattr(importlib.import_module(module), cls)
    engine = factory(group)
    if wrapper is not None:
        engine = wrapper(engine)
    return engine
