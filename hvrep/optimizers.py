"""Large-batch optimizers. ``LARS``: layer-wise adaptive rate scaling (You, Gitman, Ginsburg 2017).

For each variable ``w`` with gradient ``g``, learning rate ``lr``, momentum
``m``, coupled weight decay ``wd``, trust coefficient ``eta``:

    g'    = g + wd * w                                   (wd = 0 for excluded variables)
    ratio = eta * ||w|| / (||g|| + wd * ||w|| + epsilon)  (1 when ||w|| or ||g|| is 0,
                                                            or the variable is excluded)
    v     = m * v + lr * ratio * g'
    w     = w - v                                        (classic)
    w     = w - (m * v + lr * ratio * g')                (Nesterov)

This is Algorithm 1 of the paper with the momentum form of the MLPerf
ResNet-50 reference. Weight decay is coupled (in the gradient and in the
trust ratio), never Keras' decoupled ``weight_decay``.

By default one step updates every variable with one fused op
(``hvrep.kernels.fused_lars_apply``, C++/CUDA) where it is built and can
run, and per variable in plain TF elsewhere; both compute the same update.
``use_fused_kernel=False`` always takes the per-variable path.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from hvrep import kernels
from hvrep.errors import ConfigError, KernelError

__all__ = ["DEFAULT_EXCLUDE", "LARS", "MomentumSGD"]

DEFAULT_EXCLUDE = ("batch_normalization", "batch_norm", "batchnorm", r"(^|[/_])bn", r"bias$")
"""Regular expressions, searched in ``variable.path``, of the variables that get neither weight decay nor
layer adaptation by default: batch-norm parameters and biases, as the MLPerf reference excludes them."""


def _positive(name: str, value: Any) -> None:
    if isinstance(value, int | float) and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}.")


@keras.saving.register_keras_serializable(package="hvrep")
class LARS(keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling, a Keras 3 optimizer.

    Args:
      learning_rate: a float > 0 or a ``LearningRateSchedule`` (see ``hvrep.schedules``).
      momentum: in [0, 1).
      weight_decay: coupled L2 weight decay (>= 0), added to the gradient and
        used in the trust ratio.
      eta: trust coefficient (> 0); 0.001 in the paper.
      epsilon: added to the trust ratio's denominator (>= 0).
      nesterov: Nesterov momentum.
      exclude_from_weight_decay: regex patterns searched in ``variable.path``;
        matching variables get no weight decay. None: ``DEFAULT_EXCLUDE``
        (batch norm and biases); ``[]``: exclude nothing.
      exclude_from_layer_adaptation: the same, for the trust ratio (ratio 1).
        None: the weight-decay patterns.
      use_fused_kernel: None: update all variables with one fused op
        (``hvrep.kernels``) where it can run (built, float32/float64
        variables, no tf.distribute strategy, not under XLA), per variable
        elsewhere; True: the fused op or ``KernelError``; False: per variable.
      **kwargs: passed to ``keras.optimizers.Optimizer`` (``clipnorm``,
        ``global_clipnorm``, ``name`` ...). ``weight_decay`` there would be
        Keras' decoupled decay and is not accepted twice.
    """

    def __init__(
        self,
        learning_rate: Any,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        epsilon: float = 0.0,
        nesterov: bool = False,
        exclude_from_weight_decay: Sequence[str] | None = None,
        exclude_from_layer_adaptation: Sequence[str] | None = None,
        name: str = "lars",
        use_fused_kernel: bool | None = None,
        **kwargs: Any,
    ) -> None:
        _positive("learning_rate", learning_rate)
        if use_fused_kernel not in (None, True, False):
            raise ConfigError(f"use_fused_kernel must be None, True or False, got {use_fused_kernel!r}.")
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {momentum!r}.")
        if weight_decay is None or weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {weight_decay!r}.")
        _positive("eta", eta)
        if eta is None:
            raise ConfigError("eta must be > 0, got None.")
        if epsilon < 0:
            raise ConfigError(f"epsilon must be >= 0, got {epsilon!r}.")
        # Keras' own weight_decay is decoupled (applied to the weights before
        # the update); LARS couples it into the gradient and the trust ratio.
        super().__init__(learning_rate=learning_rate, weight_decay=None, name=name, **kwargs)
        self.momentum = float(momentum)
        self.coupled_weight_decay = float(weight_decay)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.nesterov = bool(nesterov)
        self.use_fused_kernel = use_fused_kernel
        self._user_patterns = {
            "exclude_from_weight_decay": exclude_from_weight_decay,
            "exclude_from_layer_adaptation": exclude_from_layer_adaptation,
        }
        self.exclude_from_weight_decay_patterns = tuple(
            DEFAULT_EXCLUDE if exclude_from_weight_decay is None else exclude_from_weight_decay)
        self.exclude_from_layer_adaptation_patterns = tuple(
            self.exclude_from_weight_decay_patterns if exclude_from_layer_adaptation is None
            else exclude_from_layer_adaptation)
        for p in (*self.exclude_from_weight_decay_patterns, *self.exclude_from_layer_adaptation_patterns):
            try:
                re.compile(p)
            except re.error as e:
                raise ConfigError(f"exclusion pattern {p!r} is not a valid regular expression: {e}.") from None
        # (gets weight decay, gets layer adaptation), by the optimizer's variable index:
        # update_step receives the backend variable, which has no Keras path.
        self._flags: list[tuple[bool, bool]] = []

    @staticmethod
    def _matches(patterns: Sequence[str], path: str) -> bool:
        return any(re.search(p, path) for p in patterns)

    def build(self, var_list: list[Any]) -> None:
        if self.built:
            return
        super().build(var_list)
        self._momentums = self.add_optimizer_variables(var_list, "momentum")
        self._flags = [
            (not self._matches(self.exclude_from_weight_decay_patterns, v.path),
             not self._matches(self.exclude_from_layer_adaptation_patterns, v.path))
            for v in var_list
        ]
        # A pattern the user wrote that matches nothing is almost always a typo.
        for arg, patterns in self._user_patterns.items():
            for p in patterns or ():
                if not any(re.search(p, v.path) for v in var_list):
                    names = ", ".join(v.path for v in var_list[:20])
                    warnings.warn(
                        f"LARS {arg} pattern {p!r} matches no variable; the variables are: {names}"
                        + (" ..." if len(var_list) > 20 else ""),
                        stacklevel=2,
                    )

    def decay_and_adapt(self, variable: Any) -> tuple[bool, bool]:
        """(gets weight decay, gets layer adaptation) for a variable this optimizer was built with."""
        return self._flags[self._get_variable_index(variable)]

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        """The per-variable path (``hvrep.kernels.lars_update``, the fused op's reference)."""
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        velocity = self._momentums[index]
        decay, adapt = self._flags[index]
        # Python floats (not ops.cast of them, which rounds through float32) so a
        # float64 variable gets float64 hyper-parameters.
        new_velocity, delta = kernels.lars_update(
            ops.convert_to_tensor(variable), ops.convert_to_tensor(velocity), ops.cast(gradient, dtype),
            ops.cast(learning_rate, dtype), momentum=self.momentum,
            weight_decay=self.coupled_weight_decay if decay else 0.0, eta=self.eta, epsilon=self.epsilon,
            nesterov=self.nesterov, adapt=adapt)
        self.assign(velocity, new_velocity)
        self.assign_sub(variable, delta)

    def _backend_update_step(self, grads: list[Any], trainable_variables: list[Any], learning_rate: Any) -> None:
        # Under a tf.distribute strategy (hvrep's local and tpu backends) Keras
        # updates each replica's copy of each variable through the strategy, one
        # variable at a time; the fused op updates plain variables (the horovod
        # backend, one process per replica) and stays out of that.
        if self.use_fused_kernel is False or tf.distribute.has_strategy():
            if self.use_fused_kernel and tf.distribute.has_strategy():
                raise KernelError(
                    f"{self.name}: use_fused_kernel=True inside a tf.distribute strategy "
                    f"({type(tf.distribute.get_strategy()).__name__}), where Keras updates each replica's "
                    "variables one by one; pass use_fused_kernel=None to let it fall back.")
            super()._backend_update_step(grads, trainable_variables, learning_rate)
            return
        flags = [self._flags[self._get_variable_index(v)] for v in trainable_variables]
        kernels.fused_lars_apply(
            trainable_variables, [self._momentums[self._get_variable_index(v)] for v in trainable_variables], grads,
            learning_rate, momentum=self.momentum, weight_decay=self.coupled_weight_decay, eta=self.eta,
            epsilon=self.epsilon, nesterov=self.nesterov, decay=[d for d, _ in flags], adapt=[a for _, a in flags],
            use_kernel=self.use_fused_kernel)

    def _apply_weight_decay(self, variables: Any) -> None:
        """No decoupled decay: LARS' decay is coupled inside ``update_step``."""

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            momentum=self.momentum,
            weight_decay=self.coupled_weight_decay,
            eta=self.eta,
            epsilon=self.epsilon,
            nesterov=self.nesterov,
            use_fused_kernel=self.use_fused_kernel,
            exclude_from_weight_decay=self._user_patterns["exclude_from_weight_decay"],
            exclude_from_layer_adaptation=self._user_patterns["exclude_from_layer_adaptation"],
        )
        return config


@keras.saving.register_keras_serializable(package="hvrep")
class MomentumSGD(LARS):
    """Momentum SGD with coupled L2 weight decay, as in Goyal et al. (2017).

        v = m * v + lr * (g + wd * w);   w = w - v          (Nesterov: w = w - (m * v + lr * (g + wd * w)))

    It is LARS with the trust ratio fixed at 1 for every variable, so both
    share one update rule, one set of exclusion patterns
    (``exclude_from_weight_decay``; default: batch norm and biases) and the
    fused op (``use_fused_kernel``, as in LARS).
    """

    def __init__(
        self,
        learning_rate: Any,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        exclude_from_weight_decay: Sequence[str] | None = None,
        name: str = "momentum_sgd",
        use_fused_kernel: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for key in ("eta", "epsilon", "exclude_from_layer_adaptation"):
            kwargs.pop(key, None)  # from a LARS-shaped config
        super().__init__(learning_rate, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                         exclude_from_weight_decay=exclude_from_weight_decay, name=name,
                         use_fused_kernel=use_fused_kernel, **kwargs)
        # No variable gets layer adaptation. Set here, not as a user pattern, so it never warns.
        self.exclude_from_layer_adaptation_patterns = ("",)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        for key in ("eta", "epsilon", "exclude_from_layer_adaptation"):
            config.pop(key, None)
        return config
