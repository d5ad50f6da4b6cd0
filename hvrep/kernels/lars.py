"""The fused multi-tensor LARS step and its pure-TF reference.

:func:`fused_lars_apply` runs one LARS step (``hvrep.optimizers.LARS``) for a
whole list of variables and their momentum slots in one op instead of about
ten per variable; :func:`reference_lars_apply` is the same update one variable
at a time, and :func:`lars_update` the per-variable math both share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.kernels.loader import choose

LARS_DTYPES = (tf.float32, tf.float64)
_DECAY, _ADAPT = 1, 2  # the op's per-variable flags (kernels/include/hvrep_kernels.h)

def lars_update(w: tf.Tensor, v: tf.Tensor, g: tf.Tensor, lr: tf.Tensor, *, momentum: float, weight_decay: float,
                eta: float, epsilon: float, nesterov: bool, adapt: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """One variable's LARS step in plain TF: returns (new momentum slot, amount to subtract from w).

    The definition the fused kernel is tested against and the per-variable path
    of ``hvrep.optimizers.LARS``. ``weight_decay`` is 0 for a variable excluded from
    decay; arguments are Python floats so a float64 variable computes in float64.
    """
    g_total = g + weight_decay * w if weight_decay else g
    if adapt:
        w_norm = tf.sqrt(tf.reduce_sum(tf.square(w)))
        g_norm = tf.sqrt(tf.reduce_sum(tf.square(g)))
        ok = tf.logical_and(w_norm > 0, g_norm > 0)
        denom = g_norm + weight_decay * w_norm + epsilon
        ratio = tf.where(ok, eta * w_norm / tf.where(ok, denom, tf.ones_like(denom)), tf.ones_like(denom))
        scaled = lr * ratio * g_total
    else:
        scaled = lr * g_total
    new_v = momentum * v + scaled
    return new_v, (momentum * new_v + scaled if nesterov else new_v)


def _as_tf_variable(v: Any) -> tf.Variable:
    if isinstance(v, tf.Variable):
        return v
    # A Keras 3 variable holds its tf.Variable in `.value` (TF backend).
    inner = getattr(v, "value", None)
    if not isinstance(inner, tf.Variable):
        raise ConfigError(f"expected a tf.Variable or keras.Variable, got a {type(v).__name__} ({_name(v)!r}); "
                          "the fused LARS updates variables in place.")
    return inner


def _name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def _check_lars_args(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                     decay: Sequence[bool], adapt: Sequence[bool]) -> None:
    lengths = {"variables": len(variables), "momentums": len(momentums), "gradients": len(gradients),
               "decay": len(decay), "adapt": len(adapt)}
    if len(set(lengths.values())) != 1:
        raise ConfigError(f"fused_lars_apply: the lists must have one entry per variable; got lengths {lengths}.")
    for i, (w, v, g) in enumerate(zip(variables, momentums, gradients, strict=True)):
        if g is None:
            raise ConfigError(f"fused_lars_apply: gradient {i} (of variable {_name(w)!r}) is None; "
                              "drop variables without gradients before the call.")
        ws, vs, gs = tf.TensorShape(w.shape), tf.TensorShape(v.shape), tf.TensorShape(g.shape)
        if not (ws.is_compatible_with(gs) and ws.is_compatible_with(vs)):
            raise ConfigError(f"fused_lars_apply: variable {i} ({_name(w)!r}) has shape {ws}, its momentum slot "
                              f"{vs} and its gradient {gs}; they must be equal.")
        if not tf.as_dtype(w.dtype).is_floating:
            raise ConfigError(f"fused_lars_apply: variable {i} ({_name(w)!r}) is {tf.as_dtype(w.dtype).name}; "
                              "LARS updates floating-point variables only.")


def reference_lars_apply(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                         learning_rate: Any, *, momentum: float, weight_decay: float, eta: float,
                         epsilon: float = 0.0, nesterov: bool = False, decay: Sequence[bool],
                         adapt: Sequence[bool]) -> None:
    """:func:`fused_lars_apply` in plain TF: one variable at a time (the per-variable path)."""
    _check_lars_args(variables, momentums, gradients, decay, adapt)
    _reference_lars(variables, momentums, gradients, learning_rate, momentum=momentum, weight_decay=weight_decay,
                    eta=eta, epsilon=epsilon, nesterov=nesterov, decay=decay, adapt=adapt)


def _reference_lars(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                    learning_rate: Any, *, momentum: float, weight_decay: float, eta: float, epsilon: float,
                    nesterov: bool, decay: Sequence[bool], adapt: Sequence[bool]) -> None:
    """:func:`reference_lars_apply` on arguments already checked."""
    for w, v, grad, d, a in zip(variables, momentums, gradients, decay, adapt, strict=True):
        tw, tv = _as_tf_variable(w), _as_tf_variable(v)
        g = tf.cast(tf.convert_to_tensor(grad), tw.dtype)
        lr = tf.cast(learning_rate, tw.dtype)
        new_v, delta = lars_update(tf.convert_to_tensor(tw), tf.convert_to_tensor(tv), g, lr, momentum=momentum,
                                   weight_decay=weight_decay if d else 0.0, eta=eta, epsilon=epsilon,
                                   nesterov=nesterov, adapt=bool(a))
        tv.assign(new_v)
        tw.assign_sub(delta)


def fused_lars_apply(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                     learning_rate: Any, *, momentum: float, weight_decay: float, eta: float,
                     epsilon: float = 0.0, nesterov: bool = False, decay: Sequence[bool], adapt: Sequence[bool],
                     use_kernel: bool | None = None) -> None:
    """One LARS step for every variable, updating variables and momentum slots in place.

    The update (You et al. 2017; see ``hvrep.optimizers``) of each variable w
    with momentum slot v and gradient g:
    ``g' = g + wd*w``; ``ratio = eta*|w| / (|g| + wd*|w| + epsilon)`` (1 where
    not adapted or a norm is 0); ``v = momentum*v + lr*ratio*g'``; ``w -= v``
    (Nesterov: ``w -= momentum*v + lr*ratio*g'``); ``wd`` is 0 where not decayed.

    Args:
      variables: ``tf.Variable`` or ``keras.Variable``.
      momentums: the momentum slots, one per variable, of its shape.
      gradients: tensors of the variables' shapes (cast to the variable's dtype, as Keras does).
      learning_rate: a scalar (float, tensor or variable).
      momentum: the momentum coefficient.
      weight_decay: the coupled L2 coefficient (where ``decay``).
      eta: the trust coefficient.
      epsilon: added to the trust ratio's denominator.
      nesterov: Nesterov momentum.
      decay: per variable, whether it gets weight decay.
      adapt: per variable, whether it gets layer adaptation (the trust ratio).
      use_kernel: None: the fused op where it can run (float32/float64
        variables, loaded for their device, not under XLA), the reference
        elsewhere; True: the fused op or KernelError; False: the reference.
    """
    _check_lars_args(variables, momentums, gradients, decay, adapt)
    hyper = dict(momentum=momentum, weight_decay=weight_decay, eta=eta, epsilon=epsilon, nesterov=nesterov)
    # One op call per dtype; other dtypes (e.g. float16 variables) take the reference.
    groups: dict[tf.DType, list[int]] = {}
    for i, w in enumerate(variables):
        groups.setdefault(tf.as_dtype(w.dtype), []).append(i)
    for dtype, idx in groups.items():
        problem = None if dtype in LARS_DTYPES else f"the fused LARS takes float32/float64 variables, not {dtype.name}"
        tf_vars = [_as_tf_variable(variables[i]) for i in idx]
        module = choose(use_kernel, "fused_lars_apply", [v.device for v in tf_vars], problem)
        pick = [variables[i] for i in idx], [momentums[i] for i in idx], [gradients[i] for i in idx]
        flags = [(_DECAY if decay[i] else 0) | (_ADAPT if adapt[i] else 0) for i in idx]
        if module is None:
            _reference_lars(*pick, learning_rate, **hyper, decay=[decay[i] for i in idx],
                            adapt=[adapt[i] for i in idx])
            continue
        grads = [tf.cast(tf.convert_to_tensor(g), dtype) for g in pick[2]]
        module.hvrep_fused_lars_apply(
            var=[v.handle for v in tf_vars], mom=[_as_tf_variable(m).handle for m in pick[1]], grad=grads,
            lr=tf.cast(learning_rate, dtype),
            hyper=tf.constant([momentum, weight_decay, eta, epsilon], tf.float64), nesterov=bool(nesterov),
            flags=flags)
