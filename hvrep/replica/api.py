"""The replica API: write the step for one replica, run it on every replica.

    repl = hvrep.Replicator()                       # horovod | tpu | local | auto
    with repl.scope():
        model, optimizer = ...
    for batch in repl.distribute_dataset(input_fn, global_batch_size=256):
        out = repl.run(step_fn, args=(batch,))
        loss = repl.reduce(out["loss"], "mean")

Inside ``step_fn`` the module-level collectives (``hvrep.all_reduce`` ...)
act on the live Replicator: one per process. The user writes the inner
step, the library owns the rest (STYLE.md: Orbit, TF-Replicator).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hvrep import _env
from hvrep.errors import ConfigError
from hvrep.replica import backends, collectives, context, cores, support
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext, check_op
from hvrep.replica.devices import check_devices_per_replica
from hvrep.replica.placement import resolve_placement
from hvrep.replica.support import Setting

# Replicator(batch_norm=...): how Keras' BatchNormalization layers train in a step run() traces.
BATCH_NORMS = ("fused", "keras")
# Replicator(cpu_budget=...): whether several ranks on a node size and bind their CPU threads by default.
CPU_BUDGETS = ("auto", "off")

# The Replicator created last in this process: what a Keras optimizer restored from its config binds to.
_latest: weakref.ref | None = None


class Replicator:
    """Runs one replica's step on every replica.

    Args:
      backend: "horovod" (one process per replica under mpirun/horovodrun/srun),
        "tpu", "local" (this machine's devices, in-graph) or "auto" (horovod when
        launched with more than one rank, tpu when a TPU is attached, else local).
      config: communication settings; default ``CommConfig()``.
      batch_norm: how ``keras.layers.BatchNormalization`` layers train in a
        step ``run`` traces. "fused" (default): with TensorFlow's fused kernel
        (``FusedBatchNormV3``; cuDNN's on GPUs), as tf_keras, and so every
        Horovod example, did: a ResNet-50 step on Keras 3 took 1.33x as long
        without it (docs/performance.md, "Throughput against plain Horovod"). Same
        outputs, gradients and moving statistics as Keras' own ops up to
        float32 rounding; taken only where it normalises exactly as Keras
        does (4-D channels-last float16/bfloat16/float32 input, training,
        no mask, renorm or ``synchronized``, Keras' own moments), Keras' own
        ops elsewhere. "keras": Keras' own ops everywhere. Steps outside
        ``run`` (``model.fit``, your own ``tf.function``) are Keras' own
        either way; ``hvrep.layers.FusedBatchNormalization`` fuses there. A
        ``tf.function`` of your own first traced inside ``run`` keeps the
        fused graph when called outside it (TensorFlow reuses the trace). On
        a Keras outside the releases it was verified on
        (``hvrep.compat.keras_versions``) "fused" keeps Keras' ops, with one
        warning.
      cpu_budget: "auto" (default): where several ranks of a horovod job share a node, each sizes TensorFlow's
        two op pools to its share of the node's cores (the cores a launcher, Slurm or a cgroup bound it to;
        else the node's cores divided by its ranks on the node) and, where no launcher bound it, binds its
        threads to a block of cores of its own (local rank k: the k-th block), as ``hvrep train`` does
        (docs/performance.md, "CPU budget per rank"). Without it two ranks under ``horovodrun --gloo`` each
        sized their pools for every core and ran slower together than one rank alone. Pools the application
        sized first (``tf.config.threading``, ``TF_NUM_INTRAOP_THREADS`` / ``TF_NUM_INTEROP_THREADS``) win and
        nothing is bound; a TensorFlow runtime that started before the Replicator keeps its pools, with a
        warning. Under horovodrun's elastic driver nothing is bound (local ranks change at each reset).
        One process (in-graph backends, or one rank on its node) keeps TensorFlow's defaults. "off": keep
        TensorFlow's defaults and the process's affinity.
      devices_per_replica: devices each replica owns (default 1). With k > 1 a
        replica's model is split across k devices: a horovod rank with local
        rank r owns the node's GPUs r*k ... r*k+k-1 (without GPUs, its
        process's first k logical CPU devices); the local backend splits this
        machine's devices into num_devices // k replicas. The step places each
        part with ``tf.device(hvrep.replica_devices()[j])``; see
        docs/model-parallel.md.

    Several Replicators may exist in one process (e.g. with different
    configs); the collectives act on the one whose ``run`` is executing.

    Attributes:
      cpu_budget: the CPU budget ``cpu_budget="auto"`` applied (``hvrep.replica.cores.Budget``: threads per
        pool, whether bound, why), or None where it left TensorFlow's defaults (one process on its node, or
        "off").
      cpu_binding: the cores this process's threads were bound to (``hvrep.replica.cores.Binding``), or None.

    Raises:
      hvrep.errors.ConfigError: unknown backend or batch_norm, or a config of the wrong type;
        a devices_per_replica that does not divide the local backend's devices, or that a rank
        lacks; a combination the support table refuses (``hvrep.replica.support``, docs/combinations.md:
        accumulation on an in-graph backend, bf16 compression on horovod, devices_per_replica > 1 on tpu).
    """

    def __init__(self, backend: str = "auto", *, config: CommConfig | None = None,
                 batch_norm: str = "fused", cpu_budget: str = "auto", devices_per_replica: int = 1) -> None:
        if config is not None and not isinstance(config, CommConfig):
            raise ConfigError(f"config must be an hvrep.CommConfig, got {type(config).__name__}.")
        if batch_norm not in BATCH_NORMS:
            raise ConfigError(f"batch_norm must be one of {BATCH_NORMS}, got {batch_norm!r}. Fix: \"fused\" "
                              "(TensorFlow's fused kernel, the default) or \"keras\" (Keras' own ops).")
        if cpu_budget not in CPU_BUDGETS:
            raise ConfigError(f"cpu_budget must be one of {CPU_BUDGETS}, got {cpu_budget!r}. Fix: \"auto\" (each "
                              "rank's share of its node's cores, the default) or \"off\" (TensorFlow's defaults).")
        self.devices_per_replica = check_devices_per_replica(devices_per_replica)
        self.config = config or CommConfig()
        # Refused combinations of backend, devices and communication settings (hvrep.replica.support), before
        # anything starts.
        support.check([support.backend_setting(backends.resolve(backend)),
                       support.count("devices_per_replica", self.devices_per_replica,
                                     f"devices_per_replica={self.devices_per_replica}"),
                       *support.comm_settings(self.config)], "Replicator")
        self.batch_norm = batch_norm
        self.cpu_budget: cores.Budget | None = None
        self.cpu_binding: cores.Binding | None = None
        if cpu_budget == "auto" and backend in ("auto", "horovod"):
            # Before the backend starts Horovod (and its background thread) and before any op: the pools are
            # fixed once TensorFlow's runtime runs. The launcher's variables say where this rank sits.
            placement = resolve_placement()
            if placement.local_size > 1:
                self.cpu_budget = cores.size_pools(placement.local_size, bind=not _env.horovod_elastic(),
                                                   launcher_binds=placement.launcher != "horovodrun")
        self._backend = backends.create(backend, self.config, self.devices_per_replica)
        self._backend.batch_norm = batch_norm
        if self.cpu_budget is not None and self.cpu_budget.bind and self._backend.name == "horovod":
            self.cpu_binding = cores.bind_cores(self._backend.local_rank, self._backend.local_size,
                                                self.cpu_budget.threads,
                                                launcher_binds=placement.launcher != "horovodrun")
        global _latest
        _latest = weakref.ref(self)

    @property
    def backend(self) -> str:
        """The backend's name ("horovod", "tpu" or "local")."""
        return self._backend.name

    @property
    def num_replicas(self) -> int:
        """Replicas in the job (world size)."""
        return self._backend.num_replicas

    @property
    def is_chief(self) -> bool:
        """True in exactly one process: the one that writes checkpoints and logs."""
        return self._backend.is_chief

    @property
    def rank(self) -> int:
        """This process's index in the job, in [0, num_processes): ``hvd.rank()`` on horovod, 0 on in-graph
        backends (one process drives every replica). Equals the replica id only on horovod."""
        return self._backend.rank

    @property
    def num_processes(self) -> int:
        """Processes in the job: ``hvd.size()`` on horovod, 1 on in-graph backends (see ``num_replicas``)."""
        return self._backend.num_processes

    @property
    def local_rank(self) -> int:
        """This process's index among those on its node (``hvd.local_rank()``; 0 in-graph): on horovod, the
        GPU it binds to is ``local_rank % visible GPUs``."""
        return self._backend.local_rank

    @property
    def local_size(self) -> int:
        """Processes on this node (``hvd.local_size()``; 1 in-graph)."""
        return self._backend.local_size

    @property
    def collective_calls(self) -> int:
        """Collective ops created so far: counted when a step is traced (not per execution), over the
        replicas this process traces (one on horovod, every replica on in-graph backends)."""
        return self._backend.collective_calls

    @property
    def collective_bytes(self) -> int:
        """Bytes the all-reduces created so far were asked to reduce, as they travel (fp16 buffers count 2 per
        value): counted when a step is traced, like ``collective_calls``; the payload of one step is the
        difference across one trace."""
        return self._backend.reduced_bytes

    def close(self) -> None:
        """Releases what this Replicator holds: its compiled steps and, on horovod, its use of the hang
        watchdog (the last Replicator of the process to close stops it, and rank 0's port closes).

        Horovod stays initialised for the process, as Horovod requires. Collectives of this Replicator after
        ``close`` still work, unwatched once the watchdog has stopped.
        """
        self._backend.close()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Variables created inside start identical on every replica (broadcast from the chief).

        ``hvrep.replica_devices()`` inside names this process's first replica's devices: on horovod a variable
        created under ``tf.device`` of one of them lives there; in-graph backends mirror every variable on each
        replica's first device.
        """
        return context.scoped(self._backend, self._backend.scope())

    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None = None) -> Any:
        """Builds each replica's dataset with ``input_fn(ctx)``; iterate it to get ``run``'s inputs.

        Args:
          input_fn: returns the per-replica ``tf.data.Dataset`` (batched at
            ``ctx.per_replica_batch_size``) for ``ctx.replica_id``; a GPU
            pipeline runs on ``ctx.cuda_device`` (CUDA's number, DALI's
            ``device_id``) placed on ``ctx.tf_device`` (TensorFlow's).
          global_batch_size: if given, must divide by ``num_replicas``; sets
            ``ctx.per_replica_batch_size``.
        """
        return self._backend.distribute_dataset(input_fn, global_batch_size)

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` on every replica, compiled once with ``tf.function``.

        Returns:
          Per-replica outputs: tensors on horovod (this process's replica),
          ``PerReplica`` values on in-graph backends. Pass them to :meth:`reduce`.
        """
        return self._backend.run(fn, tuple(args), dict(kwargs or {}))

    def reduce(self, value: Any, op: str) -> Any:
        """Reduces per-replica values (a nest) to host NumPy values, the same on every process.

        ``op``: "sum", "mean", "max" or "min"; integer "mean" floors.
        """
        return self._backend.reduce(value, check_op(op))

    def all_reduce(self, value: Any, op: str, *, compress: bool = False, powersgd: Any = None,
                   loss_scale: Any = None) -> Any:
        """``hvrep.all_reduce`` for a step this Replicator does not run itself: code traced by someone else's
        compiled function (Keras' ``fit`` train step), where ``run`` is not on the stack.

        Call it from inside that traced step, on every replica alike, as a collective inside ``run``.
        ``compress``, ``powersgd`` and ``loss_scale``: as ``hvrep.all_reduce``'s (gradients only).
        """
        with self._backend.replica_section():
            return collectives.all_reduce(value, check_op(op), compress=compress, powersgd=powersgd,
                                          loss_scale=loss_scale)

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> None:
        """Eagerly overwrites ``variables`` (tf or Keras variables, the same list in the same order on every
        process) with process ``root_rank``'s values: one broadcast per dtype on horovod. In-graph backends
        hold one process, whose mirrored variables are already equal: nothing to do there."""
        # A Keras 3 variable wraps a tf.Variable (its .value); a tf.Variable's own .value is a method.
        plain = [v if isinstance(v, tf.Variable) or not hasattr(v, "value") else v.value for v in variables]
        self._backend.broadcast_variables(plain, root_rank)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Eagerly returns process ``root_rank``'s ``obj`` (any picklable value) on every process: a
        collective, called by every process alike. One process (in-graph backends): ``obj`` itself."""
        return self._backend.broadcast_object(obj, root_rank)

    def wrap_optimizer(self, optimizer: Any, *, model: Any = None) -> Any:
        """Returns ``optimizer`` wrapped so ``apply_gradients`` all-reduces (mean) first.

        With ``CommConfig.accumulation_steps`` k > 1 it accumulates k micro-batches
        locally before one all-reduce and update (horovod backend only). With
        ``compression="powersgd"`` the wrapper owns the PowerSGD state (``.powersgd``).

        With ``CommConfig.local_steps`` H (local SGD) it applies each replica's own
        gradients to its own copy of the model and averages the models every H-th
        update (docs/local-sgd.md); ``model`` (a built Keras model, required then)
        names the state averaged with the weights: its floating-point
        non-trainable variables (batch-norm statistics). Call it after the
        model is built; ``apply_gradients`` must then receive the model's
        trainable variables, in their order, once per step.

        Raises:
          hvrep.errors.ConfigError: a combination the support table refuses (``hvrep.replica.support``: e.g.
            local SGD with fp16 loss scaling); local SGD without a built ``model``.
        """
        from hvrep.replica.wrap import CrossReplicaOptimizer

        k = self.config.accumulation_steps
        self.check_optimizer(optimizer, "custom", "Replicator.wrap_optimizer")
        return CrossReplicaOptimizer(optimizer, k, self.config, self.num_replicas,
                                     local_sgd=self.local_sgd(model, "wrap_optimizer(opt, model=model)"))

    def check_optimizer(self, optimizer: Any, loop: str, where: str) -> None:
        """Refuses, by the support table (``hvrep.replica.support``), an optimizer whose family, clipping or
        precision does not combine with this Replicator's settings in ``loop`` ("custom" or "fit")."""
        support.check([self._backend_setting(), Setting("loop", (loop,), f"loop={loop}"),
                       *support.comm_settings(self.config),
                       *support.optimizer_settings(optimizer, _policy_name())], where)

    def _backend_setting(self) -> Setting:
        controller = getattr(self._backend, "controller", None)
        return support.backend_setting(self.backend, controller)

    def local_sgd(self, model: Any, call: str = "local_sgd(model)") -> Any:
        """The local-SGD state of ``model`` for this Replicator's ``CommConfig.local_steps``, or None when it is
        None (synchronous SGD). Build it inside ``scope()``: ``wrap_optimizer`` and
        ``hvrep.keras.DistributedOptimizer`` call it; ``call`` names the caller in errors."""
        if self.config.local_steps is None:
            return None
        from hvrep.replica.localsgd import LocalSGD, averaged_state

        if model is None or not getattr(model, "built", False) or not getattr(model, "trainable_variables", None):
            raise ConfigError(
                f"local_steps={self.config.local_steps} (local SGD) averages the whole model every "
                f"{self.config.local_steps} steps, batch-norm statistics included, so it needs the built model; got "
                f"model={type(model).__name__ if model is not None else None}. Fix: {call} with a built Keras "
                "model (call it once, or build it, first).")
        with self.scope():
            return LocalSGD(self.config, self._backend, model.trainable_variables,
                            averaged_state(model.non_trainable_variables))


def _policy_name() -> str | None:
    """Keras' global dtype policy's name ("mixed_bfloat16" ...), or None when Keras is not imported (an
    optimizer to check is a Keras one, so Keras is imported whenever it matters)."""
    keras = sys.modules.get("keras")
    return keras.mixed_precision.global_policy().name if keras is not None else None


def latest() -> Replicator:
    """The Replicator created last in this process (what ``hvrep.keras.DistributedOptimizer.from_config`` binds).

    Raises:
      hvrep.errors.ConfigError: none exists.
    """
    repl = _latest() if _latest is not None else None
    if repl is None:
        raise ConfigError("no hvrep.Replicator exists in this process. Fix: create one (`repl = hvrep.Replicator()`) "
                          "before loading a model whose optimizer is an hvrep.keras.DistributedOptimizer.")
    return repl
