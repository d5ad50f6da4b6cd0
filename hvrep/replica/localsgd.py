"""Local SGD (Lin et al. 2018) and DiLoCo's outer step (Douillard et al. 2023): average the models every H steps.

Each replica updates its own copy of the model with its own gradients; every H-th update the copies (trainable
weights and the floating-point non-trainable state the model names: batch-norm statistics) become their mean,
or, with an outer optimizer, the round's start moved by an outer Nesterov step on the averaged change.

How the averaging crosses replicas differs by backend, because the synchronisation is conditional (every H-th
step) inside a compiled step:

- horovod: one process per replica; the step branches with ``tf.cond`` (every rank takes the same branch: they
  count the same steps) and all-reduces inside it, as gradient accumulation does.
- in-graph (local, tpu): a ``tf.distribute`` replica context cannot issue a collective inside a conditional
  (``merge_call`` refuses it), so the replicas hand over to the cross-replica context (one ``merge_call`` per
  step), where the branch reads every replica's copy of each variable directly and writes the result back to
  each. Keras' optimizer would sum the replicas' local gradients; they are handed to it marked as already
  reduced (``Backend.keep_local``), so each replica's copy takes its own update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from hvrep.replica import collectives
from hvrep.replica.comm import CommConfig


def _tf_variable(v: Any) -> Any:
    """The tf.Variable behind a Keras 3 variable (a tf.Variable's own ``.value`` is a method)."""
    return v if isinstance(v, tf.Variable) or not hasattr(v, "value") else v.value


def _local_copies(v: Any) -> list[Any]:
    """The variables holding ``v``'s values in this process: one per replica in-graph (a mirrored variable's
    components), else ``v`` itself."""
    v = _tf_variable(v)
    values = getattr(v, "values", None)  # a tf.distribute DistributedVariable
    return list(values) if isinstance(values, tuple) else [v]


def averaged_state(variables: Sequence[Any]) -> list[Any]:
    """The non-trainable variables a synchronisation averages besides the trainable ones: the floating-point
    ones (batch-norm moving means and variances); integer state (seed generators, counters) is left alone."""
    return [v for v in variables if tf.as_dtype(v.dtype).is_floating]


class LocalSGDState(tf.Module):
    """What local SGD carries between steps; a ``tf.Module``, so a ``tf.train.Checkpoint`` saves it.

    Attributes:
      step: local updates taken (int64); the models are averaged when it reaches a multiple of H.
      anchors: per trainable variable, the model at the start of the current round (outer optimizer only).
      momenta: per trainable variable, the outer Nesterov momentum buffer (outer optimizer only).
    """

    def __init__(self, trainable: Sequence[Any], outer: bool) -> None:
        super().__init__(name="hvrep_local_sgd")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_local_step")
        self.anchors = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="hvrep_outer_anchor")
                        for v in trainable] if outer else []
        self.momenta = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="hvrep_outer_momentum")
                        for v in trainable] if outer else []


def optimizer_state(optimizer: Any) -> list[Any]:
    """The optimizer state a checkpoint averages: its floating-point variables of rank >= 1 (momentum, Adam's
    moments: one per model variable); scalars (step counter, learning rate, loss scale) are left alone."""
    return [v for v in optimizer.variables if tf.as_dtype(v.dtype).is_floating and len(v.shape) >= 1]


class LocalSGD:
    """Counts a replica's local updates and, every ``config.local_steps``, synchronises the model.

    Args:
      config: the Replicator's ``CommConfig`` (``local_steps`` set).
      backend: the Replicator's backend (its ``keep_local`` marks local gradients in-graph).
      trainable: the variables the optimizer updates, in a fixed order.
      extra: non-trainable state averaged at each synchronisation (:func:`averaged_state` of the model's).

    Build it inside ``repl.scope()`` (its state is then mirrored in-graph) before the first step.
    """

    def __init__(self, config: CommConfig, backend: Any, trainable: Sequence[Any], extra: Sequence[Any]) -> None:
        assert config.local_steps is not None
        self.every = config.local_steps
        self.outer = config.outer_optimizer
        self.outer_lr = float(config.outer_lr)
        self.outer_momentum = float(config.outer_momentum)
        self.backend = backend
        self.trainable = list(trainable)
        self.extra = list(extra)
        self.state = LocalSGDState(self.trainable, outer=self.outer is not None)

    def keep_local(self, grads: list[Any]) -> list[Any]:
        """This replica's gradients, marked so that Keras' optimizer applies them to this replica's copy only."""
        return self.backend.keep_local(grads)

    def begin_update(self) -> None:
        """Before a replica's local update: at the very first step, each round's start (the anchor) is the model as
        training found it (after any broadcast or restore). No collective."""
        if not self.state.anchors:
            return

        def anchor() -> tf.Tensor:
            for a, v in zip(self.state.anchors, self.trainable, strict=True):
                a.assign(tf.convert_to_tensor(v))
            return tf.constant(True)

        tf.cond(tf.equal(self.state.step, 0), anchor, lambda: tf.constant(False))

    def end_update(self) -> tf.Tensor:
        """After a replica's local update: counts it; every H-th, synchronises. Returns whether it did."""
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            return tf.distribute.get_replica_context().merge_call(self._cross_replica)
        step = self.state.step.assign_add(1)
        return tf.cond(tf.equal(step % self.every, 0), lambda: self._sync(self._all_reduce_mean, self._assign),
                       lambda: tf.constant(False))

    def average_now(self, also: Sequence[Any] = (), model: bool = True) -> None:
        """Inside a replica step, unconditionally: the model (``model``) and ``also`` (e.g. the optimizer's
        state) become their mean over the replicas, plainly (no outer step: the round goes on from its anchor)."""
        variables = (self.trainable + self.extra if model else []) + list(also)
        if not variables:
            return
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():

            def merged(strategy: Any) -> None:
                for v in variables:
                    self._assign_parts(strategy, v, self._parts_mean(strategy, v))

            tf.distribute.get_replica_context().merge_call(merged)
            return
        for v, m in zip(variables, self._all_reduce_mean(variables), strict=True):
            v.assign(m)

    @contextlib.contextmanager
    def averaged_model(self, run: Callable[[Callable[[], None]], Any]) -> Iterator[bool]:
        """Eager, on every process alike: inside the block each replica's model is the replicas' mean (mid-round,
        when they have diverged); after it each replica's own model is put back exactly, so that what is done
        inside (an evaluation) does not change training. The mean is plain, as a checkpoint's: with DiLoCo's
        outer optimizer the next synchronisation's outer step is not anticipated.

        Args:
          run: the Replicator's ``run`` (the averaging is a collective inside a replica step).

        Yields:
          Whether the model was averaged (False at a synchronisation point: the replicas agree already).
        """
        if not self.mid_round:
            yield False
            return
        variables = self.trainable + self.extra
        kept = [[tf.identity(c) for c in _local_copies(v)] for v in variables]
        try:
            run(self._average_model)
            yield True
        finally:
            for v, values in zip(variables, kept, strict=True):
                for c, value in zip(_local_copies(v), values, strict=True):
                    c.assign(value)

    def _average_model(self) -> None:
        self.average_now(model=True)

    # --- the synchronisation, shared by both backends' ways of reading and writing the copies ---

    def _sync(self, means_of: Callable[[list[Any]], list[Any]], assign: Callable[[Any, Any], None]) -> tf.Tensor:
        variables = self.trainable + self.extra
        means = means_of(variables)
        n = len(self.trainable)
        new = self._outer_step(means[:n], assign) + list(means[n:])
        for v, x in zip(variables, new, strict=True):
            assign(v, x)
        return tf.constant(True)

    def _outer_step(self, means: list[Any], assign: Callable[[Any, Any], None]) -> list[Any]:
        """DiLoCo's outer SGD with Nesterov momentum on delta = start - mean (PyTorch's SGD(nesterov=True) update,
        which DiLoCo uses): m = mu m + delta; new = start - lr (delta + mu m). lr=1, mu=0 gives the mean."""
        if self.outer is None:
            return list(means)
        lr, mu = self.outer_lr, self.outer_momentum
        out = []
        for a, m, mean in zip(self.state.anchors, self.state.momenta, means, strict=True):
            start = tf.convert_to_tensor(a)
            delta = start - mean
            buf = mu * tf.convert_to_tensor(m) + delta
            new = start - lr * (delta + mu * buf)
            assign(m, buf)
            assign(a, new)
            out.append(new)
        return out

    # horovod: this process is one replica.
    def _all_reduce_mean(self, variables: list[Any]) -> list[Any]:
        # Uncompressed: a model rounded to fp16 would lose its small updates. The backend is made the live one
        # here: Keras' fit calls the optimizer outside `run`.
        with self.backend.replica_section():
            return collectives.all_reduce([tf.convert_to_tensor(v) for v in variables], "mean", compress=False)

    @property
    def mid_round(self) -> bool:
        """Eager, on the host: True when the replicas' models have diverged since the last synchronisation."""
        return bool(int(self.state.step.numpy()) % self.every)

    @staticmethod
    def _assign(v: Any, x: Any) -> None:
        v.assign(x)

    # in-graph: the cross-replica context reads and writes every replica's copy.
    def _cross_replica(self, strategy: Any) -> tf.Tensor:
        step = self.state.step.assign_add(1)  # cross-replica: every copy of the counter

        def sync() -> tf.Tensor:
            return self._sync(lambda vs: [self._parts_mean(strategy, v) for v in vs],
                              lambda v, x: self._assign_parts(strategy, v, x))

        return tf.cond(tf.equal(step % self.every, 0), sync, lambda: tf.constant(False))

    @staticmethod
    def _parts_mean(strategy: Any, v: Any) -> tf.Tensor:
        parts = [tf.convert_to_tensor(p) for p in strategy.experimental_local_results(_tf_variable(v))]
        with tf.device(parts[0].device):
            return tf.add_n(parts) / tf.cast(len(parts), parts[0].dtype)

    @staticmethod
    def _assign_parts(strategy: Any, v: Any, x: Any) -> None:
        for p in strategy.experimental_local_results(_tf_variable(v)):
            p.assign(x)
