"""Registers spmd as torch.distributed's ``"spmd"`` backend, cheaply, at ``import torch``.

torch calls :func:`register` for the ``torch.backends`` entry point while it imports
(``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off; ``import spmd.torch`` registers
explicitly).  A plain ``import torch`` must not start MPI or change torch, and it does
not: importing ``spmd`` and ``spmd.torch`` starts nothing, nothing here imports more of
spmd than its settings, nor mpi4py, until a process group with the spmd backend is made
(or an spmd job's env:// rendezvous runs), and torch's env:// rendezvous is left as it
is until a process names the backend (:class:`_BackendName`).  Only ``SPMD_TORCH_MPI=1``
changes torch at import: its "mpi" backend becomes spmd's (spmd.torch._mpi_name).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

__all__ = ["BACKEND", "register"]

BACKEND = "spmd"
_DEVICES = ["cpu", "cuda"]  # a list: torch iterates a string character by character
_torch_env_handler: Callable[..., Iterator[Any]] | None = None  # torch's env://, kept by _use_env_rendezvous()


def _create(opts, pg_options):
    """torch's creator: the ProcessGroup of one group (imports spmd, starting MPI)."""
    from spmd.torch._process_group import create

    return create(opts, pg_options)


def _requested_backend() -> str:
    """The backend argument of the ``init_process_group`` call running now, or ''.

    The env:// rendezvous does not know which backend it serves; only a job that asks
    for spmd gets the MPI rendezvous, so other backends keep torch's behaviour.
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_code.co_name == "init_process_group" and \
                frame.f_globals.get("__name__") == "torch.distributed.distributed_c10d":
            return str(frame.f_locals.get("backend", "")).lower()
        frame = frame.f_back
    return ""


def _env_rendezvous(url: str, timeout=None, **kwargs):
    """torch's env:// rendezvous, or spmd's over MPI for an spmd job that lacks the
    variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) torch's needs."""
    query = parse_qs(urlparse(url).query)
    have = all(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT")) and \
        ("rank" in query or os.environ.get("RANK")) and \
        ("world_size" in query or os.environ.get("WORLD_SIZE"))
    if not have and BACKEND in _requested_backend():
        from spmd.torch._store import mpi_rendezvous

        rank = int(query["rank"][0]) if "rank" in query else -1
        size = int(query["world_size"][0]) if "world_size" in query else -1
        yield mpi_rendezvous(rank, size, timeout)
        raise RuntimeError("Unable to perform re-rendezvous using the spmd MPI rendezvous")
    assert _torch_env_handler is not None, "_use_env_rendezvous() keeps torch's env:// handler first"
    if timeout is None:
        yield from _torch_env_handler(url, **kwargs)
    else:
        yield from _torch_env_handler(url, timeout=timeout, **kwargs)


def _use_env_rendezvous() -> None:
    """Put spmd's env:// rendezvous in front of torch's (once; never raises)."""
    global _torch_env_handler
    try:
        # The module, not torch.distributed.rendezvous (a function of the same name).
        handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
        if handlers.get("env") is not _env_rendezvous and "env" in handlers:
            _torch_env_handler = handlers["env"]
            handlers["env"] = _env_rendezvous
    except Exception as exc:  # noqa: BLE001 - torch then keeps its own env://
        warnings.warn(f"spmd: could not add the MPI rendezvous to torch's env://: {exc}",
                      stacklevel=3)


class _BackendName:
    """``torch.distributed.Backend.SPMD``: the backend's name, and the moment a process
    first names the backend.

    ``Backend("spmd")``, which ``init_process_group`` calls before its rendezvous (and
    ``new_group`` and the like after it), looks the name up as this class attribute;
    reading it puts spmd's env:// rendezvous in front of torch's.  So torch's env://
    stays untouched in every process that never names the backend, and a job that does
    needs no MASTER_ADDR or RANK under mpiexec or srun.
    """

    def __get__(self, obj: object, owner: type | None = None) -> str:
        _use_env_rendezvous()
        return BACKEND


def register() -> None:
    """Register the ``"spmd"`` backend with torch.distributed (idempotent, never raises).

    Cheap: it starts no MPI (the first process group made with the backend does) and
    leaves torch's env:// rendezvous alone until the backend is named.  With
    ``SPMD_TORCH_MPI=1`` spmd also answers to torch's ``"mpi"`` name (spmd.torch._mpi_name).
    """
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        # torch's registry of backends (no public way to ask whether one is registered)
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=_DEVICES)
        # spmd records its own ops (spmd.core.flight_recorder).  torch 2.15 attaches its
        # recorder to every group of a backend not in this set, which fails for a group
        # that is a ProcessGroup subclass (it has no C++ backend to file entries under).
        c10d = importlib.import_module("torch.distributed.distributed_c10d")
        self_recording = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
        if self_recording is not None:
            self_recording.add(BACKEND)
        if not isinstance(vars(dist.Backend).get(BACKEND.upper()), _BackendName):
            setattr(dist.Backend, BACKEND.upper(), _BackendName())
    except Exception as exc:  # noqa: BLE001 - a failure here must not break `import torch`
        warnings.warn(f"spmd: could not register the torch.distributed backend: {exc}",
                      stacklevel=2)
    try:
        # Imported here, inside the guard: spmd's settings (which that reads) must not be
        # able to break `import torch`.
        from spmd.torch._mpi_name import answer_to_mpi

        answer_to_mpi()  # torch's "mpi" name too, where SPMD_TORCH_MPI=1 asks for it
    except Exception as exc:  # noqa: BLE001 - nor here
        warnings.warn(f"spmd: could not answer to torch's \"mpi\" backend name: {exc}",
                      stacklevel=2)
