"""What an uncaught exception's traceback shows: the program's frames down to its call
into spmd, without the frames inside spmd below that call (as JAX filters its own).

An error spmd raises is about the program's call (a bad argument, a peer that never
came): the line that made the call is what the reader needs, and the four to six frames
of validation, engine and wait helper under it only push that line out of sight.  Only
the frames at the innermost end of a traceback that lie inside the spmd package are left
out, and one line says so where they were: frames of the program or of other libraries
stay, also where spmd calls back into them, and so does the exception's type and message.
A traceback whose frames are all spmd's, or whose call into spmd came from a launcher
(``spmd bench``'s console script, ``python -m``), is spmd's own error and is shown whole.

Only what is printed changes, and only when the exception reaches ``sys.excepthook``
(``spmd.runtime.abort``): the exception object and its ``__traceback__`` keep every
frame, so a program that catches the error and prints it itself
(``traceback.print_exc()``) sees spmd's frames too, and a call that succeeds pays nothing.
``SPMD_TRACEBACK=full`` shows every frame.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

from spmd.core.settings import read

__all__ = ["LEFT_OUT", "format_uncaught"]

LEFT_OUT = "  [frames inside spmd/ left out: SPMD_TRACEBACK=full shows them]\n"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class _Trimmed(traceback.StackSummary):
    """A stack cut short: it prints, after its frames, the line that says so."""

    def format(self, *args, **kwargs) -> list[str]:
        return [*super().format(*args, **kwargs), LEFT_OUT]

    def __bool__(self) -> bool:   # printed with no frame left too: its line says why
        return True


def _inside_spmd(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _launcher_dirs() -> tuple[list[str], list[str]]:
    """(folders whose files start programs, folders of installed packages inside them)."""
    paths = sysconfig.get_paths()
    starters = [paths["stdlib"], paths["platstdlib"], paths["scripts"],
                os.path.dirname(sys.executable)]
    try:
        starters.append(sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user")))
    except (KeyError, ValueError):   # a Python built without a user scheme
        pass
    packages = [paths["purelib"], paths["platlib"]]
    return ([os.path.abspath(d) + os.sep for d in starters if d],
            [os.path.abspath(d) + os.sep for d in packages if d])


def _launcher(filename: str, dirs: tuple[list[str], list[str]]) -> bool:
    """Whether a frame of ``filename`` is a launcher's (runpy, a console script) rather than
    the program's or a library's."""
    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    starters, packages = dirs
    return any(path.startswith(d) for d in starters) and \
        not any(path.startswith(d) for d in packages)


def _trim(te: traceback.TracebackException, chained: bool,
          dirs: tuple[list[str], list[str]]) -> None:
    """Cut ``te``'s stack at the program's call into spmd.  A chained exception (a cause
    or context) whose frames all lie inside spmd, raised and caught there, loses them all;
    the exception that reached the hook keeps a stack with no frame of the program."""
    stack = te.stack
    cut = len(stack)
    while cut > 0 and _inside_spmd(stack[cut - 1].filename):
        cut -= 1
    if cut == len(stack):
        return
    if cut == 0 and not chained:
        return
    if cut > 0 and _launcher(stack[cut - 1].filename, dirs):
        return
    te.stack = _Trimmed(stack[:cut])


def format_uncaught(exc_type, exc, tb) -> str:
    """The text of an uncaught exception's traceback, spmd's own frames left out unless
    ``SPMD_TRACEBACK=full`` (a setting spmd cannot read shows every frame, and says why)."""
    te = traceback.TracebackException(exc_type, exc, tb, compact=True)
    try:
        full = read("SPMD_TRACEBACK") == "full"
        problem = ""
    except ValueError as err:
        full, problem = True, f"spmd: {err}\n"
    if not full:
        dirs = _launcher_dirs()
        seen: set[int] = set()
        pending: list[tuple[traceback.TracebackException, bool]] = [(te, False)]
        while pending:
            one, chained = pending.pop()
            if id(one) in seen:
                continue
            seen.add(id(one))
            _trim(one, chained, dirs)
            pending += [(other, True) for other in (one.__cause__, one.__context__)
                        if other is not None]
            pending += [(member, False) for member in getattr(one, "exceptions", None) or ()]
    return "".join(te.format()) + problem
