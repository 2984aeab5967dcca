"""Where a process is, in words: the innermost frame outside libraries (with the spmd
call it is in), for every thread inside an spmd call.  Diagnoses quote it."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from types import FrameType

__all__ = ["frame_location", "frame_of", "where"]

# spmd/ (this file is spmd/runtime/locations.py): frames in it are the library's, not the user's.
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = sysconfig.get_paths().get("stdlib", "\0")


def _is_library(filename: str) -> bool:
    return filename.startswith((_SPMD_DIR, _STDLIB, "<frozen")) or "site-packages" in filename


def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return rel if not rel.startswith("..") else filename


def frame_location(frame) -> str:
    """``file:line in func: source`` of the innermost frame outside libraries, with the
    spmd call it is in, if any."""
    inside = None
    f = frame
    while f is not None and _is_library(f.f_code.co_filename):
        if f.f_code.co_filename.startswith(_SPMD_DIR):
            inside = f.f_code.co_name
        f = f.f_back
    if f is None:
        f, inside = frame, None
    code = f.f_code
    line = linecache.getline(code.co_filename, f.f_lineno).strip()
    where = f"{_short(code.co_filename)}:{f.f_lineno} in {code.co_name}" + (f": {line}" if line else "")
    return f"in spmd.{inside}, called from {where}" if inside else f"at {where}"


def frame_of(frames: dict[int, FrameType], thread: threading.Thread) -> FrameType | None:
    """``thread``'s frame in ``frames`` (``sys._current_frames()``); None for a thread
    that has no ident yet (started, not yet running) or no frame any more."""
    ident = thread.ident
    return None if ident is None else frames.get(ident)


def where() -> str:
    """Where this process is: its main thread, and other threads inside spmd calls."""
    frames = sys._current_frames()
    main = threading.main_thread()
    frame = frame_of(frames, main)
    out = ["main thread " + frame_location(frame) if frame is not None else "main thread has exited"]
    for t in threading.enumerate():
        frame = frame_of(frames, t)
        if t is main or frame is None or t.name.startswith("spmd-"):
            continue
        loc = frame_location(frame)
        if loc.startswith("in spmd."):
            out.append(f"thread {t.name} {loc}")
    return "; ".join(out[:4])
