"""What the in-graph backends (local, tpu) share: replicas inside one TF program.

The double-reduction problem: inside a ``tf.distribute`` replica context,
Keras 3's TensorFlow optimizer sums the gradients across replicas itself
(``keras/src/backend/tensorflow/optimizer.py``, ``_all_reduce_sum_gradients``).
A step written for hvrep already all-reduces them (``hvrep.all_reduce(grads,
"mean")``), so on these backends the update would see N times the mean.
hvrep marks the tensors its all_reduce returns, and the strategies built here
return a marked value unchanged when asked to SUM it again: every replica
already holds the reduced value. So the same user step gives the same result
on every backend, and a step that does not all-reduce (plain Keras style)
still gets Keras' sum. This uses TF's internal ``MirroredExtended`` (pinned
TF 2.21); the fidelity test catches a TF change that breaks it.
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
from hvrep.replica.backends.base import Backend, mean_from_sum, move_bf16_as_bits
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext, check_op, per_replica_batch
from hvrep.replica.devices import NO_GPU, ReplicaGpu


class _Marks:
    """Tensors that already hold a cross-replica reduction (by identity)."""

    def __init__(self) -> None:
        self._refs: set[Any] = set()

    def add(self, t: tf.Tensor) -> None:
        self._refs.add(t.ref())

    def has(self, value: Any) -> bool:
        parts = value.values if isinstance(value, tf_values.DistributedValues) else (value,)
        return all(isinstance(p, tf.Tensor) and p.ref() in self._refs for p in parts)


class _MarkingMirroredExtended(mirrored_strategy.MirroredExtended):
    def __init__(self, container_strategy: Any, devices: Sequence[str], marks: _Marks) -> None:
        super().__init__(container_strategy, devices=devices,
                         cross_device_ops=tf.distribute.ReductionToOneDevice())
        self._hvrep_marks = marks

    def _batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any, options: Any) -> Any:
        pairs = list(value_destination_pairs)
        if reduce_op != tf.distribute.ReduceOp.SUM:
            return super()._batch_reduce_to(reduce_op, pairs, options)
        marked = [self._hvrep_marks.has(v) for v, _ in pairs]
        if not any(marked):
            return super()._batch_reduce_to(reduce_op, pairs, options)
        rest = iter(super()._batch_reduce_to(reduce_op, [p for p, m in zip(pairs, marked, strict=True) if not m],
                                             options) if not all(marked) else [])
        # A marked value is already the all-replica result on every replica.
        return [v if m else next(rest) for (v, _), m in zip(pairs, marked, strict=True)]


class MarkingMirroredStrategy(tf.distribute.MirroredStrategy):
    """MirroredStrategy whose SUM of an hvrep-reduced value is that value."""

    def __init__(self, devices: Sequence[str], marks: _Marks) -> None:
        distribute_lib.Strategy.__init__(self, _MarkingMirroredExtended(self, devices, marks))


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
      gpus: replica i's GPU (``hvrep.replica.devices.replica_gpus``), one per
        replica; empty when the replicas are not GPUs.
    """

    def __init__(self, config: CommConfig, strategy: tf.distribute.Strategy, marks: _Marks,
                 gpus: Sequence[ReplicaGpu] = ()) -> None:
        super().__init__(config)
        self.strategy = strategy
        self._marks = marks
        self._functions: dict[Any, Any] = {}
        self._gpus = list(gpus) or [NO_GPU] * self.num_replicas
        if len(self._gpus) != self.num_replicas:
            raise SetupError(f"{len(self._gpus)} GPUs were given for {self.num_replicas} in-graph replicas; "
                             "each replica needs one.")

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

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
            input_fn(InputContext(i, self.num_replicas, pbs, cuda_device=gpu.cuda_device, tf_device=gpu.tf_device))
            for i, gpu in enumerate(self._gpus)])

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if fn not in self._functions:
            strategy = self.strategy

            def replicated(*a: Any, **k: Any) -> Any:
                return strategy.run(fn, args=a, kwargs=k)

            self._functions[fn] = tf.function(replicated, reduce_retracing=True)
        with self.replica_section():
            return self._functions[fn](*args, **kwargs)

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

    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str) -> list[tf.Tensor]:
        out = super().all_reduce(tensors, op)
        for r in out:
            self._marks.add(r)
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
