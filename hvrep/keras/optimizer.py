"""``hvrep.keras.DistributedOptimizer``: a Keras 3 optimizer that averages gradients across replicas first.

What it does inside Keras' own compiled train step (``model.fit``), where
hvrep's ``run`` is not on the stack: it calls the Replicator's fused
all-reduce (same ``CommConfig``) on the gradients, then the wrapped
optimizer's update. Per backend:

- horovod: ``fit`` runs with no tf.distribute strategy, the loss is this
  rank's batch mean, and the wrapper takes the mean over the ranks.
- local (in-graph): ``fit`` of a model built inside ``repl.scope()`` runs under
  hvrep's MirroredStrategy, where Keras divides the loss by N before the
  backward pass and its optimizer would sum the gradients. The wrapper sums
  (sum of grad/N is the mean), and the strategy recognises the result as
  reduced (``hvrep.replica.backends._ingraph``), so Keras' own sum is skipped:
  one reduction, the same 1 x NB update.

Mixed precision: the finite-gradient check of a ``LossScaleOptimizer`` must
see the reduced gradients, or ranks that disagree take different branches
and one waits in a collective the other never issues. So the loss scaler
goes inside: ``DistributedOptimizer(LossScaleOptimizer(opt))``, and under a
``mixed_float16`` global policy ``DistributedOptimizer(opt)`` puts it there
itself. Either way the result is a ``LossScaleOptimizer`` instance, so
``compile`` does not wrap it again. The other order,
``LossScaleOptimizer(DistributedOptimizer(opt))`` (also what ``compile`` makes
when only the model, not the global policy, is mixed_float16), is refused
when it is built, with the fix.

That refusal rests on Keras internals (``LossScaleOptimizer``'s constructor
setting its inner optimizer's ``loss_scale_factor`` to None, and Keras skipping
the assignment of a value an attribute already holds), verified on the Keras
releases of ``hvrep.compat.keras_versions``. On another Keras the wrapper
warns once, and where it can see the sign missing (a ``LossScaleOptimizer``
that did not set it) it says so too: the wrong order may then go unrefused.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from hvrep.compat import keras_versions
from hvrep.errors import ConfigError
from hvrep.replica import api
from hvrep.replica.powersgd import PowerSGDState
from hvrep.replica.wrap import apply_locally, loss_scale

# Methods of the wrapper call the base class by name: in the loss-scaling variant the next class in the
# MRO is LossScaleOptimizer, whose build/__init__ would scale a second time.
_Optimizer = keras.optimizers.Optimizer


def _mixed_float16() -> bool:
    return keras.config.dtype_policy().name == "mixed_float16"


def _check_loss_scale_reliance(optimizer: Any) -> None:
    """Warns once when the refusal of ``LossScaleOptimizer(DistributedOptimizer(opt))`` may not hold here: a Keras
    outside the verified releases, or a ``LossScaleOptimizer`` seen not to mark its inner optimizer."""
    reason = keras_versions.unverified()
    if reason is None and isinstance(optimizer, LossScaleOptimizer) and optimizer.inner_optimizer.loss_scale_factor \
            is not None:
        reason = ("this Keras' LossScaleOptimizer no longer sets its inner optimizer's loss_scale_factor to None "
                  f"(it holds {optimizer.inner_optimizer.loss_scale_factor!r})")
    if reason is not None:
        keras_versions.warn_once(
            "DistributedOptimizer loss scaling",
            f"hvrep: {reason}: hvrep.keras.DistributedOptimizer recognises the wrong wrapping order, "
            "LossScaleOptimizer(DistributedOptimizer(opt)), by a Keras internal (LossScaleOptimizer setting the "
            "wrapped optimizer's loss_scale_factor to None) and may not refuse it here; in that order each "
            "replica's finite-gradient check sees its own gradients and Horovod can hang. Fix: put the loss "
            "scaler inside, DistributedOptimizer(LossScaleOptimizer(opt), repl) (or set the mixed_float16 global "
            "policy before creating it), or install a verified Keras (requirements.txt pins it).")


class _InnerApply:
    """The wrapped optimizer as ``apply_locally`` calls it: its ``apply`` (what ``fit`` calls), not
    ``apply_gradients``."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def apply_gradients(self, grads_and_vars: Any) -> None:
        grads, variables = zip(*grads_and_vars, strict=True)
        self._optimizer.apply(list(grads), list(variables))


@keras.saving.register_keras_serializable(package="hvrep")
class DistributedOptimizer(_Optimizer):
    """Wraps a Keras optimizer so ``apply_gradients`` averages the gradients over the replicas first.

    ``model.compile(optimizer=hvrep.keras.DistributedOptimizer(opt, repl))``.
    Everything ``fit`` calls (``build``, ``scale_loss``, ``apply_gradients``,
    ``finalize_variable_values``, ``variables``, ``learning_rate``,
    ``iterations``) is the wrapped optimizer's; ``inner_optimizer`` is it.

    Args:
      optimizer: a ``keras.optimizers.Optimizer`` (clipping, ``hvrep.optimizers.LARS``, a
        ``LossScaleOptimizer`` ...). Under a ``mixed_float16`` global policy one that is not a
        ``LossScaleOptimizer`` is wrapped in one (see the module docstring).
      replicator: the ``hvrep.Replicator`` whose collectives reduce the gradients.
      name: defaults to ``distributed_<inner name>``.
      model: the built model, required with ``CommConfig.local_steps`` (local SGD): each replica
        applies its own gradients to its own copy and every H-th update the copies, batch-norm
        statistics included, are averaged (docs/local-sgd.md). Ignored otherwise.

    Raises:
      hvrep.errors.ConfigError: ``optimizer`` is not a Keras optimizer, is already distributed, or
        ``replicator`` is not a Replicator; local SGD without a built ``model``; a combination the support
        table refuses (``hvrep.replica.support``: e.g. ``accumulation_steps`` > 1, which fit would ignore).
    """

    def __new__(cls, optimizer: Any = None, replicator: Any = None, name: str | None = None, **kwargs: Any) -> Any:
        if cls is DistributedOptimizer and (isinstance(optimizer, LossScaleOptimizer) or _mixed_float16()):
            return super().__new__(DistributedLossScaleOptimizer)
        return super().__new__(cls)

    def __init__(self, optimizer: Any, replicator: Any, name: str | None = None, *, model: Any = None) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(f"optimizer {optimizer.name!r} is already an hvrep.keras.DistributedOptimizer; "
                              "wrapping it twice would reduce the gradients twice. Fix: pass the inner optimizer.")
        if not isinstance(optimizer, _Optimizer):
            raise ConfigError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}. "
                              "Fix: e.g. DistributedOptimizer(keras.optimizers.SGD(0.1), repl).")
        if not isinstance(replicator, api.Replicator):
            raise ConfigError(f"replicator must be an hvrep.Replicator, got {type(replicator).__name__}. "
                              "Fix: DistributedOptimizer(optimizer, hvrep.Replicator()).")
        if isinstance(self, LossScaleOptimizer) and not isinstance(optimizer, LossScaleOptimizer):
            optimizer = LossScaleOptimizer(optimizer)
        _check_loss_scale_reliance(optimizer)
        replicator.check_optimizer(optimizer, "fit", "hvrep.keras.DistributedOptimizer")
        _Optimizer.__init__(self, learning_rate=0.0, name=name or f"distributed_{optimizer.name}")
        self.inner_optimizer = optimizer
        self._replicator = replicator
        self._powersgd: PowerSGDState | None = None
        self._local_sgd = replicator.local_sgd(model, "DistributedOptimizer(opt, repl, model=model)")
        self._hvrep_ready = True

    @property
    def replicator(self) -> Any:
        """The Replicator whose collectives reduce the gradients."""
        return self._replicator

    @property
    def local_sgd(self) -> Any:
        """Local SGD's ``hvrep.replica.localsgd.LocalSGD`` (its ``state`` is what to checkpoint), or None."""
        return self._local_sgd

    # LossScaleOptimizer's constructor sets its inner optimizer's loss_scale_factor to None: the one sign that
    # this optimizer is being wrapped in the order whose finite check sees unreduced gradients. The getter never
    # answers None once built (1.0: this wrapper scales nothing itself; scale_loss and apply are the inner's),
    # because Keras skips an assignment of the value an attribute already holds.
    @property
    def loss_scale_factor(self) -> Any:
        if getattr(self, "_hvrep_ready", False):
            inner = self.inner_optimizer.loss_scale_factor
            return 1.0 if inner is None else inner
        return getattr(self, "_hvrep_loss_scale_factor", None)

    @loss_scale_factor.setter
    def loss_scale_factor(self, value: Any) -> None:
        if getattr(self, "_hvrep_ready", False):
            raise ConfigError(
                f"{self.name!r} was wrapped in a LossScaleOptimizer: its finite-gradient check would see each "
                "replica's own gradients, replicas that disagree would take different branches and Horovod would "
                "hang. Fix: put the loss scaler inside, DistributedOptimizer(LossScaleOptimizer(opt), repl), or set "
                "keras.mixed_precision.set_global_policy('mixed_float16') before creating the DistributedOptimizer "
                "(it then adds the LossScaleOptimizer inside itself and compile() does not wrap it again)."
            )
        self._hvrep_loss_scale_factor = value

    @property
    def powersgd(self) -> PowerSGDState | None:
        """The PowerSGD state (``CommConfig(compression="powersgd")``), built with the optimizer; else None.

        Not part of the optimizer's checkpoint (see ``_trackable_children``): save it as
        ``tf.train.Checkpoint(powersgd=opt.powersgd)``, or let it start afresh on a restart."""
        return self._powersgd

    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        _Optimizer.build(self, var_list)
        repl = self._replicator
        if repl.config.compression == "powersgd" and self._powersgd is None:
            self._powersgd = PowerSGDState(list(var_list), repl.config, repl.num_replicas)

    @property
    def variables(self) -> list[Any]:
        return self._variables + self.inner_optimizer.variables

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        # A checkpoint holds the wrapped optimizer only. The wrapper's own step and learning-rate variables are
        # placeholders (everything reads the inner ones), and a model compiled with the wrapper tracks it as
        # `model.optimizer`: with them, such a model could not restore a checkpoint written without the wrapper
        # (hvrep train's custom loop, whose checkpoints its fit loop resumes).
        # PowerSGD's state (``powersgd``) is left out for the same reason: checkpoint it on its own.
        children = super()._trackable_children(save_type, **kwargs)
        return {"inner_optimizer": children["inner_optimizer"]} if "inner_optimizer" in children else children

    def _reduce(self, grads: list[Any]) -> list[Any]:
        """The gradients averaged over the replicas (see the module docstring for the in-graph sum)."""
        repl = self._replicator
        n = repl.num_replicas
        if n == 1:
            return list(grads)
        # Keras divides the loss by the strategy's replica count before the backward pass (1 with no strategy).
        divided_by = tf.distribute.get_strategy().num_replicas_in_sync
        if self._local_sgd is not None:  # this replica's own mean gradient: undo Keras' division by N
            return [g if g is None or divided_by == 1 else g * tf.cast(divided_by, g.dtype) for g in grads]
        if divided_by == n:
            op = "sum"
        elif divided_by == 1 and (repl.num_processes == n or tf.distribute.has_strategy()):
            op = "mean"  # horovod, or inside an in-graph `repl.run` (one replica's step: its own batch mean)
        else:
            raise ConfigError(
                f"the {repl.backend!r} backend has {n} replicas, but this train step runs under a tf.distribute "
                f"strategy of {divided_by} replica(s): the model was built outside `repl.scope()`, so Keras does "
                "not run it on the Replicator's devices. Fix: create and compile the model inside "
                "`with repl.scope():`."
            )
        return list(repl.all_reduce(list(grads), op, compress=True, powersgd=self._powersgd,
                                    loss_scale=loss_scale(self.inner_optimizer)))

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Reduces ``grads`` across the replicas (the Replicator's fused all-reduce), then lets the wrapped
        optimizer apply them. Keras' ``fit`` calls it; builds the optimizer on first use."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables or self.inner_optimizer._trainable_variables)
            self.built = True
        if self._local_sgd is not None:
            variables = list(trainable_variables or self.inner_optimizer._trainable_variables)
            apply_locally(_InnerApply(self.inner_optimizer), self._local_sgd, self._reduce(list(grads)), variables)
            return
        self.inner_optimizer.apply(self._reduce(list(grads)), trainable_variables)

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """``apply`` for ``(gradient, variable)`` pairs; returns the optimizer's step counter."""
        grads, trainable_variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, trainable_variables)
        return self.iterations

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        # Only Keras' JAX trainer calls this; hvrep's collectives are TensorFlow ops.
        raise NotImplementedError("hvrep.keras.DistributedOptimizer runs on Keras' TensorFlow backend, which applies "
                                  "gradients statefully; stateless_apply is the JAX backend's. Fix: "
                                  "KERAS_BACKEND=tensorflow.")

    def scale_loss(self, loss: Any) -> Any:
        """The wrapped optimizer's loss scaling (a ``LossScaleOptimizer`` inside scales; others return ``loss``)."""
        return self.inner_optimizer.scale_loss(loss)

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        if getattr(self, "_hvrep_ready", False):
            self.inner_optimizer.learning_rate = learning_rate
        else:  # the base constructor's placeholder
            _Optimizer.learning_rate.fset(self, learning_rate)

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict[str, Any]:
        """The wrapped optimizer's config; the Replicator is left out (``from_config`` binds the live one)."""
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> DistributedOptimizer:
        """Rebuilds the wrapper around the restored inner optimizer, bound to the Replicator created last."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return DistributedOptimizer(inner, api.latest(), **config)


@keras.saving.register_keras_serializable(package="hvrep")
class DistributedLossScaleOptimizer(DistributedOptimizer, LossScaleOptimizer):
    """The :class:`DistributedOptimizer` of a loss-scaling optimizer (what ``DistributedOptimizer(...)`` returns
    then): a ``LossScaleOptimizer`` instance, so ``compile`` under ``mixed_float16`` does not wrap it again.

    Every method is :class:`DistributedOptimizer`'s: the scaling, the finite check and the skip are the inner
    ``LossScaleOptimizer``'s, on reduced gradients.
    """

    @property
    def dynamic_scale(self) -> Any:
        """The inner LossScaleOptimizer's current loss scale."""
        return self.inner_optimizer.dynamic_scale

    def check_finite(self, grads: Any) -> Any:
        """The wrapped ``LossScaleOptimizer``'s check, on gradients already reduced, so every rank agrees."""
        return self.inner_optimizer.check_finite(grads)
