"""Writing whole lines: one ``write()`` per line, newline included, then a flush.

The ranks of a job share one terminal or log through the launcher, which forwards
what each rank writes as it comes.  ``print(text)`` writes the text and the newline
separately when the stream is unbuffered (``python -u``, ``PYTHONUNBUFFERED``) and
a multi-line text's last newline separately on line-buffered stderr, so another
rank's line can land in between ("rank 1/4 OKrank 2/4 OK").  A single ``write()`` of
a line to a pipe is atomic up to ``PIPE_BUF`` (4096 bytes on Linux), and flushing after
each line keeps a block-buffered stream from cutting a line at its buffer's edge.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["write_lines"]


def write_lines(text: str, stream: TextIO | None = None) -> None:
    """Write ``text`` (one or more lines) to ``stream`` (stdout if None), each line by
    itself with its newline, flushing after each."""
    out = sys.stdout if stream is None else stream
    for line in text.splitlines() or [""]:
        out.write(line + "\n")
        out.flush()
