"""The checkpoint directory on disk: whole writes, the temporary directory, the swap that
makes it the checkpoint, and what crashed saves leave behind.

A save builds ``<path>.tmp-<12 hex digits>`` beside its target and, once complete, puts
it at ``path`` in one step:

- nothing at ``path`` (or ``overwrite=False``): a rename (``renameat2(RENAME_NOREPLACE)``
  on Linux), so something that appeared at ``path`` meanwhile is refused, not replaced;
- a previous checkpoint there: on Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two
  directories atomically, so ``path`` always holds a complete checkpoint, the old or the
  new.  Where the kernel or the file system cannot exchange (another OS, EINVAL from
  the file system), the old one is renamed to ``<path>.old-<hex>`` and the new one in;
  if that second rename fails, the old one is renamed back and the failure reported.
  Only a crash between those two renames leaves nothing at ``path`` (and the previous
  checkpoint at ``<path>.old-*``).

The previous checkpoint is removed only once the new one is in place (and, with
``sync``, the rename is on stable storage).

The process that builds a temporary directory holds an exclusive ``flock`` on it until
the save ends; the lock goes with the process when it dies.  At the next save of the same
path, leftovers named ``<name>.tmp-<hex>`` or ``<name>.old-<hex>``, owned by this user and
whose lock can be taken (no running save holds it) are removed; an ``.old-*`` directory
while nothing is at ``path`` (the only copy of the previous checkpoint) is kept and
reported, and so is anything whose lock cannot be tried (a file system without
``flock``).  Nothing else beside the checkpoint is touched.  Where ``flock`` is local to
a node (NFS mounted with ``local_lock``, Lustre with ``localflock``), it does not see a
save of the same path from another node at the same time; two such saves would replace
each other's checkpoint anyway.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable
from typing import NoReturn

__all__: list[str] = []

TMP_TAG = ".tmp-"
OLD_TAG = ".old-"

# One write(2) moves at most 0x7ffff000 bytes on Linux, less elsewhere: pieces of 1 GiB.
WRITE_CHUNK = 1 << 30


def write_all(fd: int, data: bytes | bytearray | memoryview, path: str) -> None:
    """Write all of ``data`` to ``fd`` (the file ``path``), however many calls it takes.

    Raises OSError naming ``path`` and how far it got when a write fails (ENOSPC,
    EDQUOT, EFBIG with SIGXFSZ ignored...) or moves nothing."""
    view = memoryview(data).cast("B")
    total, done = len(view), 0
    while done < total:
        try:
            n = os.write(fd, view[done:done + WRITE_CHUNK])
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror}: wrote {done} of {total} bytes of "
                          f"{path!r}") from None
        if n <= 0:  # a regular file that accepts nothing has no room
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: wrote {done} of "
                          f"{total} bytes of {path!r}")
        done += n


def write_file(path: str, data: bytes, mode: int, sync: bool) -> None:
    """Create ``path`` (it must not exist) with ``mode`` and ``data``; flushed to stable
    storage with ``sync``; its size checked."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask does not narrow what the caller asked for
        write_all(fd, data, path)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    check_size(path, len(data), f"{len(data)} bytes written")


def check_size(path: str, expected: int, what: str) -> None:
    """Raise OSError unless ``path`` is ``expected`` bytes long (``what`` says why)."""
    # open, then fstat: on NFS the open revalidates what a plain stat may take from cache
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != expected:
        raise OSError(errno.EIO, f"{path!r} is {size} bytes after the save, expected "
                      f"{expected} ({what})")


def tmp_name(path: str) -> str:
    """A fresh name for the temporary directory of a save to ``path``."""
    return f"{os.path.abspath(path)}{TMP_TAG}{secrets.token_hex(6)}"


def make_tmp(tmp: str, mode: int) -> int:
    """Create the directory ``tmp`` with ``mode`` and lock it against cleaners of other
    saves; returns the descriptor that holds the lock (close it when the save ends)."""
    os.mkdir(tmp, mode)
    try:
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.rmdir(tmp)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # no flock on this file system: cleaners cannot try it, so they keep it
    return fd


def remove(path: str) -> None:
    """Remove the file or directory tree ``path``; one already gone is no error."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def clean_stale(path: str) -> list[str]:
    """Remove what crashed saves of ``path`` left beside it (see the module docstring);
    returns a line for each leftover kept."""
    parent, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.(tmp|old)-[0-9a-f]{12}\Z")
    kept: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError as exc:
        return [f"cannot list {parent!r} for leftovers of earlier saves: {exc}"]
    for name in sorted(names):
        match = pattern.match(name)
        if match is None:
            continue
        full = os.path.join(parent, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if not os.path.isdir(full) or os.path.islink(full) or st.st_uid != os.geteuid():
            kept.append(f"{full!r} is not a directory of this user's; left as it is")
            continue
        if match.group(1) == "old" and not os.path.lexists(path):
            kept.append(f"{full!r} holds the checkpoint an interrupted save was replacing, "
                        f"and nothing is at {path!r}: kept (rename it back to restore it)")
            continue
        kept.extend(_remove_unlocked(full))
    return kept


def _remove_unlocked(full: str) -> list[str]:
    try:
        fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return [f"cannot open {full!r} to remove it: {exc}"]
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return [f"{full!r} is in use by a save still running; left as it is"]
        except OSError as exc:
            return [f"cannot tell whether a save still writes {full!r} (flock: "
                    f"{exc.strerror}); left as it is"]
        try:
            remove(full)
        except OSError as exc:
            return [f"cannot remove {full!r}: {exc}"]
        return []
    finally:
        os.close(fd)


# -- putting the finished directory in place -------------------------------------------

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1   # linux/fs.h
_RENAME_EXCHANGE = 2
# What renameat2 answers where the kernel or the file system lacks it (or the flag).
_CANNOT = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _libc_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    """Linux's ``renameat2(2)`` (glibc 2.28 and later), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def _rename2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where it cannot be done that way."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _CANNOT:
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def exchange(a: str, b: str) -> bool:
    """Swap the directories (or files) ``a`` and ``b`` atomically; False where the OS or
    the file system cannot (nothing changed then)."""
    return _rename2(a, b, _RENAME_EXCHANGE)


def sync_dir(path: str) -> None:
    """Flush the entries of the directory ``path`` (a rename in it) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str, path: str, replace: bool, sync: bool) -> list[str]:
    """Put the complete directory ``tmp`` at ``path``, replacing what is there if
    ``replace`` (else FileExistsError where something is).

    On success the previous checkpoint is gone (returns a line if it could not be
    removed: the next save removes it).  On OSError ``path`` holds what it held before
    and ``tmp`` is removed, except where the message says otherwise (a failed roll-back:
    it names where each checkpoint is)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not replace or not os.path.lexists(path):
        try:
            if not _rename2(tmp, path, _RENAME_NOREPLACE):
                if os.path.lexists(path):  # os.rename would replace an empty directory
                    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
                os.rename(tmp, path)
        except OSError as exc:
            discard(tmp)
            kind = FileExistsError if exc.errno == errno.EEXIST else OSError
            raise kind(exc.errno, f"cannot rename {tmp!r} to {path!r}: {exc.strerror}"
                       + (" (it appeared while the checkpoint was written)"
                          if kind is FileExistsError else "")) from None
        try:
            if sync:
                sync_dir(parent)
        except OSError as exc:
            discard(path)  # nothing was there before
            raise OSError(exc.errno, f"cannot sync the rename of {tmp!r} to {path!r}: "
                          f"{exc.strerror}; removed it again") from None
        return []
    try:
        swapped = exchange(tmp, path)
    except OSError as exc:
        discard(tmp)
        raise OSError(exc.errno, f"cannot exchange {tmp!r} with {path!r}: {exc.strerror}; "
                      f"the previous checkpoint is still at {path!r}") from None
    old = tmp if swapped else f"{os.path.abspath(path)}{OLD_TAG}{secrets.token_hex(6)}"
    if not swapped:
        _replace_by_renames(tmp, path, old)
    try:
        if sync:
            sync_dir(parent)
    except OSError as exc:
        _undo(tmp, path, old, swapped, exc)
    try:
        remove(old)
    except OSError as exc:
        return [f"the previous checkpoint, now at {old!r}, could not be removed ({exc}); "
                "the next save of this path removes it"]
    return []


def discard(path: str) -> None:
    """Remove what a failed save made, as far as possible (the next save's clean-up
    takes what is left)."""
    try:
        remove(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _undo(tmp: str, path: str, old: str, swapped: bool, exc: OSError) -> NoReturn:
    """The new checkpoint is at ``path`` but its rename is not known to be on stable
    storage: put the previous one (at ``old``) back, and raise."""
    what = f"cannot sync the rename of {tmp!r} to {path!r}: {exc.strerror}"
    new_at = path
    try:
        if swapped:
            if not exchange(tmp, path):
                raise OSError(errno.EINVAL, "the file system no longer exchanges")
        else:
            os.rename(path, tmp)
            new_at = tmp
            os.rename(old, path)
    except OSError as back:
        raise OSError(exc.errno, f"{what}; putting the previous checkpoint back failed "
                      f"({back}): the new one is at {new_at!r}, the previous one at "
                      f"{old!r}") from None
    discard(tmp)
    raise OSError(exc.errno, f"{what}; the previous checkpoint is back at {path!r}") from None


def _replace_by_renames(tmp: str, path: str, old: str) -> None:
    """Rename ``path`` to ``old`` and ``tmp`` to ``path``; if the second rename fails,
    rename ``old`` back before raising."""
    try:
        os.rename(path, old)
    except OSError as exc:
        discard(tmp)
        raise OSError(exc.errno, f"cannot rename the previous checkpoint {path!r} out of "
                      f"the way: {exc.strerror}; it is still at {path!r}") from None
    try:
        os.rename(tmp, path)
    except OSError as exc:
        try:
            os.rename(old, path)
        except OSError as back:
            raise OSError(exc.errno, f"cannot rename {tmp!r} to {path!r}: {exc.strerror}; "
                          f"and the previous checkpoint could not be renamed back "
                          f"({back.strerror}): it is at {old!r}, the new one at "
                          f"{tmp!r}") from None
        discard(tmp)
        raise OSError(exc.errno, f"cannot rename {tmp!r} to {path!r}: {exc.strerror}; the "
                      f"previous checkpoint is back at {path!r}") from None
