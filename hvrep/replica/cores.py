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

A process that is already bound (it may use fewer than all online CPUs: a
launcher's ``--bind-to``, Slurm's ``--cpu-bind`` or a cgroup) keeps its binding.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hvrep.errors import ConfigError, HvrepError

_log = logging.getLogger("hvrep")
# TensorFlow's own variables for its pools' sizes (read when its runtime starts).
POOL_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
# The budget size_pools applied in this process (a later Replicator finds the pools sized by an earlier one).
_applied: Budget | None = None


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


def default_budget(threads: int | None, bind: bool | None, local_size: int,
                   allowed: int | None = None, online: int | None = None) -> Budget:
    """The budget of one of ``local_size`` ranks on a node; ``threads`` / ``bind`` (the settings) win when given.

    Args:
      allowed: the CPUs this process may use (default: ``os.sched_getaffinity``); fewer than ``online`` means
        a launcher, Slurm or a cgroup bound it, and that binding is its budget.
      online: the node's CPUs (default: ``os.cpu_count()``).
    """
    allowed = len(os.sched_getaffinity(0)) if allowed is None else allowed
    online = (os.cpu_count() or allowed) if online is None else online
    bound_by_launcher = allowed < online
    if threads is None:
        if bound_by_launcher:
            threads, why = allowed, f"the {allowed} core(s) the launcher bound this rank to"
        elif local_size > 1:
            threads, why = max(1, online // local_size), f"{online} cores / {local_size} ranks on this node"
        else:
            threads, why = None, f"one rank on {online} cores: TensorFlow's own pools"
    else:
        why = f"train.threads={threads}"
    if bind and threads is None:  # train.bind_cores=true alone: the rank's share of the node
        threads, why = max(1, online // local_size), f"{online} cores / {local_size} ranks on this node"
    if bind is None:
        bind = threads is not None and not bound_by_launcher and local_size > 1 and local_size * threads <= online
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


def size_pools(local_size: int, *, bind: bool = True) -> Budget:
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
    budget = default_budget(None, None if bind else False, local_size)
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


def bind_cores(local_rank: int, local_size: int, threads: int) -> Binding:
    """Binds every thread of this process to ``threads`` cores of its own: local rank k gets the k-th block.

    Threads created later inherit the binding from the thread that creates them; the ones running already
    (TensorFlow's pools, Horovod's background thread) are bound one by one.

    Raises:
      ConfigError: the node has fewer cores than ``local_size * threads``.
    """
    allowed = sorted(os.sched_getaffinity(0))
    online = os.cpu_count() or len(allowed)
    if len(allowed) < online:
        return Binding(tuple(allowed), bound_here=False)
    need = local_size * threads
    if need > len(allowed):
        raise ConfigError(
            f"train.bind_cores=true needs {local_size} rank(s) x train.threads={threads} = {need} cores on this "
            f"node, which has {len(allowed)}. Fix: lower train.threads to {max(1, len(allowed) // local_size)}, run "
            "fewer ranks per node, or set train.bind_cores=false.")
    mine = allowed[local_rank * threads:(local_rank + 1) * threads]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return Binding(tuple(mine), bound_here=True)


def current_cores() -> tuple[int, ...]:
    """The CPUs this thread may use."""
    return tuple(sorted(os.sched_getaffinity(0)))
