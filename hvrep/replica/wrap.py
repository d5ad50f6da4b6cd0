"""TF-Replicator's ``wrap_optimizer``: an optimizer whose apply_gradients all-reduces first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from hvrep.replica import collectives
from hvrep.replica.comm import CommConfig
from hvrep.replica.powersgd import PowerSGDState


class AccumulationState(tf.Module):
    """What a :class:`CrossReplicaOptimizer` carries between updates: the summed gradients and the micro-step.

    A ``tf.Module``, so ``tf.train.Checkpoint(accumulation=state)`` saves and
    restores it (the training app checkpoints it next to the optimizer).

    Attributes:
      micro_step: micro-steps taken (int64); an update happens when it reaches a multiple of k.
      accumulators: per variable, the sum of this replica's gradients since the last update.
    """

    def __init__(self, variables: list[Any]) -> None:
        super().__init__(name="hvrep_accumulation")
        self.micro_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_micro_step")
        self.accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="hvrep_grad_accumulator")
                             for v in variables]


class CrossReplicaOptimizer:
    """Wraps a Keras optimizer: ``apply_gradients`` averages the gradients across replicas first.

    With ``accumulation_steps`` k > 1, each call adds the local gradients to an
    accumulator and only every k-th call all-reduces the mean of the k
    micro-batch gradients and updates the variables: k times fewer
    collectives, and the same update as one step on a k-times larger batch
    (when the micro-batches have equal sizes and the loss is a batch mean).
    The accumulators and the micro-step (:attr:`accumulation`) are created by
    :meth:`build` or the first call. Everything else (``learning_rate``,
    ``iterations``, ``variables``) is the wrapped optimizer's, reachable
    through ``.inner``.

    With ``CommConfig(compression="powersgd")`` the all-reduce is PowerSGD's,
    its state (:attr:`powersgd`, a ``tf.Module`` to checkpoint) built by
    :meth:`build` or the first call for the variables of that call.
    """

    def __init__(self, optimizer: Any, accumulation_steps: int = 1, config: CommConfig | None = None,
                 num_replicas: int = 1, local_sgd: Any = None) -> None:
        self.inner = optimizer
        self.accumulation_steps = accumulation_steps
        self.accumulation: AccumulationState | None = None
        self._config = config or CommConfig()
        self._num_replicas = num_replicas
        self.powersgd: PowerSGDState | None = None
        # A hvrep.replica.localsgd.LocalSGD with CommConfig.local_steps: no gradient all-reduce, the model is
        # averaged every H updates instead.
        self.local_sgd = local_sgd

    def build(self, variables: list[Any]) -> None:
        """Builds the wrapped optimizer and, with k > 1, the accumulation state, and PowerSGD's state (before
        restoring a checkpoint; under ``repl.scope()`` on an in-graph backend)."""
        if not self.inner.built:
            self.inner.build(variables)
        if self.accumulation_steps > 1 and self.accumulation is None:
            self.accumulation = AccumulationState(list(variables))
        if self._config.compression == "powersgd" and self.powersgd is None:
            self.powersgd = PowerSGDState(list(variables), self._config, self._num_replicas)

    @property
    def built(self) -> bool:
        """Whether :meth:`build` has run: the wrapped optimizer, and the accumulators and PowerSGD state that this
        configuration needs, exist."""
        return bool(self.inner.built) and (self.accumulation_steps == 1 or self.accumulation is not None) and \
            (self._config.compression != "powersgd" or self.powersgd is not None)

    def _reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        if self._config.compression == "powersgd":
            self.build(variables)
        return collectives.all_reduce(grads, "mean", compress=True, powersgd=self.powersgd,
                                      loss_scale=loss_scale(self.inner))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if self.local_sgd is not None:
            return apply_locally(self.inner, self.local_sgd, grads, variables, **kwargs)
        if self.accumulation_steps == 1:
            grads = self._reduce(grads, variables)
            return self.inner.apply_gradients(zip(grads, variables, strict=True), **kwargs)
        return self._accumulate(grads, variables, **kwargs)

    def average_accumulators(self) -> None:
        """Inside a replica step: replaces every replica's accumulators by their mean over the replicas.

        The update all-reduces the mean of the accumulators, so it is the same
        (up to float rounding) after this: the state becomes the same on every
        replica, one copy of which a checkpoint can hold, valid at any world size.
        """
        if self.accumulation is not None:
            # Exact under PowerSGD: its state belongs to the update's reduction.
            mean = collectives.all_reduce(list(self.accumulation.accumulators), "mean",
                                          compress=self._config.compression != "powersgd")
            for acc, m in zip(self.accumulation.accumulators, mean, strict=True):
                acc.assign(m)

    def average_local_state(self, model: bool = True) -> None:
        """Local SGD, inside a replica step, before a checkpoint: the model (``model``: True when the replicas
        diverged since the last synchronisation, ``local_sgd.mid_round``) and the optimizer's per-replica state
        (momentum) become their mean over the replicas, so one copy, the chief's, holds the run. The run that
        saves continues from the mean too, so it and a run resumed from the checkpoint stay identical."""
        from hvrep.replica.localsgd import optimizer_state

        if self.local_sgd is not None:
            self.local_sgd.average_now(optimizer_state(self.inner), model=model)

    def _accumulate(self, grads: list[Any], variables: list[Any], **kwargs: Any) -> Any:
        k = self.accumulation_steps
        # Created on the first (traced) call if build() was not called, like Keras' own slots; the
        # optimizer is built here too, since variables cannot be created inside tf.cond.
        self.build(variables)
        state = self.accumulation
        assert state is not None
        for acc, g in zip(state.accumulators, grads, strict=True):
            if g is not None:
                acc.assign_add(tf.cast(g, acc.dtype))
        step = state.micro_step.assign_add(1)

        def update() -> tf.Tensor:
            # Every replica reaches the same micro-step, so all take this branch together.
            mean = self._reduce([acc / k for acc in state.accumulators], variables)
            self.inner.apply_gradients(zip(mean, variables, strict=True), **kwargs)
            for acc in state.accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(tf.equal(step % k, 0), update, lambda: tf.constant(False))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def loss_scale(optimizer: Any) -> Any:
    """The factor the gradients ``optimizer`` applies carry: a ``LossScaleOptimizer``'s ``dynamic_scale`` (it
    divides by it in its ``apply``), else None. PowerSGD keeps its error feedback in unscaled units by it."""
    return optimizer.dynamic_scale if isinstance(optimizer, LossScaleOptimizer) and optimizer.built else None


def apply_locally(optimizer: Any, local_sgd: Any, grads: list[Any], variables: list[Any], **kwargs: Any) -> Any:
    """Local SGD's update, inside a replica step: ``optimizer`` applies this replica's own ``grads`` to its copy of
    ``variables``; every H-th call the models are synchronised (``hvrep.replica.localsgd``)."""
    local_sgd.begin_update()
    present = [i for i, g in enumerate(grads) if g is not None]
    kept = local_sgd.keep_local([grads[i] for i in present])
    local = list(grads)
    for i, g in zip(present, kept, strict=True):
        local[i] = g
    optimizer.apply_gradients(zip(local, variables, strict=True), **kwargs)
    return local_sgd.end_update()
