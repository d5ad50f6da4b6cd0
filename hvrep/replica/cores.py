"""Each rank's CPU budget: how many threads its pools get (``train.threads``) and which cores they run on
(``train.bind_cores``), chosen by default from the cores the rank may use (:func:`default_budget`). ``hvrep
train`` applies it from its settings; a ``Replicator`` of several ranks on a node applies the default itself
(:func:`size_pools`, then :func:`bind_cores`) unless the application sized TensorFlow's pools first.

Without a budget every rank of a node sized TensorFlow's pools and tf.data's for all the node's cores, and
the kernel moved their threads between cores: the 2-rank demo under ``horovodrun --gloo`` ran 1,149-1,218
images/s against one rank's 1,446-1,534 (issue 31). So by default a rank gets its share of the node (the
cores it may use when a launcher, Slurm or a cgroup bound it; else the node's cores divided by the ranks on
the node) and, where no launcher bound it and it shares the node, it binds to that share.

``mpirun`` binds ranks to cores by default (``--bind-to core`` for two
ranks or fewer); ``horovodrun --gloo`` and plain ``python`` do not, and the
kernel then moves a rank's threads between cores. With ``train.threads=1`` on
2 cores, binding made ``make demo``'s 2-rank run 7% faster (1,419-1,475 vs
1,319-1,359 images/s, three alternating rounds) and the 1-rank baseline no
faster or slower (853-962 either way).

Fewer allowed cores than online ones is not proof of a per-rank binding. A container (``docker
--cpuset-cpus``), a Slurm allocation (``task/cgroup``) or ``taskset`` around the launcher restricts every rank of
the node to the same set; so does Open MPI's ``--bind-to package`` for the ranks of one socket. Those ranks share
their allowed cores and divide them: 4 ranks in a 4-core container on a 64-core node get 1 thread each, not 4
(16 threads on 4 cores). :func:`ranks_sharing` tells the cases apart from what a rank can see alone: its
allowed set against its cgroup's cpuset (:func:`container_cpus`, the set every process of the container or
allocation inherits), whether the local ranks' sets must overlap (``local_size x allowed`` above the
container's cores), and whether its launcher binds at all (``horovodrun`` never does: it runs its ranks with
``mpirun --bind-to none`` or spawns them for Gloo, so they inherit one set). A rank bound per rank (``mpirun
--bind-to core``, ``srun --cpu-bind=cores``) keeps its binding.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hvrep.errors import ConfigError, HvrepError

_log = logging.getLogger("hvrep")
# TensorFlow's own variables for its pools' sizes (read when its runtime starts).
POOL_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
# The budget size_pools applied in this process (a later Replicator finds the pools sized by an earlier one).
_applied: Budget | None = None
# The cores bind_cores bound this process to (a later Replicator finds them narrower than the node: its own doing,
# not a launcher's, and keeps them).
_bound: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Budget:
    """A rank's CPU budget.

    Attributes:
      threads: each TensorFlow pool's and the tf.data pool's size; None: TensorFlow's defaults (all cores: one
        rank alone on an unbound node).
      bind: bind the rank to ``threads`` cores of its own (:func:`bind_cores`).
      why: how it was chosen, for the log and metrics.jsonl.
    """

    threads: int | None
    bind: bool
    why: str


def _parse_cpu_list(text: str) -> int:
    """The number of CPUs in a kernel CPU list such as ``0-3,8,10-11``."""
    count = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def container_cpus(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The CPUs of this process's cgroup cpuset: the set a container or a Slurm allocation gives every process
    in it (cgroup v2 ``cpuset.cpus.effective``, v1 ``cpuset.effective_cpus``), or None where none can be read.

    A cgroup without a cpuset of its own inherits its parent's, so the nearest ancestor that has one answers.
    """
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = cgroup_root, "cpuset.cpus.effective"  # v2 (unified)
            if not os.path.exists(os.path.join(base, "cgroup.controllers")):
                base = os.path.join(cgroup_root, "unified")
        elif "cpuset" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "cpuset"), "cpuset.effective_cpus"  # v1
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                text = Path(base, *parts[:depth], name).read_text()
            except OSError:
                continue
            if text.strip():
                return _parse_cpu_list(text)
    return None


def ranks_sharing(local_size: int, allowed: int, container: int, launcher_binds: bool = True) -> int:
    """How many of a node's ``local_size`` ranks share this rank's ``allowed`` cores (1: a binding of its own).

    Args:
      allowed: the CPUs this rank may use.
      container: the CPUs its cgroup (container, Slurm allocation) gives every process, or the node's online
        CPUs where there is no cgroup cpuset.
      launcher_binds: False where the launcher binds no rank (``horovodrun``): the ranks inherit one set.
    """
    if allowed >= container or not launcher_binds:
        return local_size  # nothing narrowed this rank alone: every local rank has the same set
    # Disjoint per-rank sets fit in the container; larger ones overlap (mpirun --bind-to package: a socket's
    # ranks share it), shared by about this many.
    return max(1, min(local_size, -(-local_size * allowed // container)))


def default_budget(threads: int | None, bind: bool | None, local_size: int,
                   allowed: int | None = None, online: int | None = None, *,
                   container: int | None = None, launcher_binds: bool = True) -> Budget:
    """The budget of one of ``local_size`` ranks on a node; ``threads`` / ``bind`` (the settings) win when given.

    Args:
      allowed: the CPUs this process may use (default: ``os.sched_getaffinity``). A per-rank binding (fewer
        than the container's, not shared: :func:`ranks_sharing`) is its budget; a shared set is divided among
        the ranks that share it.
      online: the node's CPUs (default: ``os.cpu_count()``).
      container: the CPUs of this process's cgroup cpuset (default: :func:`container_cpus` when ``allowed`` is
        read here too, else ``online``).
      launcher_binds: False under a launcher that binds no rank (``horovodrun``).
    """
    if allowed is None:
        allowed = len(os.sched_getaffinity(0))
        container = container_cpus() if container is None else container
    online = (os.cpu_count() or allowed) if online is None else online
    container = min(online, container) if container is not None else online
    sharers = ranks_sharing(local_size, allowed, container, launcher_binds)
    restricted = allowed < online  # a launcher, Slurm, a cgroup or taskset narrowed the set
    if threads is None:
        if restricted and sharers == 1:
            threads, why = allowed, f"the {allowed} core(s) the launcher bound this rank to"
        elif restricted and local_size > 1:
            threads = max(1, allowed // sharers)
            why = f"{allowed} allowed cores (of {online}) shared by {sharers} ranks on this node"
        elif local_size > 1:
            threads, why = max(1, online // local_size), f"{online} cores / {local_size} ranks on this node"
        else:
            threads, why = None, f"one rank on {online} cores: TensorFlow's own pools"
    else:
        why = f"train.threads={threads}"
    if bind and threads is None:  # train.bind_cores=true alone: the rank's share of the node
        threads, why = max(1, allowed // local_size), f"{allowed} cores / {local_size} ranks on this node"
    if bind is None:
        # Bound here only where every local rank shares one set (then local rank k takes the k-th block of it);
        # ranks that share a socket's set cannot tell which block is theirs, and the kernel balances them.
        bind = (threads is not None and sharers == local_size > 1 and local_size * threads <= allowed)
    return Budget(threads, bind, why + (", bound here" if bind else ""))


def set_pools(threads: int, setting: str) -> None:
    """Sizes TensorFlow's two op pools (intra-op and inter-op) to ``threads`` each.

    Args:
      setting: what asked for it, as the user wrote it (``train.threads=2``), for the error.

    Raises:
      HvrepError: TensorFlow's runtime already runs in this process (an op ran): its pools are fixed.
    """
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as e:
        raise HvrepError(f"{setting} cannot be applied: TensorFlow's runtime is already running ({e}). Fix: set it "
                         "before anything else runs TensorFlow ops in this process, or export "
                         "TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS instead.") from None


def size_pools(local_size: int, *, bind: bool = True, launcher_binds: bool = True) -> Budget:
    """The default budget of one of ``local_size`` ranks on a node, with TensorFlow's two op pools sized to it
    now (``bind``: whether binding may be chosen; the caller binds with :func:`bind_cores` once it knows its
    local rank). What the application set wins: pools it sized already (``tf.config.threading`` or
    TensorFlow's ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS``) are kept and nothing is bound. So is
    a runtime already running (its pools are fixed then), with a warning saying how to get the budget.
    """
    import tensorflow as tf

    global _applied
    set_by_app = [f"{v}={os.environ[v]}" for v in POOL_VARIABLES if os.environ.get(v)]
    intra, inter = (tf.config.threading.get_intra_op_parallelism_threads(),
                    tf.config.threading.get_inter_op_parallelism_threads())
    if _applied is not None and (intra, inter) == (_applied.threads, _applied.threads):
        return _applied
    if intra or inter:
        set_by_app.append(f"tf.config.threading: intra-op {intra}, inter-op {inter}")
    if set_by_app:
        return Budget(intra or None, False, "set by the application (" + "; ".join(set_by_app) + ")")
    budget = default_budget(None, None if bind else False, local_size, launcher_binds=launcher_binds)
    if budget.threads is None:
        return budget
    try:
        set_pools(budget.threads, "the Replicator's cpu_budget")
    except HvrepError:  # TensorFlow's runtime started before the Replicator: its pools are fixed
        _log.warning(
            "hvrep: TensorFlow's runtime was already running when the Replicator was created, so this rank keeps "
            "TensorFlow's thread pools (sized for all %d cores, shared by %d ranks on this node) instead of %s. "
            "Fix: create the Replicator before running any TensorFlow op, or set the pools yourself "
            "(tf.config.threading, or TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS), or "
            "Replicator(cpu_budget=\"off\") to keep TensorFlow's defaults without this warning.",
            os.cpu_count() or 0, local_size, budget.why)
        return Budget(None, False, "TensorFlow's own pools: its runtime was running before the Replicator")
    _applied = budget
    return budget


@dataclass(frozen=True)
class Binding:
    """Where this process's threads run.

    Attributes:
      cores: the CPUs its threads may use now.
      bound_here: True when :func:`bind_cores` chose them; False when the process was already bound (or
        could run everywhere and binding was not asked for).
    """

    cores: tuple[int, ...]
    bound_here: bool


def bind_cores(local_rank: int, local_size: int, threads: int, *, launcher_binds: bool = True,
               container: int | None = None) -> Binding:
    """Binds every thread of this process to ``threads`` cores of its own: local rank k gets the k-th block of
    the cores the node's ranks share (all of the node's, or a container's or allocation's set).

    Threads created later inherit the binding from the thread that creates them; the ones running already
    (TensorFlow's pools, Horovod's background thread) are bound one by one. A rank the launcher bound to cores
    of its own (:func:`ranks_sharing` is 1), or that shares a set with only some local ranks, keeps its set.

    Args:
      launcher_binds: False under a launcher that binds no rank (``horovodrun``).
      container: the CPUs of the process's cgroup cpuset (default: :func:`container_cpus`).

    Raises:
      ConfigError: the shared set has fewer cores than ``local_size * threads``.
    """
    global _bound
    allowed = sorted(os.sched_getaffinity(0))
    online = os.cpu_count() or len(allowed)
    box = container_cpus() if container is None else container
    box = min(online, box) if box is not None else online
    if _bound is not None and tuple(allowed) == _bound:
        return Binding(_bound, bound_here=False)  # bound by an earlier Replicator of this process: kept
    sharers = ranks_sharing(local_size, len(allowed), box, launcher_binds)
    if len(allowed) < online and (sharers != local_size or local_size == 1):
        return Binding(tuple(allowed), bound_here=False)  # bound already: by the launcher, or a set only some share
    need = local_size * threads
    if need > len(allowed):
        raise ConfigError(
            f"train.bind_cores=true needs {local_size} rank(s) x train.threads={threads} = {need} cores on this "
            f"node, which has {len(allowed)}. Fix: lower train.threads to {max(1, len(allowed) // local_size)}, run "
            "fewer ranks per node, or set train.bind_cores=false.")
    mine = allowed[local_rank * threads:(local_rank + 1) * threads]
    _bound = tuple(mine)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return Binding(tuple(mine), bound_here=True)


def current_cores() -> tuple[int, ...]:
    """The CPUs this thread may use."""
    return tuple(sorted(os.sched_getaffinity(0)))
