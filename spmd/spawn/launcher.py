"""The launcher that starts the ranks of :func:`spmd.spawn`: the MPI library's own
``mpiexec``, or SLURM's ``srun`` inside an allocation.

:func:`find_launcher` picks it:

- ``$SPMD_MPIEXEC`` when set (an ``mpiexec``, or ``srun``);
- inside a SLURM allocation (``SLURM_JOB_ID`` set, as in an ``salloc`` shell or a batch
  script) ``srun``, which places the ranks on the allocation's nodes as the site's
  scheduler wants, with the PMI plugin the ranks' MPI speaks (``--mpi=pmi2`` for MPICH
  and Intel MPI, ``pmix`` for Open MPI, unless ``SLURM_MPI_TYPE`` says otherwise);
- else the first MPI launcher next to ``sys.executable``, in ``sys.prefix/bin`` (where
  the MPI wheels put theirs, so a virtual environment's ``bin`` need not be on ``PATH``)
  or on ``PATH``, which runs the ranks on this host.

``mpiexec --version`` says which one it is: Hydra (MPICH, and Intel MPI's) or Open MPI's,
which needs ``--oversubscribe`` to run more ranks than cores, as a notebook's test job
often does, and ``--allow-run-as-root`` in containers.  :func:`launcher_environment` is
the environment it runs in, and :func:`caller_host` the address at which its ranks reach
the caller.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import shutil
import site
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spmd.core import settings
from spmd.core.launch import HYDRA, OPENMPI, SINGLETON, launch_info

__all__ = ["HOST_VAR", "SRUN", "Launcher", "caller_host", "find_launcher", "first_node",
           "launcher_environment"]

MPIEXEC_VAR = "SPMD_MPIEXEC"
# The address of this host (IPv4, or a name that resolves to one) at which ranks that srun
# places on other nodes reach the caller, where the one caller_host finds is not it.
HOST_VAR = "SPMD_SPAWN_HOST"
SRUN = "srun"   # Launcher.kind of SLURM's srun
# srun's PMI plugin for each kind of MPI library (an mpiexec's kind says which library
# the ranks load): Hydra's PMI-2 for MPICH and Intel MPI, PMIx for Open MPI 5.
_SRUN_MPI = {HYDRA: "pmi2", OPENMPI: "pmix"}

# Variables by which a launcher tells its processes which job they are (PMI, PMIx, Open
# MPI's, Hydra's), and SLURM's, by which Hydra and Open MPI's launcher would place ranks
# on other nodes of an allocation, out of reach of the caller's loopback socket.
_JOB_VARIABLES: tuple[str, ...] = ("PMI_", "PMIX_", "PRTE_", "OMPI_", "HYDRA_", "MPI_LOCALRANKID",
                  "MPI_LOCALNRANKS")
_ALLOCATION_VARIABLES: tuple[str, ...] = ("SLURM_",)

# Where spmd itself is: the ranks must import the spmd the caller runs.
_SPMD_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Launcher:
    """A launcher and what kind it is (``core.launch.HYDRA``, ``OPENMPI``, :data:`SRUN`,
    or ``"unknown"`` for one ``$SPMD_MPIEXEC`` names that says neither).

    For srun: ``mpi`` is its ``--mpi`` plugin (None: srun's default, ``SLURM_MPI_TYPE`` or
    slurm.conf's), and ``overlap`` that the caller runs inside a job step (``srun --pty``),
    which holds the allocation's CPUs, so the ranks' step must share them.
    """

    path: str
    kind: str
    mpi: str | None = None
    overlap: bool = False

    @property
    def spans_nodes(self) -> bool:
        """True when the ranks may run on other hosts than the caller's."""
        return self.kind == SRUN

    def command(self, nprocs: int, program: Sequence[str]) -> list[str]:
        """The command line that runs ``program`` as ``nprocs`` ranks."""
        if self.kind == SRUN:
            # One rank's failure ends the step, as mpiexec ends its job.
            flags = [f"--ntasks={nprocs}", "--kill-on-bad-exit=1"]
            if self.mpi:
                flags.append(f"--mpi={self.mpi}")
            if self.overlap:
                flags.append("--overlap")
            return [self.path, *flags, *program]
        flags = []
        if self.kind == OPENMPI:
            flags.append("--oversubscribe")
            if os.geteuid() == 0:  # Open MPI refuses root without it
                flags.append("--allow-run-as-root")
        return [self.path, *flags, "-n", str(nprocs), *program]


@functools.cache
def _kind(path: str) -> str | None:
    """What ``path --version`` says the launcher is, or None for something else."""
    try:
        out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "Open MPI" in out or "OpenRTE" in out:   # Open MPI 5 says the first, 4 the second
        return OPENMPI
    if out.startswith("slurm "):
        return SRUN
    if "HYDRA" in out.upper() or "Intel(R) MPI" in out:
        return HYDRA
    return None


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_launcher() -> Launcher:
    """The launcher that starts spawned ranks (see the module's docstring).

    Raises:
        RuntimeError: ``$SPMD_MPIEXEC`` names no executable, or no launcher was found;
            the message says what to install or set.
    """
    chosen = settings.read(MPIEXEC_VAR)
    if chosen:
        if not _executable(chosen):
            raise RuntimeError(f"spawn: {MPIEXEC_VAR}={chosen} is not an executable file")
        kind = _kind(os.path.realpath(chosen)) or "unknown"
        return _srun(chosen, _local_mpiexec()) if kind == SRUN else Launcher(chosen, kind)
    srun = shutil.which(SRUN)
    if os.environ.get("SLURM_JOB_ID") and srun:
        return _srun(srun, _local_mpiexec())
    local = _local_mpiexec()
    if isinstance(local, Launcher):
        return local
    not_mpi = f"; not an MPI launcher: {', '.join(local)}" if local else ""
    raise RuntimeError(
        f"spawn: no MPI launcher found (looked for mpiexec next to {sys.executable}, in "
        f"{sys.prefix}/bin and on PATH{not_mpi}); install an MPI wheel into this environment "
        f"(pip install 'spmd[mpich]') or set {MPIEXEC_VAR} to the mpiexec of the MPI library "
        "mpi4py uses")


def _local_mpiexec() -> Launcher | list[str]:
    """The first MPI launcher next to ``sys.executable``, in ``sys.prefix/bin`` or on
    ``PATH``; else the executables found there that are none."""
    candidates = [os.path.join(os.path.dirname(sys.executable), "mpiexec"),
                  os.path.join(sys.prefix, "bin", "mpiexec")]
    on_path = shutil.which("mpiexec")
    if on_path:
        candidates.append(on_path)
    others = []
    for path in dict.fromkeys(candidates):
        if not _executable(path):
            continue
        kind = _kind(os.path.realpath(path))
        if kind in (HYDRA, OPENMPI):
            return Launcher(path, kind)
        others.append(path)
    return others


def _srun(path: str, local: Launcher | list[str]) -> Launcher:
    """srun, with the PMI plugin of the MPI library whose mpiexec is ``local``."""
    mpi = None
    if not os.environ.get("SLURM_MPI_TYPE") and isinstance(local, Launcher):
        mpi = _SRUN_MPI.get(local.kind)
    in_step = bool(os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID"))
    return Launcher(path, SRUN, mpi, overlap=in_step)


def launcher_environment(extra: Mapping[str, str], launcher: Launcher) -> dict[str, str]:
    """The environment the launcher and its ranks start with: the caller's, less the
    variables of the job the caller may itself be a rank of, with spmd importable, plus
    ``extra``.  An mpiexec does not see a SLURM allocation the caller is in (it would place
    ranks on the allocation's other nodes, out of reach of the caller's loopback socket);
    srun does, as it runs the ranks there."""
    drop = () if launcher.kind == SRUN else _ALLOCATION_VARIABLES
    if launch_info().launcher != SINGLETON:
        drop = drop + _JOB_VARIABLES
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    if _SPMD_ROOT not in _site_directories():
        # spmd runs from a source tree (an editable install, a path the caller added):
        # python -m spmd.spawn.child finds it there, and not some other installed spmd.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_SPMD_ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@functools.cache
def _site_directories() -> frozenset[str]:
    dirs = set(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return frozenset(os.path.abspath(d) for d in dirs)


def caller_host(launcher: Launcher) -> str:
    """The IPv4 address the caller listens on, and the ranks connect to.

    127.0.0.1 when the launcher runs the ranks on this host.  Under srun, where they may
    run on other nodes, this host's address on the network those nodes reach it on:
    ``$SPMD_SPAWN_HOST`` when set; else the source address of this host's route to the
    allocation's nodes (the first that is not this host); else the address this host's
    name resolves to; never every interface (0.0.0.0).

    Raises:
        RuntimeError: ``$SPMD_SPAWN_HOST`` does not resolve, or no address of this host
            that other nodes could reach was found (the message says to set it).
    """
    if not launcher.spans_nodes:
        return "127.0.0.1"
    chosen = settings.read(HOST_VAR)
    if chosen:
        try:
            return socket.gethostbyname(chosen)
        except OSError as exc:
            raise RuntimeError(f"spawn: {HOST_VAR}={chosen} is not an IPv4 address or a host "
                               f"name that resolves to one: {exc}") from exc
    sources = [_route_source(node) for node in _allocation_nodes()[:8]]
    for source in sources:
        if source is not None and not _loopback(source):
            return source
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = None
    if own is not None and not _loopback(own):
        return own
    if sources and None not in sources:
        return "127.0.0.1"   # every node is reached over loopback: they are this host
    raise RuntimeError(
        f"spawn: found no address of this host ({socket.gethostname()}) that the nodes srun "
        f"runs the ranks on can reach (its name resolves to {own or 'nothing'}); set "
        f"{HOST_VAR} to this host's address on the cluster's network")


def _allocation_nodes() -> list[str]:
    """The host names of the SLURM allocation this process is in, in order ([] outside
    one): ``scontrol show hostnames``, or the first name of the node list without it."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    first = first_node(nodelist)
    return out or ([first] if first else [])


_HOSTLIST_HEAD = re.compile(r"([^,\[]+)(?:\[([^\]\-,]+))?")


def first_node(nodelist: str) -> str | None:
    """The first host name of a SLURM node list (``"node[03-05,9],gpu1"``: ``"node03"``)."""
    match = _HOSTLIST_HEAD.match(nodelist.strip())
    if match is None:
        return None
    return match.group(1) + (match.group(2) or "")


def _route_source(node: str) -> str | None:
    """This host's source address on its route to the allocation's ``node`` (no packet is
    sent); None where the node has no address."""
    address = _node_address(node)
    if address is None:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _node_address(node: str) -> str | None:
    """The IPv4 address of a SLURM node: its name's, else SLURM's NodeAddr (a node's name
    need not resolve: slurm.conf may give its address alone)."""
    try:
        return socket.gethostbyname(node)
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "-o", "show", "node", node], check=True,
                             capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\bNodeAddr=(\S+)", out)
    try:
        return socket.gethostbyname(found.group(1)) if found else None
    except OSError:
        return None


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
