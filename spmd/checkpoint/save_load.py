"""Sharded checkpoints over MPI-IO: one ``.npy`` file per array, readable by plain numpy.

Every rank of a group calls :func:`~spmd.checkpoint.save` (and later :func:`~spmd.checkpoint.load`) with a dict whose
leaves are :class:`~spmd.checkpoint.Shard` blocks of global arrays, plain arrays (replicated: the same
array on every rank) or other values::

    from spmd import checkpoint as ckpt
    state = {"w": ckpt.Shard.split(w_local, dim=0),     # rows spread over the ranks
             "b": b, "step": 1200, "config": {"lr": 3e-4}}
    ckpt.save(state, "ckpt/step-1200")
    w = np.load("ckpt/step-1200/w.npy", mmap_mode="r")  # anywhere: the whole array

The directory holds ``<name>.npy`` per array (the standard header, C order: the file
``numpy.save`` would write for the global array), ``index.json`` (names, dtypes,
global shapes, values JSON can hold) and ``values.pkl`` for the values it cannot.
Nested dicts that hold arrays are flattened with ``.`` (``{"model": {"w": ...}}`` is
``model.w.npy``); a dict without arrays is one value.

How it works: every rank describes its leaves, the descriptions are all-gathered and
checked on every rank alike (same names, dtypes and global shapes everywhere; the
Shards of an array cover it exactly), so a mistake raises the same error on every
rank before any file is touched.  Rank 0 creates the files with their data's blocks
allocated, so that, where the file system preallocates (ext4, xfs, tmpfs...), a full
disk fails there, on every rank, before any data is written.
Each array is then written with MPI-IO: strided blocks collectively
(``MPI_File_write_at_all`` through subarray file views: blocks of any shape), blocks
that are byte ranges of the file (row splits) with independent writes, ranks spread
over the files (see ``spmd.checkpoint.mpiio.write_blocks``); strided local arrays without a copy.
The files go to a temporary directory next to the target, which takes the target's
place only after every rank has finished writing, every write's count has been checked,
each file's size matches its header and the data is synced: a crash leaves at most a
``<path>.tmp-*`` directory, never a complete-looking checkpoint.  An existing checkpoint
is replaced atomically (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames,
the first undone if the second fails), and removed only once the new one is in place;
leftovers of crashed saves of the same path are removed by the next save (see
``spmd.checkpoint.directory``).
:func:`~spmd.checkpoint.load` reads any block layout at any world size (resharding), whatever layout
and world size saved it.

Rules worth knowing:

- Shards of one array must cover it without overlap; the one exception is blocks
  that are *identical* in extent (replicas along a mesh dimension), of which the
  lowest rank's is written.  Replicated plain arrays are written once, split over the
  ranks.  Their contents are not compared across ranks.
- Values (non-array leaves) are taken from group rank 0.  ``values.pkl`` is a pickle,
  which :func:`~spmd.checkpoint.load` unpickles: as ``torch.load`` warns, unpickling runs
  arbitrary code, so load checkpoints only from sources you trust.
- bfloat16 (ml_dtypes) arrays are stored as ``numpy.save`` stores them, descr ``<V2``:
  plain ``numpy.load`` returns 2-byte voids, ``.view(ml_dtypes.bfloat16)`` gives the
  values back; ``load`` does that itself from the dtype in the index.
- cupy arrays are staged through host memory.
- Files are created with ``mode`` (0600 by default), the directory with the matching
  search bits (0700).
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from spmd.api.objects import all_gather_object
from spmd.checkpoint.directory import clean_stale, commit, discard, make_tmp, tmp_name, write_file
from spmd.checkpoint.index import (
    VALUES_FILE,
    check_sizes,
    dtype_name,
    dtype_of,
    encode_value,
    read_index,
    shrunk_while_read,
    write_index,
)
from spmd.checkpoint.mpiio import (
    BlockWrite,
    byte_range,
    create_npy,
    npy_header,
    read_block,
    write_blocks,
)
from spmd.checkpoint.plan import Reject, check_bounds, coverage, flatten, replicated_block
from spmd.checkpoint.shard import Shard, is_array
from spmd.core.arrays import SUPPORTED_DTYPES
from spmd.core.errors import located
from spmd.runtime.group import ProcessGroup, resolve

__all__ = ["Shard", "load", "save"]

# Tests set this to simulate a crash at a stage of save ("written", "renaming").
_fault_hook: Callable[[str], None] | None = None


def _fault(stage: str) -> None:
    if _fault_hook is not None:
        _fault_hook(stage)


_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": ValueError,
          "FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
          "OSError": OSError}


def _raise_first(op: str, errors: list, pg: ProcessGroup) -> None:
    """Raise, on every rank, the first problem any rank reported (in rank order)."""
    for r, err in enumerate(errors):
        if err is not None:
            kind, msg = err
            where = "" if pg.size() == 1 else f" (found on group rank {r})"
            raise located(_KINDS.get(kind, RuntimeError), op, msg + where, pg.context)


def _array_desc(name: str, leaf: Any, arg: str) -> dict:
    """What the other ranks need to know about one array leaf."""
    data = leaf.data if isinstance(leaf, Shard) else leaf
    dt = np.dtype(data.dtype)
    if dt not in SUPPORTED_DTYPES:
        raise Reject(TypeError, f"{arg}[{name!r}] has dtype {dt}; expected one of "
                      f"{', '.join(d.name for d in SUPPORTED_DTYPES)}")
    if isinstance(leaf, Shard):
        return {"kind": "shard", "dtype": dtype_name(dt), "gshape": leaf.global_shape,
                "start": leaf.offset, "shape": leaf.shape}
    return {"kind": "array", "dtype": dtype_name(dt), "gshape": tuple(data.shape)}


def _host(a: Any) -> np.ndarray:
    """A host array to write: numpy as it is, a GPU array copied to host memory."""
    if isinstance(a, np.ndarray):
        return a
    import cupy

    return cupy.asnumpy(cupy.asarray(a))


def _dir_mode(mode: int) -> int:
    """Search permission wherever read permission is given (0600 -> 0700, 0644 -> 0755)."""
    return mode | ((mode & 0o444) >> 2)


# -- save --------------------------------------------------------------------------------


def _local_save_plan(state: Any, path: str, mode: int, overwrite: bool, pg: ProcessGroup
                     ) -> dict:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise Reject(ValueError, f"mode must be permission bits between 0 and 0o777, got "
                     f"{mode!r}")
    leaves = flatten(state, "state")
    descs, values = {}, {}
    for name, _, _, leaf in leaves:
        if isinstance(leaf, Shard) or is_array(leaf):
            descs[name] = _array_desc(name, leaf, "state")
            if descs[name]["kind"] == "shard":
                check_bounds(name, descs[name], "state")
        else:
            descs[name] = {"kind": "value"}
            values[name] = leaf
    plan: dict = {"descs": descs}
    if pg.rank() == 0:
        if os.path.exists(path) and not overwrite:
            raise Reject(FileExistsError, f"path {path!r} exists (pass overwrite=True to "
                          "replace it)")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise Reject(FileNotFoundError, f"the directory {parent!r} for path does not exist")
        encoded = {n: encode_value(n, v) for n, v in values.items()}
        pickled = {n: values[n] for n, e in encoded.items() if "pickle" in e}
        try:
            plan["pickle"] = pickle.dumps(pickled, protocol=pickle.HIGHEST_PROTOCOL) \
                if pickled else None
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the user's value
            raise Reject(TypeError, f"a value of state cannot be pickled or stored as JSON: "
                          f"{exc}") from None
        plan["values"] = encoded
        plan["tmp"] = tmp_name(path)
    return plan


def _agree(op: str, plans: list[dict], pg: ProcessGroup) -> dict:
    """Check the gathered plans against each other; the index entries of the arrays."""
    first = plans[0]["descs"]
    entries: dict[str, dict] = {}
    for r, plan in enumerate(plans):
        d = plan["descs"]
        if d.keys() != first.keys():
            extra, missing = sorted(d.keys() - first.keys()), sorted(first.keys() - d.keys())
            raise Reject(ValueError, f"state must have the same entries on every rank: group "
                          f"rank {r} has extra {extra} and lacks {missing} compared with group "
                          "rank 0")
        for name, desc in d.items():
            ref = first[name]
            kind = "array" if desc["kind"] == "shard" else desc["kind"]
            if kind != ("array" if ref["kind"] == "shard" else ref["kind"]):
                raise Reject(TypeError, f"state[{name!r}] is a {desc['kind']} on group rank "
                              f"{r} but a {ref['kind']} on group rank 0")
            if desc["kind"] != "value" and (desc["dtype"], desc["gshape"], desc["kind"]) != (
                    ref["dtype"], ref["gshape"], ref["kind"]):
                raise Reject(ValueError, f"state[{name!r}] is a {desc['kind']} of dtype "
                              f"{desc['dtype']} and global shape {desc['gshape']} on group rank "
                              f"{r} but a {ref['kind']} of dtype {ref['dtype']} and global shape "
                              f"{ref['gshape']} on group rank 0")
    for name, ref in first.items():
        if ref["kind"] == "value":
            continue
        entry = {"kind": "array", "file": name + ".npy", "dtype": ref["dtype"],
                 "shape": list(ref["gshape"]), "sharded": ref["kind"] == "shard"}
        if ref["kind"] == "shard":
            blocks = [(r, p["descs"][name]["start"], p["descs"][name]["shape"])
                      for r, p in enumerate(plans)]
            entry["writers"] = coverage(name, blocks, tuple(ref["gshape"]))
        entries[name] = entry
    return entries


def save(state: Mapping[str, Any], path: str | os.PathLike, group: Any = None, *,
         mode: int = 0o600, overwrite: bool = False, sync: bool = True) -> None:
    """Write ``state`` as a checkpoint directory at ``path``, collectively.

    Every rank of ``group`` must call it with the same entries (see the module
    docstring for what the leaves may be).  Nothing is written unless every rank's
    state checks out; the directory appears at ``path`` only once complete.

    Args:
        state: dict of :class:`Shard`, arrays (replicated) and values.
        path: the checkpoint directory to create (its parent must exist).
        group: the group whose ranks hold the state (WORLD if None).
        mode: permission bits of the files (the directory gets matching search bits).
        overwrite: replace an existing checkpoint at ``path`` (else FileExistsError).
        sync: flush the files to stable storage before the rename makes them visible,
            and the rename itself after it (False: leave both to the kernel).

    Raises:
        TypeError: a leaf of unsupported type or dtype, or kinds that differ by rank.
        ValueError: entries, dtypes or global shapes that differ by rank; Shards that
            leave gaps, overlap or stick out of their global array; bad entry names.
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        FileNotFoundError: the parent directory of ``path`` does not exist.
        OSError: a file cannot be created (no room for the data: before any array data
            is written), written in full (ENOSPC, EDQUOT, EFBIG, a short count from
            MPI-IO), comes out at another size than its header says, or cannot be
            renamed into place.  The message names the file.

    Every error is raised on every rank alike; those above OSError before any file is
    created.  After any error, ``path`` holds what it held before the call (the
    previous checkpoint, whole and loadable, or nothing) and the temporary directory is
    removed; the one exception, a failure to put the previous checkpoint back after a
    failed rename where the OS cannot exchange two directories, says in its message
    where each checkpoint is.  A crash (a rank killed) leaves ``path`` the same and a
    ``<path>.tmp-*`` (or, in that rename window, ``<path>.old-*``) directory, which the
    next save of ``path`` removes (rank 0 warns about any it keeps: one a running save
    holds, the only copy of a previous checkpoint, one of another user's).

    Values that JSON cannot hold go to ``values.pkl``, a pickle that :func:`load`
    unpickles: only load checkpoints from sources you trust.
    """
    op = "checkpoint.save"
    pg = resolve(group, op)
    if pg is None:
        raise ValueError(f"{op}: this rank is not a member of the group")
    path = os.fspath(path)
    try:
        mine: Any = _local_save_plan(state, path, mode, overwrite, pg)
    except Reject as rej:
        mine = {"error": (rej.kind.__name__, rej.msg)}
    plans: list = [None] * pg.size()
    all_gather_object(plans, mine, group=pg)
    _raise_first(op, [p.get("error") for p in plans], pg)
    try:
        entries = _agree(op, plans, pg)
    except Reject as rej:
        raise located(rej.kind, op, rej.msg, pg.context) from None
    tmp = plans[0]["tmp"]
    leaves = {name: leaf for name, _, _, leaf in flatten(state, "state")}

    # Rank 0 clears what crashed saves of this path left, then makes the directory,
    # values.pkl, and every .npy file with its header and its data's blocks allocated
    # (where the file system preallocates, a full disk fails here, before any array
    # data moves); then all ranks write.
    status = None
    lock = None
    if pg.rank() == 0:
        for note in clean_stale(path):
            warnings.warn(f"{op}: {note}", RuntimeWarning, stacklevel=2)
        try:
            lock = make_tmp(tmp, _dir_mode(mode))
            if plans[0]["pickle"] is not None:
                write_file(os.path.join(tmp, VALUES_FILE), plans[0]["pickle"], mode, sync)
            for entry in entries.values():
                create_npy(os.path.join(tmp, entry["file"]), dtype_of(entry["dtype"]),
                           tuple(entry["shape"]), mode)
        except OSError as exc:
            status = ("OSError", f"cannot create {tmp!r}: {exc}")
    try:
        _after_failure_remove(tmp, op, status, pg)
        _write_arrays(op, tmp, entries, leaves, sync, pg)
        _fault("written")

        status = None
        if pg.rank() == 0:
            try:
                check_sizes(tmp, entries)
            except OSError as exc:
                status = ("OSError", f"a file in {tmp!r} came out wrong: {exc}")
            else:
                try:
                    write_index(tmp, entries, plans[0], mode, sync)
                except OSError as exc:
                    status = ("OSError", f"cannot write the index in {tmp!r}: {exc}")
        # Every rank is still there once the data and the index are written: a rank lost
        # before this point leaves no checkpoint, whichever rank it was.
        _after_failure_remove(tmp, op, status, pg)
        _fault("renaming")
        status = None
        if pg.rank() == 0:
            try:
                for note in commit(tmp, path, overwrite, sync):
                    warnings.warn(f"{op}: {note}", RuntimeWarning, stacklevel=2)
            except OSError as exc:
                kind = "FileExistsError" if isinstance(exc, FileExistsError) else "OSError"
                status = (kind, str(exc))
        _barrier_raise(op, status, pg)
    finally:
        if lock is not None:
            os.close(lock)


def _write_arrays(op: str, tmp: str, entries: dict, leaves: dict, sync: bool,
                  pg: ProcessGroup) -> None:
    """Every rank writes its blocks of the arrays into the files rank 0 made."""
    writes = []
    for name in sorted(entries):
        entry = entries[name]
        dt = dtype_of(entry["dtype"])
        gshape = tuple(entry["shape"])
        leaf = leaves[name]
        if entry["sharded"]:
            block = entry["writers"].get(pg.rank())
            data = _host(leaf.data) if block is not None else None
            ranges = all(byte_range(gshape, tuple(start), tuple(shape))
                         for start, shape in entry["writers"].values())
        else:
            block = replicated_block(gshape, pg.rank(), pg.size())
            data = None
            if block is not None:
                sel = tuple(slice(s, s + n) for s, n in zip(*block))
                data = _host(leaf[sel] if sel else leaf)
            ranges = True  # whole rows on every rank: byte ranges by construction
        writes.append(BlockWrite(
            os.path.join(tmp, entry["file"]), len(npy_header(dt, gshape)), gshape,
            dt.itemsize, None if block is None else tuple(block[0]), data, ranges))
    status = None
    try:
        write_blocks(pg.comm, writes, sync=sync)
    except (OSError, MPI.Exception) as exc:
        status = ("OSError", f"cannot write into {tmp!r}: {exc}")
    _after_failure_remove(tmp, op, status, pg)


def _barrier_raise(op: str, status: tuple | None, pg: ProcessGroup) -> None:
    """A barrier that also carries one rank's failure to every rank.  On the group's
    communicator itself (an object collective), so it serves groups of any backend."""
    statuses: list = [None] * pg.size()
    all_gather_object(statuses, status, group=pg)
    _raise_first(op, statuses, pg)


def _after_failure_remove(tmp: str, op: str, status: tuple | None, pg: ProcessGroup) -> None:
    """``_barrier_raise``; where some rank failed, rank 0 first removes the temporary
    directory (no rank writes into it any more: all have reported)."""
    statuses: list = [None] * pg.size()
    all_gather_object(statuses, status, group=pg)
    if pg.rank() == 0 and any(s is not None for s in statuses):
        discard(tmp)  # its allocated blocks would keep a full disk full
    _raise_first(op, statuses, pg)


# -- load --------------------------------------------------------------------------------


def _check_target(name: str, leaf: Any, entry: dict | None) -> str | None:
    """The array entry this rank reads for ``name`` (None if it is a value)."""
    if entry is None:
        raise Reject(ValueError, f"target[{name!r}]: the checkpoint has no entry {name!r}")
    is_arr = isinstance(leaf, Shard) or is_array(leaf)
    if entry["kind"] == "value":
        if is_arr:
            raise Reject(TypeError, f"target[{name!r}] is an array but the checkpoint holds a "
                          "value there")
        return None
    if not is_arr and leaf is not None:
        raise Reject(TypeError, f"target[{name!r}] is a {type(leaf).__name__}, but the "
                      "checkpoint holds an array there: pass a Shard, an array or None")
    if leaf is None:
        dtype_of(entry["dtype"])
        return name
    data = leaf.data if isinstance(leaf, Shard) else leaf
    gshape = leaf.global_shape if isinstance(leaf, Shard) else tuple(data.shape)
    if np.dtype(data.dtype) != dtype_of(entry["dtype"]):
        raise Reject(TypeError, f"target[{name!r}] has dtype {np.dtype(data.dtype)}, the "
                      f"checkpoint holds {entry['dtype']}")
    if tuple(gshape) != tuple(entry["shape"]):
        what = "global_shape" if isinstance(leaf, Shard) else "shape"
        raise Reject(ValueError, f"target[{name!r}] has {what} {tuple(gshape)}, the "
                      f"checkpoint holds {tuple(entry['shape'])}")
    if isinstance(leaf, Shard):
        check_bounds(name, {"start": leaf.offset, "shape": leaf.shape, "gshape": gshape},
                      "target")
    if isinstance(data, np.ndarray) and not data.flags.writeable:
        raise Reject(ValueError, f"target[{name!r}] is a read-only array")
    return name


def load(target: dict[str, Any], path: str | os.PathLike, group: Any = None) -> dict[str, Any]:
    """Fill ``target`` from the checkpoint at ``path``, collectively.

    Every rank of ``group`` calls it; ranks may ask for different entries and any
    block layout: a :class:`Shard` leaf is filled with its block of the saved array,
    an array leaf with the whole array, a ``None`` leaf is replaced by the saved value
    (a new numpy array for an array entry), and any other leaf by the saved value.

    .. warning::
        Values that JSON cannot hold are stored in ``values.pkl``, and ``load``
        unpickles it (with :mod:`pickle`, as ``torch.load`` and torch's object
        collectives do): unpickling runs arbitrary code.  Only load checkpoints from
        sources you trust.  The index's record of ``values.pkl`` (size, SHA-256)
        catches a damaged file, not a forged one.

    Before any array is read, rank 0 checks the index: every file it names must be a
    plain name inside ``path`` (a crafted ``../x`` or ``/etc/passwd`` is refused), every
    dtype one save writes (``object`` is refused), and every ``.npy`` file's header must
    match the index and its size match the header (a truncated file is refused, naming
    it, the bytes expected and the bytes found).

    Args:
        target: dict laid out like the saved state (nested dicts flattened the same way).
        path: the checkpoint directory.
        group: the group of the reading ranks (WORLD if None; any size).

    Returns:
        ``target``, its value leaves replaced by the saved values.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (the message names the previous
            checkpoint where a save interrupted while replacing it left one beside it).
        ValueError: an entry the checkpoint lacks, a global shape that differs, a block
            outside the array, a damaged or crafted checkpoint (an index entry that
            names a file outside ``path`` or an unsupported dtype, a truncated or
            damaged ``.npy`` file or ``values.pkl``).
        TypeError: a dtype that differs, an array where a value was saved or back.
        OSError: an array read that fails or comes back short (the file changed while
            it was read).

    Every error is raised on every rank alike: those above OSError before any array is
    read.  After an OSError the arrays of ``target`` may be partly filled and its value
    leaves are as they were; the checkpoint itself is never modified.
    """
    op = "checkpoint.load"
    pg = resolve(group, op)
    if pg is None:
        raise ValueError(f"{op}: this rank is not a member of the group")
    path = os.fspath(path)
    mine: dict = {}
    try:
        if not isinstance(target, Mapping):
            raise Reject(TypeError, f"target must be a dict, got {type(target).__name__}")
        if pg.rank() == 0:
            mine["entries"] = read_index(path)
    except Reject as rej:
        mine = {"error": (rej.kind.__name__, rej.msg)}
    gathered: list = [None] * pg.size()
    all_gather_object(gathered, mine, group=pg)
    _raise_first(op, [g.get("error") for g in gathered], pg)
    entries = gathered[0]["entries"]
    status: dict[str, Any]
    try:
        leaves = flatten(target, "target", entries)
        reads = [name for name, _, _, leaf in leaves
                 if _check_target(name, leaf, entries.get(name)) is not None]
        status = {"error": None, "reads": reads}
    except Reject as rej:
        status = {"error": (rej.kind.__name__, rej.msg), "reads": []}
    statuses: list = [None] * pg.size()
    all_gather_object(statuses, status, group=pg)
    _raise_first(op, [s["error"] for s in statuses], pg)
    # Every rank takes part in the collective read of every array some rank wants.
    wanted = sorted({n for s in statuses for n in s["reads"]})
    my_reads = set(reads)

    by_name = {name: (parent, key, leaf) for name, parent, key, leaf in leaves}
    failure = None
    for name in wanted:
        entry = entries[name]
        dt = dtype_of(entry["dtype"])
        gshape = tuple(entry["shape"])
        fname = os.path.join(path, entry["file"])
        start = out = None
        if name in my_reads:
            parent, key, leaf = by_name[name]
            if leaf is None:
                # load writes into the target's dicts (a read-only Mapping fails here)
                leaf = cast(MutableMapping, parent)[key] = np.empty(gshape, dt)
            data = leaf.data if isinstance(leaf, Shard) else leaf
            start = leaf.offset if isinstance(leaf, Shard) else (0,) * len(gshape)
            out = data if isinstance(data, np.ndarray) else np.empty(data.shape, dt)
        try:
            read_block(pg.comm, fname, entry["offset"], gshape, dt.itemsize, start, out)
        except (OSError, MPI.Exception) as exc:  # the next arrays' reads are collective
            failure = failure or ("OSError", f"cannot read {fname!r}: {exc}")
            continue
        if out is not None and out is not data:
            data[...] = _device_like(data, out)
    if failure is None and pg.rank() == 0:
        # Some MPIs report a collective read that ran into the end of a file as whole
        # (Open MPI's OMPIO at 3 ranks): a file that shrank while it was read shows here.
        failure = shrunk_while_read(path, [entries[name] for name in wanted])
    _barrier_raise(op, failure, pg)
    for name, parent, key, _leaf in leaves:
        entry = entries[name]
        if entry["kind"] == "value":
            value = entry["value"] if entry.get("pickle") else entry["json"]
            cast(MutableMapping, parent)[key] = value
    return target


def _device_like(data: Any, host: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(host)
