"""What the documents show as a program's output, and the programs that print it.

A page marks such a block with a comment on the line before its fence, or, for
Markdown shown as such (a table), with comments around it::

    <!-- output: timeout -->
    ```text
    ...
    ```

    <!-- output: settings -->
    | ... |
    <!-- end output -->

Each name is a :class:`Case`: how to produce the text (a job under ``mpiexec``, a
program, or a table spmd generates), what the page should show for one run
(``shown``), and how a run is compared with the page (``problems``).  Runs differ in
what cannot matter (timings, host names, pids, which of several equal ranks gave up
first and which heard it from another); everything else must be what the page shows.
Tracebacks show the program's own frames; the frames inside spmd are left out (one
line says so), so that moving code inside spmd does not change a page.

``python tests/_docs.py --write [NAME...]`` runs the cases and writes what they print
into the pages (``tests/jobs/test_docs_outputs.py`` and ``tests/unit/test_docs_text.py``
check them).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PROGRAMS = "tests/programs"

# A fenced block, or Markdown itself (a table) up to an end marker.
_BLOCK = re.compile(r"^<!-- output: (?P<name>[\w-]+) -->\n(?:```(?P<lang>\w*)\n(?P<body>.*?)^```"
                    r"|(?P<markdown>.*?)^<!-- end output -->)$", re.M | re.S)
_TAG = re.compile(r"^\[rank (\d+)\] (.*)$")
SPMD_FRAMES = "  [frames inside spmd/ left out]"


# -- the pages ---------------------------------------------------------------------------

def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def blocks() -> dict[str, tuple[Path, str]]:
    """Every marked block: name -> (its page, its text)."""
    found: dict[str, tuple[Path, str]] = {}
    for page in pages():
        for m in _BLOCK.finditer(page.read_text(encoding="utf-8")):
            if m["name"] in found:
                raise ValueError(f"output block {m['name']!r} is in {found[m['name']][0].name} "
                                 f"and {page.name}: one page shows it")
            text = m["body"] if m["markdown"] is None else m["markdown"]
            found[m["name"]] = (page, text.rstrip("\n"))
    return found


def write_block(name: str, text: str) -> Path:
    """Put ``text`` into the block marked ``name``; returns its page."""
    page, _ = blocks()[name]
    source = page.read_text(encoding="utf-8")

    def body(m: re.Match[str]) -> str:
        if m["name"] != name:
            return m.group(0)
        if m["markdown"] is not None:
            return f"<!-- output: {name} -->\n{text.rstrip()}\n<!-- end output -->"
        return f"<!-- output: {name} -->\n```{m['lang']}\n{text.rstrip()}\n```"

    page.write_text(_BLOCK.sub(body, source), encoding="utf-8")
    return page


def fenced(page: Path, lang: str, after: str) -> str:
    """The first ``lang`` code block of ``page`` after the line ``after`` starts."""
    text = page.read_text(encoding="utf-8")
    start = text.index(after)
    m = re.compile(rf"^```{lang}\n(.*?)^```$", re.M | re.S).search(text, start)
    if m is None:
        raise ValueError(f"{page.name}: no ```{lang} block after {after!r}")
    return m.group(1)


# -- what every comparison leaves out ----------------------------------------------------

def relative(text: str) -> str:
    """Paths as the repository names them (what a reader's checkout prints)."""
    return text.replace(str(ROOT) + os.sep, "")


def untimed(text: str) -> str:
    """Durations and ages, which differ from run to run, as ``#``; the padding of the
    columns they stand in collapsed (a line's indentation kept)."""
    text = re.sub(r"\d+\.\d+ (s ago|ms)\b", r"# \1", text)
    lines = [re.match(r"(\[rank \d+\] )?( *)(.*)", ln).groups("") for ln in text.split("\n")]
    return "\n".join(tag + indent + re.sub(r"  +", " ", rest) for tag, indent, rest in lines)


def by_rank(output: str) -> dict[int, list[str]]:
    """Each rank's ``[rank R]`` lines, in order, without the tag."""
    out: dict[int, list[str]] = {}
    for line in output.splitlines():
        m = _TAG.match(line)
        if m:
            out.setdefault(int(m[1]), []).append(m[2])
    return out


def spmd_frames_left_out(lines: list[str]) -> list[str]:
    """A traceback with the frames inside spmd/ replaced by one line saying so."""
    out: list[str] = []
    skipping = False
    for line in lines:
        frame = re.match(r'  File "([^"]+)", line \d+, in ', line)
        if frame:
            skipping = frame[1].startswith("spmd/")
            if skipping and out[-1:] != [SPMD_FRAMES]:
                out.append(SPMD_FRAMES)
            if skipping:
                continue
        elif skipping and line.startswith("    "):
            continue   # the frame's source line and its ^^^ markers
        else:
            skipping = False
        out.append(line)
    return out


def report(lines: list[str], first: str, last: str) -> list[str] | None:
    """The lines from the one starting with ``first`` to the one starting with ``last``."""
    start = next((i for i, ln in enumerate(lines) if ln.startswith(first)), None)
    if start is None:
        return None
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(last)), None)
    return None if end is None else lines[start:end + 1]


def tagged(rank: int, lines: list[str]) -> str:
    return "\n".join(f"[rank {rank}] {ln}" for ln in lines)


def relabel(text: str, a: int, b: int) -> str:
    """Ranks ``a`` and ``b`` swapped everywhere a rank is named (``rank 1``)."""
    swap = {str(a): str(b), str(b): str(a)}
    return re.sub(r"(?<=\brank )(\d+)\b", lambda m: swap.get(m[1], m[1]), text)


def reached_in_order(text: str) -> str:
    """``reached it: rank 3 (this rank), rank 1, rank 0`` with the others in rank order."""
    def order(m: re.Match[str]) -> str:
        others = sorted(m[2].split(", ")[1:], key=lambda s: int(s.split()[1])) if m[2] else []
        return m[1] + ", ".join([m[2].split(", ")[0]] + others)
    return re.sub(r"^(.*reached it: )(.*)$", order, text, flags=re.M)


# -- the cases ---------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One block the documents show."""

    name: str
    produce: Callable[[Path], str]          # run it (in a scratch folder); its output
    shown: Callable[[str], str]             # what the page should show for this output
    problems: Callable[[str, str], list[str]]   # (output, page's text) -> what differs
    job: bool = True                        # False: no MPI job (a table spmd generates)


def _exact(output: str, page: str) -> list[str]:
    return [] if output.strip("\n") == page.strip("\n") else \
        [f"the page shows:\n{page}\nthe program printed:\n{output}"]


def _job(n: int, program: str, *args: str, timeout: float = 90, **env: str) -> str:
    from _launch import mpiexec, run

    proc = run(mpiexec(n, sys.executable, program, *args), timeout=timeout, **env)
    return relative(proc.stdout)


# quickstart: rank 0's table, then every rank's line (in any order).

def _quickstart(_: Path) -> str:
    return _job(4, "examples/quickstart.py")


def _quickstart_shown(output: str) -> str:
    lines = output.splitlines()
    ok = sorted(ln for ln in lines if re.fullmatch(r"rank \d+/\d+ quickstart OK", ln))
    return "\n".join([ln for ln in lines if ln not in ok] + ok)


# spawn: the page's own example, run as the script it says to save.

def _spawn(scratch: Path) -> str:
    from _launch import run

    script = scratch / "train.py"
    script.write_text(fenced(DOCS / "spawn.md", "python", "No launcher line"), encoding="utf-8")
    proc = run([sys.executable, str(script)], timeout=120)
    return proc.stdout if proc.returncode == 0 else f"exit {proc.returncode}\n{proc.stdout}"


# timeout: the report of a rank that gave up the all_reduce; ranks 0, 1 and 3 wait alike,
# so any of them may give up first, break WORLD and tell the others (who then print the
# same diagnosis without the line that says it broke, or, told before their own deadline,
# a GroupBrokenError naming the rank that told them).

_BROKE = "  group WORLD is now broken: later calls on it raise GroupBrokenError"


def _timeout(_: Path) -> str:
    return _job(4, f"{PROGRAMS}/docs_timeout.py")


def _timeout_reports(output: str) -> tuple[dict[int, str], dict[int, str]]:
    """Each rank's DistTimeoutError report, as rank 0 would print it; and each rank's
    GroupBrokenError line."""
    timed_out, told = {}, {}
    for rank, lines in by_rank(output).items():
        rep = report(lines, "flight recorder (", "spmd: uncaught DistTimeoutError")
        if rep is not None:
            text = tagged(rank, spmd_frames_left_out(rep))
            timed_out[rank] = reached_in_order(relabel(text, rank, 0))
        broken = next((ln for ln in lines if "GroupBrokenError: " in ln
                       and not ln.startswith(" ")), None)
        if broken is not None and rep is None:
            told[rank] = broken
    return timed_out, told


def _timeout_shown(output: str) -> str:
    timed_out, _ = _timeout_reports(output)
    first = [t for r, t in sorted(timed_out.items()) if _BROKE in t]
    if not first:
        raise ValueError(f"no rank reported breaking WORLD:\n{output}")
    return first[0]


def _timeout_problems(output: str, page: str) -> list[str]:
    timed_out, told = _timeout_reports(output)
    if not timed_out:
        return [f"no rank printed the DistTimeoutError report:\n{output}"]
    shown = untimed(page)
    problems = []
    for rank, text in timed_out.items():
        expect = shown if _BROKE in text else shown.replace(f"\n[rank 0] {_BROKE}", "")
        if untimed(text) != expect:
            problems.append(f"rank {rank}'s report (as rank 0's) differs from the page:\n"
                            f"{text}\npage:\n{page}")
    for rank, line in told.items():
        if not re.search(r"GroupBrokenError: all_reduce: .*\(told by rank [013]\)", line):
            problems.append(f"rank {rank} raised {line!r}: not a notice from a rank that "
                            "gave up")
    return problems


# fr_trace: the same job with SPMD_DUMP_DIR=dumps, then the reader on the dumps.  Which
# rank dumped on its own timeout and which when another asked differs between runs.

def _fr_trace(scratch: Path) -> str:
    from _launch import run

    dumps = scratch / "dumps"
    _job(4, f"{PROGRAMS}/docs_timeout.py", SPMD_DUMP_DIR=str(dumps))
    proc = run([sys.executable, "-m", "spmd.tools.fr_trace", str(dumps)], timeout=60)
    return proc.stdout


_FR_RANK = re.compile(r"^  rank (\d+) \(\S+, pid \d+\): (.*)$")


def _fr_lines(text: str) -> tuple[list[str], list[str]]:
    """The lines without the per-rank ones; each rank's reason (ranks named as N)."""
    other, reasons = [], []
    for line in text.splitlines():
        m = _FR_RANK.match(line)
        if m:
            other.append(f"  rank {m[1]} (HOST, pid PID): -")
            reasons.append(re.sub(r"\brank \d+", "rank N", m[2]))
        else:
            other.append(line)
    return other, reasons


def _fr_problems(output: str, page: str) -> list[str]:
    got, got_reasons = _fr_lines(output)
    want, want_reasons = _fr_lines(page)
    if got != want or not set(got_reasons) <= set(want_reasons):
        return [f"the page shows:\n{page}\nthe reader printed:\n{output}"]
    return []


# mismatch: every rank raises the same CollectiveMismatchError; the page shows rank 3's.

def _mismatch(_: Path) -> str:
    return _job(4, f"{PROGRAMS}/docs_mismatch.py", SPMD_DEBUG="DETAIL")


def _mismatch_reports(output: str) -> dict[int, str]:
    out = {}
    for rank, lines in by_rank(output).items():
        rep = report(lines, "Traceback", "spmd: uncaught CollectiveMismatchError")
        if rep is not None:
            text = tagged(rank, spmd_frames_left_out(rep))
            out[rank] = re.sub(r"\[rank \d+(?=[],])", "[rank 3", text)
    return out


def _mismatch_shown(output: str) -> str:
    reports = _mismatch_reports(output)
    if not reports:
        raise ValueError(f"no rank printed the CollectiveMismatchError report:\n{output}")
    return reports[min(reports)]


def _mismatch_problems(output: str, page: str) -> list[str]:
    reports = _mismatch_reports(output)
    if not reports:
        return [f"no rank printed the CollectiveMismatchError report:\n{output}"]
    return [f"rank {r}'s report (as rank 3's) differs from the page:\n{t}\npage:\n{page}"
            for r, t in reports.items() if t != page]


# exit: the error a waiting rank gets when a peer's program ends (rank 0's shown; rank 1
# gets the same).  A waiting rank that hears of the exit gives its all_reduce up, which
# breaks WORLD and tells the other: that one may hear of the break before the exit and
# raise the GroupBrokenError of the break instead, naming the rank that told it.

def _exit(_: Path) -> str:
    return _job(3, f"{PROGRAMS}/exit_early.py")


def _exit_errors(output: str) -> list[str]:
    """Each waiting rank's error, as rank 0's, the exited rank's pid as PID."""
    return [re.sub(r"\[rank \d+,", "[rank 0,", re.sub(r"\(pid \d+,", "(pid PID,", ln[len("heard: "):]))
            for ln in output.splitlines() if ln.startswith("heard: ")]


def _exit_shown(output: str) -> str:
    line = next((ln[len("heard: "):] for ln in output.splitlines()
                 if ln.startswith("heard: ") and "[rank 0," in ln), None)
    if line is None:
        raise ValueError(f"rank 0 did not hear the exit:\n{output}")
    return line


def _exit_problems(output: str, page: str) -> list[str]:
    errors = _exit_errors(output)
    want = re.sub(r"\(pid \d+,", "(pid PID,", page)
    told = re.compile(r"GroupBrokenError: all_reduce: group WORLD is broken since all_reduce "
                      r"was given up on rank ([01]) .*\(told by rank \1\)")
    heard = [e for e in errors if e == want]
    if len(errors) != 2 or not heard or \
            any(e != want and not told.match(e) for e in errors):
        return [f"the page shows:\n{page}\nthe waiting ranks got:\n{output}"]
    return []


# settings: the table spmd.core.settings declares.

def _settings(_: Path) -> str:
    from spmd.core.settings import table

    return table()


CASES = {c.name: c for c in [
    Case("quickstart", _quickstart, _quickstart_shown,
         lambda out, page: _exact(_quickstart_shown(out), page)),
    Case("spawn", _spawn, lambda out: out, _exact),
    Case("timeout", _timeout, _timeout_shown, _timeout_problems),
    Case("fr-trace", _fr_trace, lambda out: out, _fr_problems),
    Case("mismatch", _mismatch, _mismatch_shown, _mismatch_problems),
    Case("exit", _exit, _exit_shown, _exit_problems),
    Case("settings", _settings, lambda out: out, _exact, job=False),
]}


def check(name: str) -> list[str]:
    """Produce case ``name`` and compare it with its page; what differs."""
    case = CASES[name]
    _, page = blocks()[name]
    with tempfile.TemporaryDirectory() as scratch:
        output = case.produce(Path(scratch))
    return case.problems(output, page)


def main(argv: list[str]) -> int:
    """``--write [NAME...]``: run the cases (all by default) and write their pages."""
    if not argv or argv[0] != "--write":
        print(__doc__)
        return 2
    for name in argv[1:] or list(CASES):
        with tempfile.TemporaryDirectory() as scratch:
            text = CASES[name].shown(CASES[name].produce(Path(scratch)))
        page = write_block(name, text)
        print(f"{name}: {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
