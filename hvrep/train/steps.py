"""The compiled steps of ``hvrep train`` (Orbit's runner): one training step and exact global evaluation.

The controller (``controller.py``) decides when each runs; this module only
says what a step is. The step is written for one replica and run on every
replica by ``Replicator.run``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import hvrep
from hvrep.data import DataConfig, data_errors, make_dataset


class Runner:
    """A model's training step (forward, backward, all-reduce, update) and its evaluation.

    Args:
      repl: the Replicator that runs the steps.
      model, optimizer: built inside ``repl.scope()``; the optimizer is a
        ``keras.optimizers.LossScaleOptimizer`` when ``fp16``.
      num_classes: logits per example; labels are class ids, -1 for padding rows.
      label_smoothing: of the categorical cross-entropy.
      fp16: scale the loss (the optimizer is a LossScaleOptimizer).
      jit_compile: XLA-compile the forward and backward pass (never the collectives).

    With ``CommConfig.accumulation_steps`` k > 1 (horovod backend) the update
    goes through ``repl.wrap_optimizer``: k micro-batches per update, built
    here so that a checkpoint restored afterwards finds the accumulators; with
    ``comm.compression=powersgd`` too (the wrapper owns PowerSGD's state).
    With ``CommConfig.local_steps`` H (local SGD) it goes through
    ``repl.wrap_optimizer(optimizer, model=model)`` too: each replica steps on
    its own gradients and the models are averaged every H steps.
    """

    def __init__(self, repl: hvrep.Replicator, model: keras.Model, optimizer: Any, *, num_classes: int,
                 label_smoothing: float, fp16: bool, jit_compile: bool) -> None:
        self.repl = repl
        self.model = model
        self.optimizer = optimizer
        self._applier = None
        # PowerSGD's state is keyed by the variables: the wrapper owns it (checkpointed: ``powersgd``).
        if (repl.config.accumulation_steps > 1 or repl.config.compression == "powersgd"
                or repl.config.local_steps is not None):
            self._applier = repl.wrap_optimizer(optimizer, model=model)
            with repl.scope():
                self._applier.build(model.trainable_variables)
        self.num_classes = num_classes
        self._evaluator = Evaluator(repl, model, num_classes,
                                    local_sgd=self._applier.local_sgd if self._applier is not None else None)
        # Loss and correct predictions summed on the device over the steps of a loop: the controller reads and
        # reduces them once per loop, not once per step (each replica adds its own; reading sums the replicas).
        with repl.scope():
            self._totals = tf.Variable(tf.zeros([2], tf.float64), trainable=False, name="hvrep_loop_totals",
                                       synchronization=tf.VariableSynchronization.ON_READ,
                                       aggregation=tf.VariableAggregation.SUM)
        self._loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=label_smoothing)
        self._fp16 = fp16
        # XLA compiles the compute; Horovod's collectives stay outside it (no XLA CPU kernels).
        self._compute = tf.function(self._forward_backward, jit_compile=True) if jit_compile \
            else self._forward_backward

    def _forward_backward(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]:
        with tf.GradientTape() as tape:
            logits = tf.cast(self.model(x, training=True), tf.float32)
            loss = self._loss_fn(tf.one_hot(y, self.num_classes), logits)
            scaled = self.optimizer.scale_loss(loss) if self._fp16 else loss
        grads = tape.gradient(scaled, self.model.trainable_variables)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.int32))
        return loss, grads, correct

    @property
    def update_optimizer(self) -> Any:
        """What applies the updates: ``repl.wrap_optimizer``'s wrapper (accumulation, PowerSGD, local SGD), or the
        optimizer itself. Its variables and carried state are what a step hands to the next (the elastic state
        tracks them)."""
        return self._applier if self._applier is not None else self.optimizer

    @property
    def accumulation(self) -> Any:
        """The gradient-accumulation state to checkpoint (``hvrep.replica.wrap.AccumulationState``), or None."""
        return self._applier.accumulation if self._applier is not None else None

    @property
    def local_sgd(self) -> Any:
        """Local SGD's state to checkpoint (``hvrep.replica.localsgd.LocalSGDState``), or None."""
        local = self._applier.local_sgd if self._applier is not None else None
        return local.state if local is not None else None

    @property
    def powersgd(self) -> Any:
        """PowerSGD's state to checkpoint (``hvrep.replica.powersgd.PowerSGDState``), or None."""
        return self._applier.powersgd if self._applier is not None else None

    def local_sgd_record(self) -> dict[str, Any] | None:
        """What a checkpoint's metadata says about local SGD (resume restores its state only from the same)."""
        c = self.repl.config
        if c.local_steps is None:
            return None
        return {"local_steps": c.local_steps, "outer_optimizer": c.outer_optimizer,
                **({"outer_lr": c.outer_lr, "outer_momentum": c.outer_momentum} if c.outer_optimizer else {})}

    def accumulation_record(self) -> dict[str, int]:
        """What a checkpoint's metadata says about accumulation: ``{"steps": k, "micro_step": m}``."""
        state = self.accumulation
        return {"steps": self.repl.config.accumulation_steps,
                "micro_step": int(state.micro_step.numpy()) if state is not None else 0}

    def prepare_checkpoint(self) -> None:
        """Call on every rank before saving: pending accumulated gradients (and PowerSGD's error feedback) become
        their mean over the replicas.

        Each replica's accumulators hold its own gradients, and the chief saves
        only its copy; their mean is what the next update all-reduces, the same
        on every rank and at any world size. The run that saves continues from
        the mean too, so it and a run resumed from the checkpoint stay identical.
        """
        record = self.accumulation_record()
        if self._applier is not None and record["micro_step"] % record["steps"]:
            self.repl.run(self._applier.average_accumulators)
        if self.powersgd is not None:
            # Each replica's error feedback is its own; the chief saves its copy. Their mean is what the next
            # reductions depend on, so every replica takes it: the run that saves and one resumed continue alike.
            self.repl.run(self.powersgd.average_errors)
        local = self._applier.local_sgd if self._applier is not None else None
        if local is not None:
            # A checkpoint holds one copy, the chief's: the replicas' models (if they diverged since the last
            # synchronisation) and their optimizer states (momentum: per replica) become their means first.
            self.repl.run(self._average_mid_round if local.mid_round else self._average_optimizer_state)

    def _average_mid_round(self) -> None:
        self._applier.average_local_state(model=True)

    def _average_optimizer_state(self) -> None:
        self._applier.average_local_state(model=False)

    def _train_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        loss, grads, correct = self._compute(x, y)
        self._totals.assign_add(tf.stack([tf.cast(loss, tf.float64), tf.cast(correct, tf.float64)]))
        if self._applier is not None:
            self._applier.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
            return loss, correct
        grads = hvrep.all_reduce(grads, "mean", compress=True)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss, correct

    def train(self, x: Any, y: Any) -> tuple[Any, Any]:
        """One step on every replica; returns per-replica (loss, correct predictions), also added to the totals.

        The controller does not read the outputs (reading would wait for the step): it reads :meth:`totals`
        once per loop.
        """
        return self.repl.run(self._train_step, args=(x, y))

    def totals(self) -> tf.Tensor:
        """This process's [sum of per-replica losses, correct predictions] since :meth:`reset_totals` (in-graph:
        over all replicas already); reduce with "sum" across processes."""
        return tf.convert_to_tensor(self._totals)

    def reset_totals(self) -> None:
        self._totals.assign(tf.zeros([2], tf.float64))

    def evaluate(self, data: DataConfig, val_images: int, per_replica_batch: int, threads: int | None = None
                 ) -> tuple[float, float]:
        """:meth:`Evaluator.evaluate` of this Runner's model."""
        return self._evaluator.evaluate(data, val_images, per_replica_batch, threads)


class Evaluator:
    """A model's top-1 and top-5 accuracy over a validation split, every image counted once over the replicas.

    The custom loop's :class:`Runner` evaluates through one; the fit loop, whose updates Keras applies, uses one
    of its own (a Runner would wrap the optimizer again: a second PowerSGD state or accumulators, unused).

    Args:
      local_sgd: local SGD's ``hvrep.replica.localsgd.LocalSGD`` (``CommConfig.local_steps``), or None. Between
        two synchronisations the replicas' models differ; the evaluation is then of their mean, in place, with
        each replica's own model put back after it (training goes on as if nothing had been evaluated).
    """

    def __init__(self, repl: hvrep.Replicator, model: keras.Model, num_classes: int, local_sgd: Any = None) -> None:
        self.repl = repl
        self.model = model
        self.num_classes = num_classes
        self.local_sgd = local_sgd

    def _eval_step(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        logits = tf.cast(self.model(x, training=False), tf.float32)
        valid = y >= 0  # padding rows: every image counts exactly once over the replicas
        top1 = tf.logical_and(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), valid)
        top5 = tf.logical_and(tf.reduce_any(tf.equal(tf.math.top_k(logits, min(5, self.num_classes)).indices,
                                                     y[:, None]), -1), valid)
        return tf.stack([tf.reduce_sum(tf.cast(top1, tf.int64)), tf.reduce_sum(tf.cast(top5, tf.int64))])

    def evaluate(self, data: DataConfig, val_images: int, per_replica_batch: int, threads: int | None = None
                 ) -> tuple[float, float]:
        """Top-1 and top-5 accuracy over the whole validation split, every image counted once (``threads``:
        the input pipeline's, as ``make_dataset``'s); with local SGD mid-round, of the replicas' mean model."""
        if self.local_sgd is not None:
            with self.local_sgd.averaged_model(self.repl.run):
                return self._evaluate(data, val_images, per_replica_batch, threads)
        return self._evaluate(data, val_images, per_replica_batch, threads)

    def _evaluate(self, data: DataConfig, val_images: int, per_replica_batch: int, threads: int | None
                  ) -> tuple[float, float]:
        totals = [0, 0]
        with data_errors(data, "val"):
            for x, y in self.repl.distribute_dataset(
                    lambda ctx: make_dataset(data, "val", ctx, per_replica_batch_size=per_replica_batch,
                                             threads=threads)):
                counts = self.repl.reduce(self.repl.run(self._eval_step, args=(x, y)), "sum")
                totals[0] += int(counts[0])
                totals[1] += int(counts[1])
        return totals[0] / val_images, totals[1] / val_images
