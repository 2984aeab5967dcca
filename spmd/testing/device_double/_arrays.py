"""The double's device arrays (numpy memory behind CuPy's array API) and the array
functions of its ``cupy``: work on device arrays is queued on the current stream."""

from __future__ import annotations

from typing import Any

import numpy as np

from spmd.testing.device_double._device import Device, Stream, get_current_stream

__all__ = ["DeviceArray", "arange", "array", "asarray", "ascontiguousarray", "asnumpy",
           "concatenate", "copyto", "empty", "empty_like", "from_dlpack", "full", "ones",
           "zeros", "zeros_like"]


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def _plain(x: Any) -> Any:
    """The numpy array behind a device array (the same memory); anything else as it is."""
    if isinstance(x, DeviceArray):
        return x._h
    if isinstance(x, tuple):
        return tuple(_plain(k) for k in x)
    return x


def _queue(fn) -> None:
    """Run ``fn()`` on the current stream, in its turn."""
    def step() -> bool:
        with np.errstate(all="ignore"):
            fn()
        return True
    get_current_stream()._push(step)  # the double's streams queue its own kernels


def _sync() -> None:
    get_current_stream().synchronize()


def _ufunc_method(ufunc, inplace: bool = False, reflected: bool = False):
    if inplace:
        return lambda self, other: ufunc(self, other, out=(self,))
    if reflected:
        return lambda self, other: ufunc(other, self)
    return lambda self, other: ufunc(self, other)


class DeviceArray:
    """A device array: numpy memory behind CuPy's array API.  Arithmetic, copies and
    item assignment are queued on the current stream; the host reads it through
    ``get()`` (like CuPy, it refuses to become a numpy array implicitly)."""

    __slots__ = ("_h", "__weakref__")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, host: np.ndarray):
        self._h = host

    # -- attributes --------------------------------------------------------------------

    shape = property(lambda self: self._h.shape)
    dtype = property(lambda self: self._h.dtype)
    size = property(lambda self: self._h.size)
    nbytes = property(lambda self: self._h.nbytes)
    itemsize = property(lambda self: self._h.itemsize)
    ndim = property(lambda self: self._h.ndim)
    strides = property(lambda self: self._h.strides)
    flags = property(lambda self: self._h.flags)
    T = property(lambda self: DeviceArray(self._h.T))
    # Views, as CuPy's are: an in-place operation on one changes the array.
    real = property(lambda self: DeviceArray(self._h.real))
    imag = property(lambda self: DeviceArray(self._h.imag))

    @property
    def data(self) -> _Pointer:
        return _Pointer(self._h.__array_interface__["data"][0])

    @property
    def device(self) -> Device:
        return Device(0)

    @property
    def __cuda_array_interface__(self) -> dict:
        h = self._h
        return {"shape": h.shape, "typestr": h.dtype.str, "version": 3,
                "data": (h.__array_interface__["data"][0], False),
                "strides": None if h.flags.c_contiguous else h.strides}

    def __len__(self) -> int:
        return len(self._h)

    # -- views -------------------------------------------------------------------------

    def view(self, dtype=None) -> DeviceArray:
        return DeviceArray(self._h.view() if dtype is None else self._h.view(dtype))

    def reshape(self, *shape, order: str = "C") -> DeviceArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        v = self._h.view()
        try:
            v.shape = shape  # a view, or AttributeError when the layout needs a copy
        except AttributeError:
            return _copied(self, None, "C").reshape(shape)
        return DeviceArray(v)

    def ravel(self) -> DeviceArray:
        return self.reshape(-1)

    def __getitem__(self, key) -> DeviceArray:
        res = self._h[_plain(key)]
        if isinstance(res, np.ndarray) and np.may_share_memory(res, self._h):
            return DeviceArray(res)
        _sync()  # a scalar or an advanced-indexing copy: read now
        return DeviceArray(np.array(self._h[_plain(key)]))

    def __setitem__(self, key, value) -> None:
        dest, key = self._h, _plain(key)
        value = value._h if isinstance(value, DeviceArray) else np.array(value)  # host: now
        _queue(lambda: dest.__setitem__(key, value))

    # -- arithmetic: queued ---------------------------------------------------------------

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        args = tuple(_plain(x) for x in inputs)
        if method != "__call__" or ufunc.nout != 1:  # reductions and the like: now
            _sync()
            if out is not None:
                kwargs["out"] = tuple(_plain(o) for o in out)
            res = getattr(ufunc, method)(*args, **kwargs)
            return DeviceArray(np.asarray(res)) if out is None else out[0]
        if out is None:
            with np.errstate(all="ignore"):  # shape and dtype only: the data may be pending
                probe = ufunc(*args, **kwargs)
            result = DeviceArray(np.empty_like(probe))
        else:
            result = out[0]
        dest = _plain(result)
        _queue(lambda: ufunc(*args, out=dest, **kwargs))
        return result

    __add__, __sub__, __mul__ = (_ufunc_method(u) for u in (np.add, np.subtract, np.multiply))
    __truediv__, __floordiv__, __mod__ = (_ufunc_method(u) for u in
                                          (np.true_divide, np.floor_divide, np.remainder))
    __and__, __or__, __xor__ = (_ufunc_method(u) for u in
                                (np.bitwise_and, np.bitwise_or, np.bitwise_xor))
    __lt__, __le__, __gt__, __ge__ = (_ufunc_method(u) for u in
                                      (np.less, np.less_equal, np.greater, np.greater_equal))
    __eq__ = _ufunc_method(np.equal)
    __ne__ = _ufunc_method(np.not_equal)
    __radd__, __rsub__, __rmul__ = (_ufunc_method(u, reflected=True) for u in
                                    (np.add, np.subtract, np.multiply))
    __iadd__, __isub__, __imul__ = (_ufunc_method(u, inplace=True) for u in
                                    (np.add, np.subtract, np.multiply))
    __itruediv__, __ifloordiv__ = (_ufunc_method(u, inplace=True) for u in
                                   (np.true_divide, np.floor_divide))

    def __neg__(self) -> Any:
        return np.negative(self)

    # -- reads: the host waits for the current stream ----------------------------------------

    def get(self, stream: Stream | None = None, order: Any = "C", out: Any = None) -> np.ndarray:
        _sync()
        return np.array(self._h, order=order, copy=True)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def copy(self, order: str = "C") -> DeviceArray:
        return _copied(self, None, order)

    def astype(self, dtype, order: str = "K", casting: str = "unsafe", copy: bool = True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _copied(self, dtype, order)

    def item(self, *args):
        _sync()
        return self._h.item(*args)

    def tolist(self):
        _sync()
        return self._h.tolist()

    def __getattr__(self, name: str):
        """numpy's other methods (``sum``, ``max``...), run now on synchronised data."""
        method = getattr(np.ndarray, name, None)
        if method is None or not callable(method) or name.startswith("_"):
            raise AttributeError(f"DeviceArray has no attribute {name!r}")

        def call(*args, **kwargs):
            _sync()
            res = getattr(self._h, name)(*_plain(args), **kwargs)
            return DeviceArray(res) if isinstance(res, np.ndarray) else res
        return call

    def __repr__(self) -> str:  # never waits: failure reports print arrays of held devices
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def __bool__(self) -> bool:
        _sync()
        return bool(self._h)

    def __int__(self) -> int:
        _sync()
        return int(self._h)

    def __float__(self) -> float:
        _sync()
        return float(self._h)


def _copied(a: DeviceArray, dtype, order: str) -> DeviceArray:
    out = DeviceArray(np.empty(a.shape, dtype or a.dtype, order="F" if order == "F" else "C"))
    copyto(out, a, casting="unsafe")
    return out


def empty(shape, dtype=float, order: Any = "C") -> DeviceArray:
    return DeviceArray(np.empty(shape, dtype, order=order))


def zeros(shape, dtype=float, order: Any = "C") -> DeviceArray:
    return DeviceArray(np.zeros(shape, dtype, order=order))


def ones(shape, dtype=float) -> DeviceArray:
    return DeviceArray(np.ones(shape, dtype))


def full(shape, fill_value, dtype=None) -> DeviceArray:
    return DeviceArray(np.full(shape, fill_value, dtype))


def arange(*args, **kwargs) -> DeviceArray:
    return DeviceArray(np.arange(*args, **kwargs))


def empty_like(a, dtype=None) -> DeviceArray:
    return DeviceArray(np.empty(a.shape, dtype or a.dtype))


def zeros_like(a, dtype=None) -> DeviceArray:
    return DeviceArray(np.zeros(a.shape, dtype or a.dtype))


def asarray(a, dtype=None, order=None) -> DeviceArray:
    if isinstance(a, DeviceArray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else _copied(a, dtype, "C")
    return DeviceArray(np.array(a, dtype=dtype, order=order or "K"))  # an upload: now


def array(a, dtype=None, copy: bool = True, order: Any = "K") -> DeviceArray:
    if isinstance(a, DeviceArray):
        return _copied(a, dtype, order)
    return DeviceArray(np.array(a, dtype=dtype, order=order))


def ascontiguousarray(a, dtype=None) -> DeviceArray:
    if isinstance(a, DeviceArray) and a.flags.c_contiguous and \
            (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _copied(a, dtype, "C")


def copyto(dst, src, casting: Any = "same_kind") -> None:
    d = _plain(dst)
    s = _plain(src) if isinstance(src, DeviceArray) else np.array(src)  # a host array: now
    _queue(lambda: np.copyto(d, s, casting=casting))


def concatenate(arrays, axis: int = 0) -> DeviceArray:
    parts = [_plain(a) for a in arrays]
    result = np.concatenate([np.empty(p.shape, p.dtype) for p in parts], axis=axis)
    _queue(lambda: np.concatenate(parts, axis=axis, out=result))
    return DeviceArray(result)


def asnumpy(a, stream: Stream | None = None, order: Any = "C") -> np.ndarray:
    if isinstance(a, DeviceArray):
        return a.get(order=order)
    return np.asarray(a, order=order)


def from_dlpack(x) -> DeviceArray:
    return DeviceArray(np.from_dlpack(x))


