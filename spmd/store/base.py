"""The stores that need nothing but the standard library: the Store interface,
HashStore, FileStore and PrefixStore (``spmd.store`` is the public module)."""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TypeVar

from spmd.core.errors import DistStoreError
from spmd.core.timeouts import DEFAULT_STORE_TIMEOUT, to_seconds
from spmd.core.typing import Timeout

# A value to store: bytes, or str (stored UTF-8 encoded).
Value = bytes | bytearray | str
_S = TypeVar("_S", bound="Store")

__all__ = ["DEFAULT_TIMEOUT", "Store", "HashStore", "PrefixStore", "dict_add", "dict_compare_set"]

DEFAULT_TIMEOUT = DEFAULT_STORE_TIMEOUT   # torch's Store default (spmd.core.timeouts)


# ----------------------------------------------------------------------------- checks
def _check_key(key, method: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"{method}: key must be str, got {type(key).__name__}")
    return key


def _check_keys(keys, method: str) -> list:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"{method}: keys must be a list of str, got {type(keys).__name__}")
    return [_check_key(k, method) for k in keys]


def _check_value(value, method: str, what: str = "value") -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"{method}: {what} must be bytes or str, got {type(value).__name__}")


def _parse_counter(key: str, raw: bytes) -> int:
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise DistStoreError(
            f"add: the value of key {key!r} is not an integer: {raw[:40]!r}"
        ) from None


def dict_add(data: dict, key: str, amount: int) -> int:
    new = _parse_counter(key, data.get(key, b"0")) + amount
    data[key] = str(new).encode("ascii")
    return new


def dict_compare_set(data: dict, key: str, expected: bytes, desired: bytes) -> bytes:
    """c10d's compareSet on a dict: returns the value now stored (or `expected`)."""
    current = data.get(key)
    if (current is None and expected == b"") or (current is not None and current == expected):
        data[key] = desired
        return desired
    return expected if current is None else current


# ----------------------------------------------------------------------------- base
class Store:
    """Base class of the key-value stores.

    The public methods check their arguments and then call ``_``-prefixed hooks
    that the subclasses implement; waiting hooks get the timeout in seconds and
    report a timeout by returning ``None`` (or the list of missing keys).

    Args:
        timeout: default timeout of :meth:`get`, :meth:`wait` and :meth:`multi_get`.
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT):
        self._timeout_s = to_seconds(timeout, type(self).__name__)

    # ------------------------------------------------------------------ timeout
    @property
    def timeout(self) -> timedelta:
        """The default timeout of the blocking operations."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the default timeout (a timedelta or seconds; ValueError if negative)."""
        self._timeout_s = to_seconds(timeout, "set_timeout")

    def _seconds(self, timeout, method: str) -> float:
        if timeout is None:
            return self.timeout.total_seconds()
        return to_seconds(timeout, method)

    def _timeout_error(self, method: str, keys: list, seconds: float) -> DistStoreError:
        what = f"key {keys[0]!r}" if len(keys) == 1 else f"keys {keys!r}"
        return DistStoreError(
            f"{type(self).__name__}.{method}: timed out after {seconds:g} s waiting for {what}"
        )

    # ------------------------------------------------------------------ public API
    def set(self, key: str, value: Value) -> None:
        """Store `value` (bytes or str) under `key`, overwriting any old value."""
        self._set(_check_key(key, "set"), _check_value(value, "set"))

    def get(self, key: str) -> bytes:
        """Return the value of `key`, waiting up to the store's timeout for it.

        Raises:
            DistStoreError: the key did not appear before the timeout.
        """
        key = _check_key(key, "get")
        seconds = self.timeout.total_seconds()
        value = self._get(key, seconds)
        if value is None:
            raise self._timeout_error("get", [key], seconds)
        return value

    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer counter `key` (0 if missing); return it.

        Raises:
            DistStoreError: the key holds a value that is not a decimal integer.
        """
        key = _check_key(key, "add")
        if isinstance(amount, bool) or not isinstance(amount, numbers.Integral):
            raise TypeError(f"add: amount must be int, got {type(amount).__name__}")
        return self._add(key, int(amount))

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        """Set `key` to `desired_value` if it holds `expected_value`; return the value now stored.

        As in c10d: a missing key is set only if `expected_value` is empty; when
        nothing is set, the current value is returned, or `expected_value` if the
        key is missing.
        """
        key = _check_key(key, "compare_set")
        expected = _check_value(expected_value, "compare_set", "expected_value")
        desired = _check_value(desired_value, "compare_set", "desired_value")
        return self._compare_set(key, expected, desired)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Wait until all `keys` exist (timeout: timedelta or seconds; None: the store's).

        Raises:
            DistStoreError: some keys were still missing at the timeout.
        """
        keys = _check_keys(keys, "wait")
        seconds = self._seconds(timeout, "wait")
        missing = self._wait(keys, seconds)
        if missing:
            raise self._timeout_error("wait", missing, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether all `keys` exist, without waiting."""
        return self._check(_check_keys(keys, "check"))

    def delete_key(self, key: str) -> bool:
        """Delete `key`; return whether it existed."""
        return self._delete_key(_check_key(key, "delete_key"))

    def num_keys(self) -> int:
        """Return the number of keys in the store."""
        return self._num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of `keys`, waiting up to the store's timeout for all of them."""
        keys = _check_keys(keys, "multi_get")
        seconds = self.timeout.total_seconds()
        values, missing = self._multi_get(keys, seconds)
        if missing:
            raise self._timeout_error("multi_get", missing, seconds)
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set each of `keys` to the matching entry of `values`."""
        keys = _check_keys(keys, "multi_set")
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(f"multi_set: values must be a list, got {type(values).__name__}")
        values = [_check_value(v, "multi_set") for v in values]
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._multi_set(keys, values)

    def close(self) -> None:
        """Release the store's resources (a no-op for stores that have none)."""

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks
    def _set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _get(self, key: str, seconds: float) -> bytes | None:
        raise NotImplementedError

    def _add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        raise NotImplementedError

    def _wait(self, keys: list, seconds: float) -> list:
        raise NotImplementedError

    def _check(self, keys: list) -> bool:
        raise NotImplementedError

    def _delete_key(self, key: str) -> bool:
        raise NotImplementedError

    def _num_keys(self) -> int:
        raise NotImplementedError

    def _multi_get(self, keys: list, seconds: float):
        """Return ``(values, [])``, or ``(None, missing_keys)`` on timeout."""
        missing = self._wait(keys, seconds)
        if missing:
            return None, missing
        values = [self._get(k, 0.0) for k in keys]
        gone = [k for k, v in zip(keys, values) if v is None]  # deleted meanwhile
        return (None, gone) if gone else (values, [])

    def _multi_set(self, keys: list, values: list) -> None:
        for k, v in zip(keys, values):
            self._set(k, v)


# ----------------------------------------------------------------------------- HashStore
class HashStore(Store):
    """An in-process store, safe to share between threads.

    Blocking operations sleep on a condition variable that every write notifies.
    """

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self._data: dict = {}
        self._cond = threading.Condition()

    def _set(self, key, value):
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _get(self, key, seconds):
        with self._cond:
            if self._cond.wait_for(lambda: key in self._data, seconds):
                return self._data[key]
            return None

    def _add(self, key, amount):
        with self._cond:
            new = dict_add(self._data, key, amount)
            self._cond.notify_all()
            return new

    def _compare_set(self, key, expected, desired):
        with self._cond:
            result = dict_compare_set(self._data, key, expected, desired)
            self._cond.notify_all()
            return result

    def _wait(self, keys, seconds):
        with self._cond:
            self._cond.wait_for(lambda: all(k in self._data for k in keys), seconds)
            return [k for k in keys if k not in self._data]

    def _check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete_key(self, key):
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self):
        with self._cond:
            return len(self._data)

    def _multi_get(self, keys, seconds):
        with self._cond:
            self._cond.wait_for(lambda: all(k in self._data for k in keys), seconds)
            missing = [k for k in keys if k not in self._data]
            return (None, missing) if missing else ([self._data[k] for k in keys], [])

    def _multi_set(self, keys, values):
        with self._cond:
            self._data.update(zip(keys, values))
            self._cond.notify_all()


# ----------------------------------------------------------------------------- FileStore
class PrefixStore(Store):
    """A view of another store that prefixes every key with ``f"{prefix}/"``.

    The timeout is the underlying store's (reading or setting it here reads or sets
    it there), and :meth:`~spmd.Store.num_keys` counts all the keys of the underlying store, as
    in c10d.

    Args:
        prefix: the namespace.
        store: the underlying store (may itself be a PrefixStore).
    """

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore: prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore: store must be a Store, got {type(store).__name__}")
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The store that holds the prefixed keys."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The underlying store's default timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the underlying store's default timeout."""
        self._store.set_timeout(timeout)

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _unk(self, keys: list) -> list:
        n = len(self._prefix) + 1
        return [k[n:] for k in keys]

    def _set(self, key, value):
        self._store._set(self._k(key), value)

    def _get(self, key, seconds):
        return self._store._get(self._k(key), seconds)

    def _add(self, key, amount):
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys, seconds):
        return self._unk(self._store._wait([self._k(k) for k in keys], seconds))

    def _check(self, keys):
        return self._store._check([self._k(k) for k in keys])

    def _delete_key(self, key):
        return self._store._delete_key(self._k(key))

    def _num_keys(self):
        return self._store._num_keys()

    def _multi_get(self, keys, seconds):
        values, missing = self._store._multi_get([self._k(k) for k in keys], seconds)
        return values, self._unk(missing)

    def _multi_set(self, keys, values):
        self._store._multi_set([self._k(k) for k in keys], values)
