"""TF-Replicator's ``wrap_optimizer``: an optimizer whose apply_gradients all-reduces first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from hvrep.replica import collectives


class CrossReplicaOptimizer:
    """Wraps a Keras optimizer: ``apply_gradients`` averages the gradients across replicas first.

    With ``accumulation_steps`` k > 1, each call adds the local gradients to an
    accumulator and only every k-th call all-reduces the mean of the k
    micro-batch gradients and updates the variables: k times fewer
    collectives, and the same update as one step on a k-times larger batch
    (when the micro-batches have equal sizes and the loss is a batch mean).
    Everything else (``learning_rate``, ``iterations``, ``variables``) is the
    wrapped optimizer's, reachable through ``.inner``.
    """

    def __init__(self, optimizer: Any, accumulation_steps: int = 1) -> None:
        self.inner = optimizer
        self.accumulation_steps = accumulation_steps
        self._accumulators: list[tf.Variable] | None = None
        self._micro_step: tf.Variable | None = None

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self.accumulation_steps == 1:
            grads = collectives.all_reduce(grads, "mean")
            return self.inner.apply_gradients(zip(grads, variables, strict=True), **kwargs)
        return self._accumulate(grads, variables, **kwargs)

    def _accumulate(self, grads: list[Any], variables: list[Any], **kwargs: Any) -> Any:
        k = self.accumulation_steps
        if self._accumulators is None:
            # Created on the first (traced) call, like Keras' own slots; the
            # optimizer is built here too, since variables cannot be created inside tf.cond.
            self._accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                              name="hvrep_grad_accumulator") for v in variables]
            self._micro_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_micro_step")
            if not self.inner.built:
                self.inner.build(variables)
        for acc, g in zip(self._accumulators, grads, strict=True):
            if g is not None:
                acc.assign_add(tf.cast(g, acc.dtype))
        assert self._micro_step is not None
        step = self._micro_step.assign_add(1)

        def update() -> tf.Tensor:
            # Every replica reaches the same micro-step, so all take this branch together.
            mean = collectives.all_reduce([acc / k for acc in self._accumulators], "mean")
            self.inner.apply_gradients(zip(mean, variables, strict=True), **kwargs)
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(tf.equal(step % k, 0), update, lambda: tf.constant(False))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
