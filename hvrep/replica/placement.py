"""Where this process sits in the job, from whichever launcher started it.

One function, :func:`resolve_placement`, reads the launcher variables that
``hvrep._env`` snapshots and returns a frozen :class:`Placement`. Sources, in
the order they win when several are present:

1. ``horovodrun`` (Gloo): ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ...
2. Open MPI (``mpirun``; ``horovodrun`` over MPI): ``OMPI_COMM_WORLD_*``.
3. MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``...
4. Slurm (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``...

An MPI launcher wins over Slurm because ``mpirun`` inside an ``sbatch`` job
leaves every rank with the batch step's ``SLURM_PROCID=0``; those Slurm values
describe the batch script, not the rank. Only the winning source is checked
for contradictions (a rank outside its size, a local rank outside its node).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from hvrep import _env
from hvrep.errors import LauncherError


@dataclass(frozen=True)
class Placement:
    """A process's place in the job.

    Attributes:
      launcher: "horovodrun", "openmpi", "pmi", "slurm" or "none" (one process).
      rank: global rank in [0, size).
      size: number of processes in the job.
      local_rank: rank among the processes on this node, in [0, local_size).
      local_size: processes on this node.
      node_rank: index of this node in the job, or None when the launcher does not say.
      host: this node's name.
      hosts: the job's node names in order, when the launcher lists them.
    """

    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int | None
    host: str
    hosts: tuple[str, ...] = ()

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer. Fix: unset it or launch again.") from None
    if value < 0:
        raise LauncherError(f"{name}={raw!r} is negative. Fix: unset it or launch again.")
    return value


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if name in env else None


def _require(env: Mapping[str, str], source: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = ", ".join(f"{k}={env[k]}" for k in names if k in env)
        raise LauncherError(
            f"{source} variables are incomplete: {present} is set but {', '.join(missing)} is not. "
            "Fix: launch with the launcher's own command, or unset the stray variables."
        )


def _check(
    source: str, rank: int, size: int, local_rank: int, local_size: int, names: tuple[str, str, str, str]
) -> None:
    r, s, lr, ls = names
    if size < 1:
        raise LauncherError(f"{source}: {s}={size} must be at least 1.")
    if rank >= size:
        raise LauncherError(f"{source}: {r}={rank} is not below {s}={size}; the launcher's variables disagree.")
    if local_size < 1 or local_size > size:
        raise LauncherError(f"{source}: {ls}={local_size} must be in [1, {s}={size}].")
    if local_rank >= local_size:
        raise LauncherError(
            f"{source}: {lr}={local_rank} is not below {ls}={local_size}; the launcher's variables disagree."
        )


def expand_hostlist(spec: str) -> tuple[str, ...]:
    """Expands a Slurm node list ("node[01-03,07],gpu5") to host names.

    Uses the python-hostlist library; falls back to ``scontrol show hostnames``.
    """
    try:
        import hostlist  # python-hostlist

        return tuple(hostlist.expand_hostlist(spec))
    except ImportError:
        pass
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise LauncherError(
            f"cannot expand the Slurm node list {spec!r}: neither python-hostlist nor scontrol is "
            "available. Fix: `pip install python-hostlist`."
        )
    out = subprocess.run([scontrol, "show", "hostnames", spec], capture_output=True, text=True, check=True)
    return tuple(out.stdout.split())


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(spec: str) -> list[int]:
    """Expands SLURM_TASKS_PER_NODE ("2(x3),1") to one count per node ([2, 2, 2, 1])."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _TASKS_RE.match(part.strip())
        if m is None:
            raise LauncherError(f"SLURM_TASKS_PER_NODE={spec!r} is malformed at {part!r}.")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _from_horovodrun(env: Mapping[str, str]) -> Placement:
    names = (_env.HOROVOD_RANK, _env.HOROVOD_SIZE, _env.HOROVOD_LOCAL_RANK, _env.HOROVOD_LOCAL_SIZE)
    _require(env, "horovodrun", names)
    rank, size, lrank, lsize = (_int(env, n) for n in names)
    _check("horovodrun", rank, size, lrank, lsize, names)
    host = env.get(_env.HOROVOD_HOSTNAME) or socket.gethostname()
    return Placement("horovodrun", rank, size, lrank, lsize, _opt_int(env, _env.HOROVOD_CROSS_RANK), host)


def _from_openmpi(env: Mapping[str, str]) -> Placement:
    names = (
        _env.OMPI_COMM_WORLD_RANK, _env.OMPI_COMM_WORLD_SIZE,
        _env.OMPI_COMM_WORLD_LOCAL_RANK, _env.OMPI_COMM_WORLD_LOCAL_SIZE,
    )
    _require(env, "Open MPI", names)
    rank, size, lrank, lsize = (_int(env, n) for n in names)
    _check("Open MPI", rank, size, lrank, lsize, names)
    node = _opt_int(env, _env.OMPI_COMM_WORLD_NODE_RANK)
    return Placement("openmpi", rank, size, lrank, lsize, node, socket.gethostname())


def _slurm_local(env: Mapping[str, str], size: int) -> tuple[int | None, int, int | None, tuple[str, ...], str]:
    """Slurm's view of this node: (node id, tasks on it, SLURM_LOCALID, hosts, name of the count's variable)."""
    node = _opt_int(env, _env.SLURM_NODEID)
    lrank = _opt_int(env, _env.SLURM_LOCALID)
    nodelist = env.get(_env.SLURM_STEP_NODELIST) or env.get(_env.SLURM_JOB_NODELIST)
    hosts = expand_hostlist(nodelist) if nodelist else ()
    # A step's own layout wins over the job's (a step may use fewer nodes).
    count_var = next((v for v in (_env.SLURM_STEP_TASKS_PER_NODE, _env.SLURM_TASKS_PER_NODE) if v in env), "")
    if not count_var:
        return node, size, lrank, hosts, _env.SLURM_NTASKS
    try:
        per_node = tasks_per_node(env[count_var])
    except LauncherError as e:
        raise LauncherError(str(e).replace("SLURM_TASKS_PER_NODE", count_var, 1)) from None
    idx = node or 0
    if idx >= len(per_node):
        raise LauncherError(
            f"Slurm: SLURM_NODEID={idx} but {count_var}={env[count_var]!r} lists "
            f"{len(per_node)} nodes; the launcher's variables disagree."
        )
    if hosts and node is not None and node >= len(hosts):
        raise LauncherError(f"Slurm: SLURM_NODEID={node} but the node list {nodelist!r} has {len(hosts)} hosts.")
    return node, per_node[idx], lrank, hosts, count_var


def _from_pmi(env: Mapping[str, str]) -> Placement:
    _require(env, "PMI", (_env.PMI_RANK, _env.PMI_SIZE))
    rank, size = _int(env, _env.PMI_RANK), _int(env, _env.PMI_SIZE)
    names = (_env.PMI_RANK, _env.PMI_SIZE, _env.MPI_LOCALRANKID, _env.MPI_LOCALNRANKS)
    node = None
    if _env.MPI_LOCALRANKID in env:  # Hydra (mpiexec) sets the local pair
        _require(env, "PMI", names)
        lrank, lsize = _int(env, _env.MPI_LOCALRANKID), _int(env, _env.MPI_LOCALNRANKS)
    elif _env.SLURM_LOCALID in env:
        # `srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE but not the local pair:
        # the node layout is Slurm's.
        node, lsize, slurm_lrank, _, count_var = _slurm_local(env, size)
        lrank = slurm_lrank if slurm_lrank is not None else 0
        names = (_env.PMI_RANK, _env.PMI_SIZE, _env.SLURM_LOCALID, count_var)
    else:  # a bare PMI launcher: one node
        lrank, lsize = rank, size
    _check("PMI", rank, size, lrank, lsize, names)
    return Placement("pmi", rank, size, lrank, lsize, node, socket.gethostname())


def _from_slurm(env: Mapping[str, str]) -> Placement:
    _require(env, "Slurm", (_env.SLURM_PROCID, _env.SLURM_NTASKS, _env.SLURM_LOCALID))
    rank, size = _int(env, _env.SLURM_PROCID), _int(env, _env.SLURM_NTASKS)
    node, lsize, lrank, hosts, count_var = _slurm_local(env, size)
    assert lrank is not None
    names = (_env.SLURM_PROCID, _env.SLURM_NTASKS, _env.SLURM_LOCALID, count_var)
    _check("Slurm", rank, size, lrank, lsize, names)
    host = hosts[node] if hosts and node is not None else socket.gethostname()
    return Placement("slurm", rank, size, lrank, lsize, node, host, hosts)


def resolve_placement(environ: Mapping[str, str] | None = None) -> Placement:
    """Resolves this process's place in the job.

    Args:
      environ: the variables to read; default: this process's environment.

    Raises:
      hvrep.errors.LauncherError: the winning launcher's variables contradict
        each other or are malformed.
    """
    env = _env.launcher_vars(environ)
    if _env.HOROVOD_RANK in env:
        return _from_horovodrun(env)
    if _env.OMPI_COMM_WORLD_RANK in env:
        return _from_openmpi(env)
    if _env.PMI_RANK in env:
        return _from_pmi(env)
    if _env.SLURM_PROCID in env:
        return _from_slurm(env)
    return Placement("none", 0, 1, 0, 1, 0, socket.gethostname())
