"""Type names of the public API: the arrays spmd accepts, and timeouts.

Only for annotations: nothing here runs on a call's path.  ``Array`` is made on first
use, so modules that need only ``Timeout`` (the stores) do not import numpy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

__all__ = ["Array", "CudaArrayInterface", "DLPackArray", "Timeout"]


class CudaArrayInterface(Protocol):
    """A GPU array exposing ``__cuda_array_interface__`` (cupy, numba, ...)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


class DLPackArray(Protocol):
    """An array exporting DLPack (torch tensors, cupy and jax arrays, ...)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[Any, int]: ...


# What the array arguments of collectives and point-to-point calls accept: numpy arrays,
# cupy arrays, torch tensors (CPU or CUDA), and other __cuda_array_interface__ or DLPack
# producers.  Outputs must be writable and contiguous; the checks say so at run time.
if TYPE_CHECKING:
    import numpy as np

    Array = np.ndarray | CudaArrayInterface | DLPackArray


def __getattr__(name: str) -> Any:
    if name == "Array":
        import numpy as np

        global Array
        Array = np.ndarray | CudaArrayInterface | DLPackArray
        return Array
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A timeout: a timedelta or a number of seconds.
Timeout = timedelta | float
