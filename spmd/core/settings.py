"""Every ``SPMD_*`` environment variable, declared once, and the reliability settings.

Each variable is a :class:`Setting` in :data:`SETTINGS` (its name, kind, default and one
line of doc) and is read through :func:`read`, which parses it one way for every module:
booleans are ``1/true/yes/on`` or ``0/false/no/off``, a bad value raises ValueError naming
the variable, and unset or empty means the default.  The docs' table of settings is
:func:`table` (``python -m spmd.core.settings`` prints it).  The reliability settings
(:class:`Config`) are ``init_process_group(pg_options=...)`` keys first, then their
variables, then the defaults.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any

from spmd.core.flight_recorder import DEFAULT_SIZE

__all__ = ["SETTINGS", "TORCH_MPI", "Config", "Setting", "parse_options", "read", "table",
           "torch_mpi_name"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``SPMD_*`` environment variable."""

    name: str
    kind: str              # bool, int, size (int > 0), count (int >= 0), seconds (> 0),
                           # delay (seconds >= 0), text, choice
    default: Any
    doc: str
    choices: tuple[str, ...] = ()   # a choice's values, lowercase ("" stands for unset)
    option: str | None = None       # its init_process_group(pg_options=...) key, if any


def _settings(*items: Setting) -> dict[str, Setting]:
    return {s.name: s for s in items}


SETTINGS: dict[str, Setting] = _settings(
    Setting("SPMD_TIMEOUT", "seconds", None, "default timeout of the default group, in seconds "
            "(init_process_group's timeout= wins; unset: 30 minutes)"),
    Setting("SPMD_DEBUG", "choice", "OFF", "debug mode: OFF, INFO, or DETAIL (every collective "
            "compares its arguments across ranks)", ("off", "info", "detail"), "debug"),
    Setting("SPMD_ABORT_ON_EXCEPTION", "bool", True, "an uncaught exception on one rank ends "
            "the whole job (MPI_Abort)", option="abort_on_exception"),
    Setting("SPMD_TRACEBACK", "choice", "short", "an uncaught exception's traceback: short "
            "ends at the program's call into spmd, full shows spmd's own frames too",
            ("short", "full")),
    Setting("SPMD_DUMP_DIR", "text", None, "where each rank writes its flight recorder on a "
            "timeout or an uncaught exception", option="dump_dir"),
    Setting("SPMD_FLIGHT_RECORDER_SIZE", "count", DEFAULT_SIZE, "operations the flight recorder "
            "keeps (at least 16; 0: off)", option="flight_recorder_size"),
    Setting("SPMD_WATCHDOG", "bool", True, "a thread reports ops past their timeout that nobody "
            "waits for", option="watchdog"),
    Setting("SPMD_WATCHDOG_INTERVAL", "seconds", 1.0, "seconds between the watchdog's checks",
            option="watchdog_interval"),
    Setting("SPMD_HEARTBEAT_TIMEOUT", "seconds", 480.0, "report a watchdog that has not "
            "checked for this long", option="heartbeat_timeout"),
    Setting("SPMD_QUERY_TIMEOUT", "seconds", 3.0, "how long a diagnosis waits for the other "
            "ranks' answers", option="query_timeout"),
    Setting("SPMD_DEVICE_TIMEOUT", "choice", "abort", "after a GPU (NCCL) op timed out: abort "
            "ends the job, raise keeps the process up", ("abort", "raise"), "device_timeout"),
    Setting("SPMD_SHM", "choice", "auto", "the node's shared-memory engine: 1/auto (where it "
            "is faster than MPI), 0/off, force (at every size)",
            ("", "1", "auto", "on", "true", "yes", "0", "off", "false", "no", "force",
             "always")),
    Setting("SPMD_WAIT", "choice", "auto", "how a waiting rank uses its core: auto (spins, "
            "napping between polls where the node runs more ranks than it has cores and "
            "once a wait has lasted 20 ms), spin (never naps), yield (naps between polls "
            "from the start: cores shared with other jobs)",
            ("auto", "spin", "yield")),
    Setting("SPMD_FASTCALL", "bool", True, "the compiled call path of the common blocking ops"),
    Setting("SPMD_PERSISTENT", "bool", True, "MPI's persistent collectives for persistent "
            "plans, where the MPI has them"),
    Setting("SPMD_FUSION_BYTES", "size", 128 * 1024 * 1024, "the largest number of bytes "
            "fused into one collective (coalesced ops, buckets)"),
    Setting("SPMD_PSEUDO_NODE_SIZE", "size", None, "pretend every k consecutive ranks form a "
            "node (tests of multi-node layouts on one host)"),
    Setting("SPMD_CUDA_AWARE_MPI", "choice", None, "1: MPI reads GPU memory, 0: stage through "
            "the host (unset: asked of MPI)", ("0", "1")),
    Setting("SPMD_COMMS_LOG", "bool", False, "log every collective's size and time per rank "
            "(from init_process_group on)"),
    Setting("SPMD_TRACE", "text", None, "write a Chrome-trace timeline to this file pattern "
            "(%r: the rank; from init_process_group on)"),
    Setting("SPMD_MPIEXEC", "text", None, "the launcher spmd.spawn and the test suite run "
            "(default: mpiexec beside python, or on PATH)"),
    Setting("SPMD_SPAWN_HOST", "text", None, "the address spmd.spawn's caller listens on under "
            "srun (default: its address on the route to the allocation's nodes)"),
    Setting("SPMD_SPAWN_ADDRESS", "text", None, "set by spmd.spawn for the ranks it starts: "
            "where the caller listens (internal)"),
    Setting("SPMD_SPAWN_TOKEN", "text", None, "set by spmd.spawn for the ranks it starts: the "
            "channel's secret (internal)"),
    Setting("SPMD_JOIN_PORT", "text", None, "set by heal() for the processes it starts: the "
            "MPI port they connect to (internal)"),
    Setting("SPMD_TORCH_MPI", "bool", False, "spmd answers to torch.distributed's \"mpi\" "
            "backend name, read at import torch"),
    Setting("SPMD_DEVICE_DOUBLE_DIR", "text", None, "the device double's exchange directory "
            "(spmd.testing; default: the temporary directory)"),
    Setting("SPMD_DEVICE_DOUBLE_LAG", "delay", 0.0002, "the device double's simulated "
            "kernel time (spmd.testing)"),
)


def _parse(s: Setting, text: str) -> Any:
    low = text.strip().lower()
    if s.kind == "bool":
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError("expected 1 (on) or 0 (off)")
    if s.kind == "choice":
        if low in s.choices:
            return low.upper() if s.name == "SPMD_DEBUG" else low
        raise ValueError(f"expected one of {', '.join(c for c in s.choices if c)}")
    if s.kind in ("int", "size", "count"):
        try:
            value = int(low)
        except ValueError:
            raise ValueError("expected an integer") from None
        if s.kind == "size" and value <= 0 or s.kind == "count" and value < 0:
            raise ValueError("expected a positive integer" if s.kind == "size" else
                             "expected 0 or more")
        return value
    if s.kind in ("seconds", "delay"):
        try:
            seconds = float(low)
        except ValueError:
            raise ValueError("expected a number of seconds") from None
        if s.kind == "seconds" and not seconds > 0:
            raise ValueError("expected a positive number of seconds")
        if s.kind == "delay" and not seconds >= 0:   # NaN included
            raise ValueError("expected 0 or more seconds")
        return seconds
    return text.strip()


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the ``SPMD_*`` variable ``name`` (its default when unset or empty).

    Raises:
        KeyError: ``name`` is not declared in :data:`SETTINGS`.
        ValueError: the variable's value is not one of its kind, naming both.
    """
    s = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name, "")
    if text.strip() == "":
        return s.default
    try:
        return _parse(s, text)
    except ValueError as err:
        raise ValueError(f"{name}={text!r} is not a valid setting: {err} ({s.doc})") from None


def table() -> str:
    """The settings as a Markdown table (the docs' table of settings)."""
    rows = ["| variable | default | what it sets |", "|---|---|---|"]
    for s in SETTINGS.values():
        default = "unset" if s.default is None else str(s.default)
        also = f" (`pg_options` key `{s.option}`)" if s.option else ""
        rows.append(f"| `{s.name}` | {default} | {s.doc}{also} |")
    return "\n".join(rows)


@dataclasses.dataclass
class Config:
    """Reliability settings (``pg_options`` keys; environment variables in brackets)."""

    debug: str = "OFF"                   # OFF, INFO or DETAIL [SPMD_DEBUG]
    abort_on_exception: bool = True      # [SPMD_ABORT_ON_EXCEPTION]
    dump_dir: str | None = None          # per-rank flight recorder files [SPMD_DUMP_DIR]
    flight_recorder_size: int = DEFAULT_SIZE   # 0: off [SPMD_FLIGHT_RECORDER_SIZE]
    watchdog: bool = True                # [SPMD_WATCHDOG]
    watchdog_interval: float = 1.0       # seconds between checks [SPMD_WATCHDOG_INTERVAL]
    heartbeat_timeout: float = 480.0     # stuck-watchdog report after [SPMD_HEARTBEAT_TIMEOUT]
    query_timeout: float = 3.0           # how long a diagnosis waits for peers [SPMD_QUERY_TIMEOUT]
    # After an op on a GPU engine whose blocking calls return before it completes (NCCL)
    # timed out: "abort" ends the job (torch's default, TORCH_NCCL_ASYNC_ERROR_HANDLING=3);
    # "raise" keeps the process up, and the op's Work and the group's next op raise.
    device_timeout: str = "abort"        # [SPMD_DEVICE_TIMEOUT]


# pg_options key -> its variable
_ENV = {st.option: st.name for st in SETTINGS.values() if st.option}


# Read when torch loads spmd's backend (at ``import torch``), before any process group:
# the environment only, no pg_options key.
TORCH_MPI = "SPMD_TORCH_MPI"  # 1: spmd answers to torch.distributed's "mpi" name; default off


def torch_mpi_name() -> bool:
    """Whether spmd stands in for torch.distributed's ``"mpi"`` backend [SPMD_TORCH_MPI].

    Raises:
        ValueError: the variable is set to something other than 1/0, true/false, yes/no, on/off.
    """
    return bool(read(TORCH_MPI))


def _convert(key: str, value, where: str):
    kind = {f.name: f.type for f in dataclasses.fields(Config)}[key]
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError
        out: float
        if kind == "int":
            out = int(value)
        elif kind == "float":
            out = float(value)
        elif key == "debug":
            level = str(value).strip().upper()
            if level not in ("OFF", "INFO", "DETAIL"):
                raise ValueError
            return level
        elif key == "device_timeout":
            policy = str(value).strip().lower()
            if policy not in ("abort", "raise"):
                raise ValueError
            return policy
        else:
            return None if value in (None, "") else os.fspath(value)
    except (TypeError, ValueError):
        raise ValueError(f"init_process_group: {where}={value!r} is not a valid {key} "
                         f"setting") from None
    if out < 0 or (out == 0 and key != "flight_recorder_size"):
        raise ValueError(f"init_process_group: {where}={value!r} must be positive")
    return out


def parse_options(pg_options) -> Config:
    """Config from ``pg_options`` (a dict of Config fields), the environment, defaults."""
    cfg = Config()
    for key, var in _ENV.items():
        if os.environ.get(var, "").strip() != "":
            read(var)   # the variable's own check, naming it
            setattr(cfg, key, _convert(key, os.environ[var], var))
    if pg_options is None:
        return cfg
    if not isinstance(pg_options, dict):
        warnings.warn(f"init_process_group: pg_options of type {type(pg_options).__name__} is "
                      "ignored; spmd takes a dict of reliability settings", stacklevel=3)
        return cfg
    known = {f.name for f in dataclasses.fields(Config)}
    for key, value in pg_options.items():
        if key not in known:
            raise ValueError(f"init_process_group: unknown pg_options key {key!r}; expected "
                             f"one of {sorted(known)}")
        setattr(cfg, key, _convert(key, value, f"pg_options[{key!r}]"))
    return cfg


if __name__ == "__main__":
    print(table())
