"""The checkpoint's index on disk: ``index.json`` and ``values.pkl``, how they are written,
and the checks that refuse a damaged or crafted checkpoint before ``load`` reads an array.

``index.json`` names every entry: an array's file, dtype and global shape, or a value
(inline JSON, or a flag that it is in ``values.pkl``, whose size and SHA-256 the index
records).  Reading it back, rank 0 checks each entry before any other file is opened
(a file name inside the directory, a dtype save writes, a shape), then each ``.npy``
file's header against its entry and its size against its header, then ``values.pkl``
against its record.  Every check here is local to one rank; ``spmd.checkpoint.save_load``
carries its verdict to the others.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
from typing import Any

import numpy as np

from spmd.checkpoint.directory import OLD_TAG, check_size, write_file
from spmd.checkpoint.mpiio import npy_header, read_npy_header
from spmd.checkpoint.plan import Reject
from spmd.core.arrays import SUPPORTED_DTYPES, bfloat16

__all__ = ["INDEX_FILE", "VALUES_FILE"]

INDEX_FILE = "index.json"
VALUES_FILE = "values.pkl"
_FORMAT = "spmd.checkpoint"
_VERSION = 1
_PICKLE_KEY = "values_pkl"  # the index's record of values.pkl: {"bytes", "sha256"}


def dtype_name(dt: np.dtype) -> str:
    """The name the index gives ``dt`` (``dtype_of`` reads it back)."""
    return dt.name


def dtype_of(name: str) -> np.dtype:
    """The dtype an index names (bfloat16 needs ml_dtypes)."""
    if name == "bfloat16":
        if bfloat16 is None:
            raise Reject(TypeError, "the checkpoint holds bfloat16 arrays: install ml_dtypes")
        return bfloat16
    return np.dtype(name)


def encode_value(name: str, value: Any) -> dict:
    """The index entry of a value: inline where JSON gives it back unchanged, else a flag
    that it is in values.pkl."""
    try:
        text = json.dumps(value, allow_nan=False)
        if json.loads(text) == value:
            return {"kind": "value", "json": value}
    except (TypeError, ValueError):
        pass
    return {"kind": "value", "pickle": True}


def check_sizes(tmp: str, entries: dict) -> None:
    """Each .npy file is as long as its header and data: a write that came up short
    fails here, before the index makes the directory a checkpoint."""
    for entry in entries.values():
        dt, shape = dtype_of(entry["dtype"]), tuple(entry["shape"])
        header = len(npy_header(dt, shape))
        data = math.prod(shape) * dt.itemsize
        check_size(os.path.join(tmp, entry["file"]), header + data,
                   f"header {header} + data {data}")


def write_index(tmp: str, entries: dict, plan0: dict, mode: int, sync: bool) -> None:
    """Write index.json into ``tmp``: the arrays' ``entries`` and rank 0's values."""
    index: dict = {"format": _FORMAT, "version": _VERSION, "entries": {}}
    for name, entry in entries.items():
        index["entries"][name] = {k: v for k, v in entry.items() if k != "writers"}
    index["entries"].update(plan0["values"])
    if plan0["pickle"] is not None:
        # load checks values.pkl against these before unpickling it
        index[_PICKLE_KEY] = {"bytes": len(plan0["pickle"]),
                              "sha256": hashlib.sha256(plan0["pickle"]).hexdigest()}
    write_file(os.path.join(tmp, INDEX_FILE),
               json.dumps(index, indent=1, sort_keys=True).encode(), mode, sync)


def read_index(path: str) -> dict:
    """Rank 0's reading of the checkpoint: the index, checked entry by entry before any
    other file is opened; the headers and sizes of the .npy files; the pickled values."""
    index_path = os.path.join(path, INDEX_FILE)
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read())
    except FileNotFoundError:
        raise Reject(FileNotFoundError, f"no checkpoint at {path!r} ({INDEX_FILE} is "
                      "missing; an interrupted save leaves only a '.tmp-*' directory)"
                      + _previous_note(path)) from None
    except (OSError, ValueError) as exc:
        raise Reject(ValueError, f"cannot read {index_path!r}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != _FORMAT:
        raise Reject(ValueError, f"{index_path!r} is not an spmd checkpoint index")
    version = index.get("version", 0)
    if not isinstance(version, int) or version > _VERSION:
        raise Reject(ValueError, f"{index_path!r} has format version {version!r}; "
                      f"this spmd reads up to {_VERSION}")
    entries = index.get("entries")
    if not isinstance(entries, dict):
        raise Reject(ValueError, f"{index_path!r} has no table of entries")
    for name, entry in entries.items():
        _check_entry(path, f"{index_path!r}: entry {name!r}", entry)
    for entry in entries.values():
        if entry["kind"] == "array":
            entry["offset"] = _check_npy(os.path.join(path, entry["file"]), entry)
    if any(e.get("pickle") for e in entries.values()):
        values = _unpickle_values(path, index.get(_PICKLE_KEY))
        for name, entry in entries.items():
            if entry.get("pickle"):
                if name not in values:
                    raise Reject(ValueError, f"{VALUES_FILE} in {path!r} lacks the value "
                                  f"{name!r} the index names")
                entry["value"] = values[name]
    return entries


def _previous_note(path: str) -> str:
    """Where an interrupted replacement left the previous checkpoint, if it did."""
    parent, base = os.path.split(os.path.abspath(path))
    try:
        olds = sorted(n for n in os.listdir(parent) if n.startswith(base + OLD_TAG))
    except OSError:
        return ""
    return (f"; a save interrupted while replacing it left the previous checkpoint at "
            f"{os.path.join(parent, olds[-1])!r}" if olds else "")


# The dtypes an index may name: those save writes (bfloat16 needs ml_dtypes to load).
_INDEX_DTYPES = frozenset(d.name for d in SUPPORTED_DTYPES) | {"bfloat16"}


def _check_entry(path: str, where: str, entry: Any) -> None:
    """Refuse an index entry save would not have written, before any file is read: a
    file name that leaves the checkpoint directory, a dtype that is not an array of
    numbers (``object`` would mean unpickling), a shape that is not one."""
    if not isinstance(entry, dict) or entry.get("kind") not in ("array", "value"):
        raise Reject(ValueError, f"{where} is neither an array nor a value entry")
    if entry["kind"] == "value":
        if "json" not in entry and entry.get("pickle") is not True:
            raise Reject(ValueError, f"{where} holds neither a JSON value nor a pickled one")
        return
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in _INDEX_DTYPES:
        raise Reject(ValueError, f"{where} has dtype {dtype!r}; a checkpoint holds arrays of "
                      f"{', '.join(sorted(_INDEX_DTYPES))} only")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise Reject(ValueError, f"{where} has shape {shape!r}; expected a list of "
                      "non-negative ints")
    fname = entry.get("file")
    if (not isinstance(fname, str) or not fname or fname.startswith(".")
            or any(c in fname for c in "/\\\0") or os.path.isabs(fname)):
        raise Reject(ValueError, f"{where} names the file {fname!r}; expected a plain file "
                      "name inside the checkpoint directory (no separator, not '..', not "
                      "absolute)")
    inside = os.path.realpath(path)
    resolved = os.path.realpath(os.path.join(path, fname))
    if os.path.dirname(resolved) != inside:
        raise Reject(ValueError, f"{where} names the file {fname!r}, which resolves to "
                      f"{resolved!r}, outside the checkpoint directory {inside!r}")


def _check_npy(fname: str, entry: dict) -> int:
    """The data offset of the .npy file ``fname``, once its header matches the index
    entry and its size matches its header."""
    try:
        descr, fortran, shape, offset = read_npy_header(fname)
        size = os.stat(fname).st_size
    except Exception as exc:  # noqa: BLE001 - numpy's parser of a damaged header fails many ways
        raise Reject(ValueError, f"cannot read the header of {fname!r}: "
                      f"{type(exc).__name__}: {exc}") from None
    dt = dtype_of(entry["dtype"])
    want = np.lib.format.dtype_to_descr(dt)
    # Compared as dtypes: numpy reads '<V2' (bfloat16) back as '|V2'.
    if fortran or shape != tuple(entry["shape"]) or np.dtype(descr) != np.dtype(want):
        raise Reject(ValueError, f"{fname!r} holds a {'Fortran' if fortran else 'C'}-order "
                      f"{descr} array of shape {shape}; the index says C-order {want} "
                      f"{tuple(entry['shape'])}")
    problem = _size_problem(fname, offset, math.prod(shape) * dt.itemsize, size)
    if problem is not None:
        raise Reject(ValueError, problem)
    return offset


def _size_problem(fname: str, offset: int, data: int, size: int) -> str | None:
    """What is wrong with a .npy file of ``size`` bytes whose header says ``offset`` +
    ``data``, or None."""
    if size == offset + data:
        return None
    what = "truncated" if size < offset + data else "longer than its header says"
    return (f"{fname!r} is {what}: expected {offset + data} bytes (header {offset} + data "
            f"{data}), got {size} bytes")


def shrunk_while_read(path: str, read: list[dict]) -> tuple | None:
    """The failure status of load when a file it read is no longer its checked size."""
    for entry in read:
        fname = os.path.join(path, entry["file"])
        data = math.prod(entry["shape"]) * dtype_of(entry["dtype"]).itemsize
        try:
            size = os.stat(fname).st_size
        except OSError as exc:
            return ("OSError", f"cannot read {fname!r}: {exc}")
        problem = _size_problem(fname, entry["offset"], data, size)
        if problem is not None:
            return ("OSError", f"cannot read {fname!r}: it changed while it was read: {problem}")
    return None


def _unpickle_values(path: str, record: Any) -> dict:
    """The values of values.pkl, once it matches the index's record of it (indexes
    written before the record existed have none: unpickled as they are)."""
    vpath = os.path.join(path, VALUES_FILE)
    try:
        with open(vpath, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise Reject(ValueError, f"cannot read {vpath!r}: {exc}") from None
    if record is not None:
        want = record.get("bytes") if isinstance(record, dict) else None
        if len(blob) != want:
            what = "truncated" if isinstance(want, int) and len(blob) < want else "damaged"
            raise Reject(ValueError, f"{vpath!r} is {what}: expected {want} bytes (the "
                          f"index's record), got {len(blob)} bytes")
        if hashlib.sha256(blob).hexdigest() != record.get("sha256"):
            raise Reject(ValueError, f"{vpath!r} is damaged: its sha256 differs from the "
                          "index's record; not unpickled")
    try:
        values = pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise Reject(ValueError, f"cannot unpickle {vpath!r} ({len(blob)} bytes): "
                      f"{type(exc).__name__}: {exc}") from None
    if not isinstance(values, dict):
        raise Reject(ValueError, f"{vpath!r} holds a {type(values).__name__}, expected the "
                      "dict save writes")
    return values
