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

from hvrep.errors import CollectiveError
from hvrep.replica import fusion
from hvrep.replica.backends.base import Backend, InputContext, check_op, per_replica_batch
from hvrep.replica.comm import CommConfig


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
    """Replicas are devices of one process, driven by a tf.distribute strategy."""

    def __init__(self, config: CommConfig, strategy: tf.distribute.Strategy, marks: _Marks) -> None:
        super().__init__(config)
        self.strategy = strategy
        self._marks = marks
        self._functions: dict[Any, Any] = {}

    @property
    def num_replicas(self) -> int:
        return int(self.strategy.num_replicas_in_sync)

    @property
    def is_chief(self) -> bool:
        return True  # one process drives every replica

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.strategy.scope()

    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None) -> _DistributedData:
        pbs = per_replica_batch(global_batch_size, self.num_replicas)
        return _DistributedData(self.strategy, [input_fn(InputContext(i, self.num_replicas, pbs))
                                                for i in range(self.num_replicas)])

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
                if np.issubdtype(parts[0].dtype, np.integer):
                    return (stacked.sum(axis=0) // len(parts)).astype(parts[0].dtype)
                return stacked.astype(np.float64).mean(axis=0).astype(parts[0].dtype)
            return (stacked.max(axis=0) if op == "max" else stacked.min(axis=0)).astype(parts[0].dtype)

        return tf.nest.map_structure(lambda v: None if v is None else one(v), value)

    @staticmethod
    def _ctx() -> tf.distribute.ReplicaContext:
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            raise CollectiveError("in-graph collective called in cross-replica context; call it inside run().")
        return ctx

    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str) -> list[tf.Tensor]:
        check_op(op)
        ctx, n = self._ctx(), self.num_replicas
        out: list[tf.Tensor | None] = [None] * len(tensors)
        floats = [i for i, t in enumerate(tensors) if t.dtype.is_floating] if op in ("sum", "mean") else []
        if floats:
            wire = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16}[self.config.compression]

            def reduce_buffer(buf: tf.Tensor) -> tf.Tensor:
                self.collective_calls += 1
                if buf.dtype == tf.bfloat16:  # the CPU collectives have no bf16 kernels: sum in fp32
                    return tf.cast(ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(buf, tf.float32)), tf.bfloat16)
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, buf)

            reduced = fusion.fused_reduce([tensors[i] for i in floats], reduce_buffer,
                                          self.config.fusion_threshold_bytes, self.config.num_groups,
                                          wire_dtype=wire, prescale=1.0 / n if op == "mean" else None)
            for i, r in zip(floats, reduced, strict=True):
                out[i] = r
        for i, t in enumerate(tensors):
            if out[i] is not None:
                continue
            if op in ("max", "min"):
                stacked = self.all_gather(t[None], axis=0)
                out[i] = tf.reduce_max(stacked, 0) if op == "max" else tf.reduce_min(stacked, 0)
                continue
            self.collective_calls += 1
            wire_t = tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t
            r = ctx.all_reduce(tf.distribute.ReduceOp.SUM, wire_t)
            if op == "mean":
                r = r // n if t.dtype.is_integer else r / tf.cast(n, r.dtype)
            out[i] = tf.cast(r, t.dtype)
        for r in out:
            self._marks.add(r)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def all_gather(self, x: tf.Tensor, axis: int) -> tf.Tensor:
        self.collective_calls += 1
        if x.shape.rank == 0:
            raise CollectiveError("all_gather needs a tensor of rank >= 1; got a scalar. Fix: x[None].")
        if x.dtype == tf.bfloat16:
            return tf.bitcast(self._ctx().all_gather(tf.bitcast(x, tf.int16), axis=axis), tf.bfloat16)
        return self._ctx().all_gather(x, axis=axis)

    def broadcast(self, x: tf.Tensor, root: int) -> tf.Tensor:
        if not 0 <= root < self.num_replicas:
            raise CollectiveError(f"broadcast root={root} is not a replica id in [0, {self.num_replicas}).")
        # Gather everyone's copy and keep the root's: exact for every dtype.
        return self.all_gather(x[None], axis=0)[root]

    def replica_id(self) -> tf.Tensor:
        return tf.cast(self._ctx().replica_id_in_sync_group, tf.int32)
