"""Cross-replica collectives for use inside ``Replicator.run``; they act on the live Replicator."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.replica.context import check_op, live_backend


def all_reduce(value: Any, op: str, *, compress: bool = False, powersgd: Any = None, loss_scale: Any = None) -> Any:
    """Reduces a nest of tensors across replicas; every replica gets the result.

    Args:
      value: a tensor or nested structure of tensors (``None`` leaves pass through,
        as gradients of unused variables do).
      op: "sum", "mean", "max" or "min". Integer "mean" keeps the integer dtype
        (floor division).
      compress: send floating-point sum/mean in ``CommConfig.compression``'s
        dtype (fp16/bf16). For gradients: ``wrap_optimizer``,
        ``hvrep.keras.DistributedOptimizer`` and the training app's step pass
        True; pass it for your own ``all_reduce(grads, "mean")``. False
        (default): every value travels in its own dtype, whatever the config:
        statistics, counts and metrics must not be rounded to fp16, whose
        largest value is 65,504 (a batch norm's count of 64x32x32 = 65,536
        positions would become inf). With ``compression="powersgd"``,
        ``compress=True`` needs ``powersgd``.
      powersgd: with ``CommConfig(compression="powersgd")`` and ``compress``:
        the ``hvrep.replica.powersgd.PowerSGDState`` built for the variables
        whose gradients ``value`` holds (a flat list in their order; op "sum"
        or "mean"); it holds each replica's error feedback and Q's.
        ``wrap_optimizer`` and ``hvrep.keras.DistributedOptimizer`` build and
        pass their own. Ignored otherwise.
      loss_scale: with ``powersgd``: the factor the gradients carry (a
        ``keras.optimizers.LossScaleOptimizer``'s ``dynamic_scale``), so
        PowerSGD's error feedback is kept unscaled; the result carries it
        again. ``wrap_optimizer`` and ``hvrep.keras.DistributedOptimizer``
        pass their ``LossScaleOptimizer``'s. Ignored otherwise (fp16/bf16
        compression sends the scaled values: the scale keeps small
        gradients above fp16's underflow).

    Floating-point sum/mean go through fused buffers (``CommConfig``'s fusion
    threshold); other cases issue one collective per tensor.

    Raises:
      hvrep.errors.ConfigError: ``compress`` under PowerSGD without ``powersgd``, or with an op other than
        "sum"/"mean".
    """
    backend = live_backend()
    check_op(op)
    if compress and backend.config.compression == "powersgd":
        if powersgd is None:
            raise ConfigError(
                "all_reduce(..., compress=True) under CommConfig(compression='powersgd') needs the PowerSGD state "
                "of the variables the gradients belong to. Fix: use repl.wrap_optimizer(opt) or "
                "hvrep.keras.DistributedOptimizer, or pass powersgd=hvrep.replica.powersgd.PowerSGDState("
                "variables, repl.config, repl.num_replicas) built under repl.scope().")
        if op not in ("sum", "mean"):
            raise ConfigError(f"PowerSGD reduces gradients by 'sum' or 'mean', got op={op!r}. Fix: compress=False.")
        return powersgd.reduce(list(value), op, backend, loss_scale=loss_scale)
    flat = tf.nest.flatten(value)
    idx = [i for i, v in enumerate(flat) if v is not None]
    reduced = backend.all_reduce([tf.convert_to_tensor(flat[i]) for i in idx], op, compress=compress)
    out = list(flat)
    for i, r in zip(idx, reduced, strict=True):
        out[i] = r
    return tf.nest.pack_sequence_as(value, out)


def all_gather(x: Any, axis: int = 0) -> tf.Tensor:
    """Concatenates every replica's ``x`` along ``axis``, in replica order."""
    return live_backend().all_gather(tf.convert_to_tensor(x), axis)


def broadcast(x: Any, root: int = 0) -> Any:
    """Every replica gets replica ``root``'s value of ``x`` (a tensor or a nest)."""
    backend = live_backend()
    return tf.nest.map_structure(lambda t: backend.broadcast(tf.convert_to_tensor(t), root), x)


def replica_id() -> tf.Tensor:
    """This replica's id in [0, num_replicas), as an int32 tensor."""
    return tf.convert_to_tensor(live_backend().replica_id())


def num_replicas() -> int:
    """The number of replicas (a Python int)."""
    return live_backend().num_replicas
