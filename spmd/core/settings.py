"""The reliability settings: ``init_process_group(pg_options=...)`` keys, else their
``SPMD_*`` environment variables, else the defaults (README, "Settings")."""

from __future__ import annotations

import dataclasses
import os
import warnings

from spmd.core.flight_recorder import DEFAULT_SIZE

__all__ = ["TORCH_MPI", "Config", "parse_options", "torch_mpi_name"]


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


_ENV = {
    "debug": "SPMD_DEBUG", "abort_on_exception": "SPMD_ABORT_ON_EXCEPTION",
    "dump_dir": "SPMD_DUMP_DIR", "flight_recorder_size": "SPMD_FLIGHT_RECORDER_SIZE",
    "watchdog": "SPMD_WATCHDOG", "watchdog_interval": "SPMD_WATCHDOG_INTERVAL",
    "heartbeat_timeout": "SPMD_HEARTBEAT_TIMEOUT", "query_timeout": "SPMD_QUERY_TIMEOUT",
    "device_timeout": "SPMD_DEVICE_TIMEOUT",
}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# Read when torch loads spmd's backend (at ``import torch``), before any process group:
# the environment only, no pg_options key.
TORCH_MPI = "SPMD_TORCH_MPI"  # 1: spmd answers to torch.distributed's "mpi" name; default off


def torch_mpi_name() -> bool:
    """Whether spmd stands in for torch.distributed's ``"mpi"`` backend [SPMD_TORCH_MPI].

    Raises:
        ValueError: the variable is set to something other than 1/0, true/false, yes/no, on/off.
    """
    text = os.environ.get(TORCH_MPI, "").strip().lower()
    if text in _TRUE or text in _FALSE or text == "":
        return text in _TRUE
    raise ValueError(f"{TORCH_MPI}={os.environ[TORCH_MPI]!r} is not a valid setting: "
                     "expected 1 (on) or 0 (off)")


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
        if os.environ.get(var, "") != "":
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
