"""What the in-graph backends (local, tpu) share: replicas inside one TF program.

Each gradient is reduced exactly once per step. Inside a ``tf.distribute``
replica context, Keras 3's TensorFlow optimizer sums the gradients across
replicas itself (``keras/src/backend/tensorflow/optimizer.py``,
``_all_reduce_sum_gradients``), after clipping and loss-scale unscaling have
made new tensors. A step written for hvrep has already reduced them
(``hvrep.all_reduce(grads, "mean")`` or ``repl.wrap_optimizer``), so the
strategies built here skip Keras' SUM for a value that is *derived only from
hvrep-reduced tensors* (:class:`_Marks`): hvrep marks what its all_reduce
returns, and a value computed from marked tensors, constants and variable
reads (clipping, unscaling, weight decay) holds the same number on every
replica. A value that depends on anything per-replica (the step's inputs,
stateful random ops) is summed as before, so a plain-Keras step that never
calls hvrep keeps Keras' own sum, and Keras' other collectives (synchronized
BatchNormalization's statistics) are untouched.

Inside ``Replicator.run`` the strategy reports ``num_replicas_in_sync == 1``
(:class:`_OneReplicaView`): the step is one replica's step, so a
``keras.losses.Loss`` object or ``tf.nn.compute_average_loss`` averages over
the replica's own batch, as on the horovod backend, instead of dividing by N
for Keras' later sum. Outside ``run`` (``model.fit`` under ``repl.scope()``)
it reports the true count and Keras' convention holds.

Both hooks use TF's internal strategy-extended classes (pinned TF 2.21) on
hvrep's own subclasses; Keras is not patched. The fidelity suite (clipping,
loss scaling, Loss objects, wrap_optimizer) catches a TF change that breaks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib, mirrored_strategy
from tensorflow.python.distribute import values as tf_values

from hvrep.errors import CollectiveError, SetupError
from hvrep.replica.backends.base import Backend, FunctionCache, mean_from_sum, move_bf16_as_bits
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext, check_op, per_replica_batch
from hvrep.replica.devices import NO_GPU, ReplicaGpu

# Ops whose output is the same on every replica whatever their inputs' history.
_REPLICA_INVARIANT_LEAVES = frozenset({"Const", "ReadVariableOp", "VariableShape", "VarIsInitializedOp"})
# Ops whose output differs per replica even from replica-invariant inputs.
_PER_REPLICA_PREFIXES = ("Random", "Stateful", "Iterator", "MultiDeviceIterator", "OptionalGetValue",
                         "Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal", "Rng",
                         "AnonymousIterator", "AnonymousMultiDeviceIterator")
_PER_REPLICA_EXCEPTIONS = frozenset({"StatefulPartitionedCall"})


class _Marks:
    """Tensors hvrep's all_reduce returned, and the test "is this value derived only from them".

    A value is tested while the step that reduced its inputs is being traced, so only the marks of the graphs
    being built now are kept: marking a tensor forgets those of every graph that is neither its graph nor one
    of that graph's outer graphs. A mark holds its tensor and so its whole graph; kept for the backend's life,
    every traced step's graph would stay alive with it.
    """

    def __init__(self) -> None:
        self._by_graph: dict[int, set[Any]] = {}  # id(graph) -> refs of its marked tensors

    def __len__(self) -> int:
        return sum(map(len, self._by_graph.values()))

    def add(self, t: tf.Tensor) -> None:
        graph = getattr(t, "graph", None)  # None for an eager tensor, which nothing is derived from in a trace
        if graph is None:
            return
        building = set()
        while graph is not None:
            building.add(id(graph))
            graph = getattr(graph, "outer_graph", None)
        for key in [k for k in self._by_graph if k not in building]:
            del self._by_graph[key]
        self._by_graph.setdefault(id(t.graph), set()).add(t.ref())

    def _marked(self, t: Any) -> bool:
        return any(t.ref() in refs for refs in self._by_graph.values())

    def has(self, value: Any) -> bool:
        """True if every replica's part of ``value`` is an hvrep-reduced value or computed only from such values,
        constants and variable reads (so it already holds the all-replica result)."""
        if not self._by_graph:
            return False
        parts = value.values if isinstance(value, tf_values.DistributedValues) else (value,)
        return all(self._derived_from_marks(p) for p in parts)

    def _derived_from_marks(self, t: Any) -> bool:
        if not isinstance(t, tf.Tensor) or not hasattr(t, "graph") or tf.executing_eagerly():
            return False
        if self._marked(t):
            return True
        captures: dict[int, dict[Any, Any]] = {}
        seen: set[Any] = set()
        stack = [t]
        saw_mark = False
        while stack:
            x = stack.pop()
            if x.ref() in seen:
                continue
            seen.add(x.ref())
            if self._marked(x):
                saw_mark = True
                continue
            if not hasattr(x, "op"):  # an eager tensor captured from outside: a constant
                continue
            op = x.op
            if op.type in _REPLICA_INVARIANT_LEAVES:
                continue
            if op.type == "Placeholder":
                # A function graph's input: a capture resolves to its outer tensor; an argument is per replica.
                graph = x.graph
                if id(graph) not in captures:
                    captures[id(graph)] = {inner.ref(): outer for outer, inner in getattr(graph, "captures", ())}
                outer = captures[id(graph)].get(x.ref())
                if outer is None:
                    return False
                stack.append(outer)
                continue
            if op.type.startswith(_PER_REPLICA_PREFIXES) and op.type not in _PER_REPLICA_EXCEPTIONS:
                return False
            if not op.inputs:
                return False  # a source op not known to be replica-invariant
            stack.extend(op.inputs)
        return saw_mark


class _MarkingExtendedMixin:
    """A strategy-extended whose SUM of a value :class:`_Marks` recognises returns that value unchanged."""

    _hvrep_marks: _Marks

    def _sum_unmarked(self, items: list[Any], value: Callable[[Any], Any],
                      reduce: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """``reduce`` (a SUM) of the items whose value is not recognised as reduced; the others' values as they
        are: already the all-replica result on every replica."""
        marked = [self._hvrep_marks.has(value(i)) for i in items]
        if not any(marked):
            return list(reduce(items))
        rest = iter(reduce([i for i, m in zip(items, marked, strict=True) if not m]) if not all(marked) else [])
        return [value(i) if m else next(rest) for i, m in zip(items, marked, strict=True)]

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any) -> Any:
        parent = super()._batch_reduce_to  # type: ignore[misc]
        if reduce_op != tf.distribute.ReduceOp.SUM:
            return parent(reduce_op, value_destination_pairs, options)
        return self._sum_unmarked(list(value_destination_pairs), lambda pair: pair[0],
                                  lambda pairs: parent(reduce_op, pairs, options))

    def _replica_ctx_all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        # The path without merge_call (MirroredStrategy under XLA on GPUs): one replica's tensors.
        parent = super()._replica_ctx_all_reduce  # type: ignore[misc]
        if reduce_op != tf.distribute.ReduceOp.SUM:
            return parent(reduce_op, value, options)
        flat = self._sum_unmarked(tf.nest.flatten(value), lambda v: v, lambda vs: parent(reduce_op, vs, options))
        return tf.nest.pack_sequence_as(value, flat)


class _MarkingMirroredExtended(_MarkingExtendedMixin, mirrored_strategy.MirroredExtended):
    pass


class _OneReplicaView:
    """``num_replicas_in_sync`` is 1 while hvrep runs a user's step (see the module docstring).

    TF's own machinery reads ``extended._num_replicas_in_sync``, which stays true.
    """

    _hvrep_in_step = 0

    @property
    def num_replicas_in_sync(self) -> int:
        if self._hvrep_in_step:
            return 1
        return int(self.extended._num_replicas_in_sync)  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def one_replica_view(self) -> Iterator[None]:
        self._hvrep_in_step += 1
        try:
            yield
        finally:
            self._hvrep_in_step -= 1


class MarkingMirroredStrategy(_OneReplicaView, tf.distribute.MirroredStrategy):
    """MirroredStrategy whose SUM of an hvrep-reduced value is that value."""

    def __init__(self, devices: Sequence[str], marks: _Marks) -> None:
        extended = _MarkingMirroredExtended(self, devices=devices, cross_device_ops=cross_device_ops_for(devices))
        extended._hvrep_marks = marks
        distribute_lib.Strategy.__init__(self, extended)


def cross_device_ops_for(devices: Sequence[str]) -> tf.distribute.CrossDeviceOps:
    """How the local backend's replicas all-reduce: NCCL when they are all GPUs (one ring over NVLink/PCIe, what
    MirroredStrategy picks by default on GPUs), else a reduction through one device (CPUs: NCCL needs GPUs)."""
    if devices and all("GPU" in tf.DeviceSpec.from_string(d).device_type.upper() for d in devices):
        return tf.distribute.NcclAllReduce()
    return tf.distribute.ReductionToOneDevice()


def true_replica_count(strategy: tf.distribute.Strategy) -> int:
    """The strategy's replica count, also inside a step where the one-replica view reports 1."""
    return int(strategy.extended._num_replicas_in_sync)


class _DistributedData:
    """Zips one dataset per replica; yields per-replica values for ``run``."""

    def __init__(self, strategy: tf.distribute.Strategy, datasets: list[tf.data.Dataset]) -> None:
        self._strategy = strategy
        self._datasets = datasets

    def __iter__(self) -> Iterator[Any]:
        for elems in tf.data.Dataset.zip(tuple(self._datasets)):
            yield self._strategy.experimental_distribute_values_from_function(
                lambda ctx, elems=elems: elems[ctx.replica_id_in_sync_group])


class InGraphBackend(Backend):
    """Replicas are devices of one process, driven by a tf.distribute strategy.

    Args:
      gpus: replica i's (first) GPU (``hvrep.replica.devices.replica_gpus``), one
        per replica; empty when the replicas are not GPUs.
      devices: replica i's devices, one tuple per replica; empty: each replica
        owns the one device the strategy runs it on.
    """

    def __init__(self, config: CommConfig, strategy: tf.distribute.Strategy, marks: _Marks,
                 gpus: Sequence[ReplicaGpu] = (), devices: Sequence[tuple[str, ...]] = ()) -> None:
        super().__init__(config, len(devices[0]) if devices else 1)
        self.strategy = strategy
        self._marks = marks
        self._functions = FunctionCache()
        self._gpus = list(gpus) or [NO_GPU] * self.num_replicas
        if len(self._gpus) != self.num_replicas:
            raise SetupError(f"{len(self._gpus)} GPUs were given for {self.num_replicas} in-graph replicas; "
                             "each replica needs one.")
        self._devices = [tuple(d) for d in devices] or [(d,) for d in strategy.extended.worker_devices]
        if len(self._devices) != self.num_replicas:
            raise SetupError(f"{len(self._devices)} device groups were given for {self.num_replicas} in-graph "
                             "replicas; each replica needs one.")

    def replica_devices(self) -> tuple[str, ...]:
        # Each replica's function runs in a replica context of its own, holding its id as a constant.
        ctx = tf.distribute.get_replica_context()
        replica = None
        if ctx is not None and ctx.strategy is self.strategy:
            replica = tf.get_static_value(ctx.replica_id_in_sync_group)
        return self._devices[int(replica) if replica is not None else 0]

    @property
    def num_replicas(self) -> int:
        return true_replica_count(self.strategy)

    @property
    def is_chief(self) -> bool:
        return True  # one process drives every replica

    # One process drives every replica: it is the whole job, and alone on its node.
    @property
    def rank(self) -> int:
        return 0

    @property
    def num_processes(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def local_size(self) -> int:
        return 1

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.strategy.scope()

    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None) -> _DistributedData:
        pbs = per_replica_batch(global_batch_size, self.num_replicas)
        return _DistributedData(self.strategy, [
            input_fn(InputContext(i, self.num_replicas, pbs, cuda_device=gpu.cuda_device, tf_device=gpu.tf_device,
                                  devices=devices))
            for i, (gpu, devices) in enumerate(zip(self._gpus, self._devices, strict=True))])

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        strategy = self.strategy

        def compile_fn(fn: Callable[..., Any]) -> Any:
            body = self.step_body(fn)  # runs on each replica's thread

            def replicated(*a: Any, **k: Any) -> Any:
                view = getattr(strategy, "one_replica_view", contextlib.nullcontext)
                with view():
                    return strategy.run(body, args=a, kwargs=k)

            return tf.function(replicated, reduce_retracing=True)

        compiled = self._functions.entry(fn, compile_fn)[1]
        with self.replica_section():
            return compiled(*args, **kwargs)

    def _local(self, value: Any) -> list[np.ndarray]:
        return [np.asarray(v) for v in self.strategy.experimental_local_results(value)]

    def reduce(self, value: Any, op: str) -> Any:
        check_op(op)

        def one(v: Any) -> Any:
            parts = self._local(v)
            stacked = np.stack(parts)
            if op == "sum":
                return stacked.sum(axis=0).astype(parts[0].dtype)
            if op == "mean":
                integer = bool(np.issubdtype(parts[0].dtype, np.integer))
                total = stacked.sum(axis=0) if integer else stacked.astype(np.float64).sum(axis=0)
                return mean_from_sum(total, len(parts), integer).astype(parts[0].dtype)
            return (stacked.max(axis=0) if op == "max" else stacked.min(axis=0)).astype(parts[0].dtype)

        return tf.nest.map_structure(lambda v: None if v is None else one(v), value)

    @staticmethod
    def _ctx() -> tf.distribute.ReplicaContext:
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise CollectiveError("in-graph collective called in cross-replica context; call it inside run().")
        return ctx

    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str, compress: bool = False) -> list[tf.Tensor]:
        out = super().all_reduce(tensors, op, compress)
        for r in out:
            self._marks.add(r)
        return out

    def keep_local(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        # Marked as if reduced: Keras' optimizer then skips its cross-replica SUM and the strategy's update gives
        # each replica's copy of a variable that replica's own value (local SGD, hvrep.replica.localsgd).
        out = [tf.identity(t) for t in tensors]
        for t in out:
            self._marks.add(t)
        return out

    def _reduce_tensor(self, t: tf.Tensor, op: str) -> tf.Tensor:
        if op in ("max", "min"):  # the replica context reduces SUM and MEAN only
            stacked = self.all_gather(t[None], axis=0)
            return tf.reduce_max(stacked, 0) if op == "max" else tf.reduce_min(stacked, 0)
        return super()._reduce_tensor(t, op)

    def _reduce_wire(self, t: tf.Tensor, op: str) -> tf.Tensor:
        return self._ctx().all_reduce(tf.distribute.ReduceOp.SUM, t)

    def all_gather(self, x: tf.Tensor, axis: int) -> tf.Tensor:
        self.collective_calls += 1
        if x.shape.rank == 0:
            raise CollectiveError("all_gather needs a tensor of rank >= 1; got a scalar. Fix: x[None].")
        ctx = self._ctx()
        return move_bf16_as_bits(x, lambda w: ctx.all_gather(w, axis=axis))

    def broadcast(self, x: tf.Tensor, root: int) -> tf.Tensor:
        if not 0 <= root < self.num_replicas:
            raise CollectiveError(f"broadcast root={root} is not a replica id in [0, {self.num_replicas}).")
        # Gather everyone's copy and keep the root's: exact for every dtype.
        return self.all_gather(x[None], axis=0)[root]

    def replica_id(self) -> tf.Tensor:
        return tf.cast(self._ctx().replica_id_in_sync_group, tf.int32)
