"""Keras 3's BatchNormalization trained with TensorFlow's fused kernel, as tf_keras did.

tf_keras (and so every Horovod example) trained ``BatchNormalization`` with
``FusedBatchNormV3`` whenever it could (``fused=None``); Keras 3 dropped the
option and computes batch norm from separate ops (moments, then normalise),
differentiating through each. On this project's CPU machine, one process, one
TF thread, ``keras.applications.ResNet50`` at 224 px, batch 8, an SGD step took
2.36 s (median of 3 launches) that way, 1.78 s with the fused kernel and
1.77 s on tf_keras (``benchmarks/batch_norm.py``; docs/performance.md, "Throughput against
plain Horovod"). On GPUs the fused kernel is cuDNN's.

Two ways in:

* :func:`fused_training_call`: the arithmetic, for ``hvrep.layers.FusedBatchNormalization``.
* :func:`fused_in_this_thread`: while it is active, in this thread, a
  ``keras.layers.BatchNormalization`` (or a subclass that keeps Keras' own
  moments) that can be fused trains through :func:`fused_training_call`.
  ``Replicator.run`` traces a step inside it (``Replicator(batch_norm=...)``).

Keras 3 has no hook for this (no ``fused`` argument, no dispatch on the
layer's arithmetic), so the second way replaces ``BatchNormalization.call``
once, the first time it is asked for, with a function that calls Keras' own
``call`` unless this thread is inside :func:`fused_in_this_thread`. It is the
one framework class hvrep touches (STYLE.md, principle 6, names the cost):
outside a step hvrep traces, every BatchNormalization behaves, and builds the
same graph, as Keras' own. Remove it when Keras gains a fused path.

Guards: it replaces nothing on a Keras outside the releases it was verified
on (:mod:`hvrep.compat.keras_versions`), and an input of unknown rank keeps
Keras' own path; each says so in one warning per process.

A ``tf.function`` of your own called inside a step is traced there the first
time, so its graph holds the fused kernel and keeps it when it is later
called outside ``run`` with the same input signature (TensorFlow reuses a
trace; nothing here can key it). The outputs and moving statistics are
Keras' own up to float32 rounding either way; to have Keras' ops in that
function outside ``run``, call it there first, or give each use its own
``tf.function``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from hvrep.compat import keras_versions

_state = threading.local()
_install_lock = threading.Lock()
_keras_call: Any = None  # Keras' own BatchNormalization.call, once replaced

# FusedBatchNormV3 takes these input dtypes (statistics in float32); float64 stays on Keras' path.
_FUSABLE_DTYPES = ("float16", "bfloat16", "float32")


def fusable(layer: Any, inputs: Any, training: Any, mask: Any) -> bool:
    """True when ``layer(inputs, training, mask)`` trains a 4-D channels-last input that the fused kernel
    normalises exactly as Keras does: no mask, renorm or ``synchronized``, a Python ``training`` that is
    true, a trainable layer. Everything else (inference included) is Keras' own path, an input of unknown
    rank too (with one warning)."""
    rank = tf.TensorShape(inputs.shape).rank
    if rank is None:
        keras_versions.warn_once(
            "batch_norm unknown rank",
            f"hvrep: a BatchNormalization layer ({layer.name!r}) got an input of unknown rank: it "
            "trains with Keras' own ops, not the fused kernel (which needs a 4-D input). Fix: "
            "give the input a known rank (tf.ensure_shape), or Replicator(batch_norm=\"keras\") to silence this.")
        return False
    return (
        training is not None and not tf.is_tensor(training) and bool(training) and bool(layer.trainable)
        and mask is None and rank == 4 and layer.axis in (-1, rank - 1)
        and not getattr(layer, "renorm", False) and not getattr(layer, "synchronized", False)
        and tf.as_dtype(inputs.dtype).name in _FUSABLE_DTYPES
    )


def fused_training_call(layer: Any, inputs: Any) -> Any:
    """``layer``'s training-mode output for ``inputs``, and its moving statistics updated, through
    ``FusedBatchNormV3``. Same outputs and updates as Keras' layer up to float32 rounding (a half-precision
    output is rounded once to its type, as Keras' is); call it only where :func:`fusable` is true."""
    # A float16/bfloat16 input goes in as it is, as tf_keras passed it: the kernel computes the
    # moments and the normalisation in float32 (its U type) and rounds only y, as Keras' own layer
    # does after upcasting; on GPUs under mixed_float16 this saves two casts and half the traffic.
    x = inputs
    channels = x.shape[-1]
    gamma = tf.cast(layer.gamma, tf.float32) if layer.scale else tf.ones([channels], tf.float32)
    beta = tf.cast(layer.beta, tf.float32) if layer.center else tf.zeros([channels], tf.float32)
    empty = tf.constant([], tf.float32)
    y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=layer.epsilon,
        data_format="NHWC", is_training=True)
    # The kernel's batch variance is Bessel-corrected (n / (n - 1)); Keras' moving
    # variance, like the normalisation itself, uses the biased one.
    n = tf.cast(tf.size(x, out_type=tf.int64) // channels, tf.float32)
    variance = variance * ((n - 1.0) / tf.maximum(n, 1.0))
    layer.moving_mean.assign(layer.moving_mean * layer.momentum + mean * (1.0 - layer.momentum))
    layer.moving_variance.assign(layer.moving_variance * layer.momentum + variance * (1.0 - layer.momentum))
    return tf.cast(y, layer.compute_dtype)


def _dispatching_call(self: Any, inputs: Any, training: Any = None, mask: Any = None) -> Any:
    if (getattr(_state, "depth", 0) and type(self)._moments is keras.layers.BatchNormalization._moments
            and fusable(self, inputs, training, mask)):
        return fused_training_call(self, inputs)
    return _keras_call(self, inputs, training=training, mask=mask)


def _install() -> None:
    global _keras_call
    with _install_lock:
        if _keras_call is None:
            _keras_call = keras.layers.BatchNormalization.call
            keras.layers.BatchNormalization.call = functools.wraps(_keras_call)(_dispatching_call)


def _verified_keras() -> bool:
    """Whether this Keras is one the replacement was verified on; otherwise warns once."""
    reason = keras_versions.unverified()
    if reason is not None:
        keras_versions.warn_once(
            "batch_norm version",
            f"hvrep: {reason}: keras.layers.BatchNormalization keeps Keras' own ops inside Replicator.run "
            "(the fused path re-implements its training branch and calls the private _moments, which this Keras "
            "may have changed). Fix: install a verified Keras (requirements.txt pins it), or pass "
            "Replicator(batch_norm=\"keras\") to silence this.")
    return reason is None


@contextlib.contextmanager
def fused_in_this_thread() -> Iterator[None]:
    """Inside, in this thread, Keras' BatchNormalization layers that can be fused train with the fused kernel.

    Meant around the tracing of a step (a ``tf.function``'s Python body): the
    graph it builds keeps the fused op after the context exits. Nests. On a
    Keras outside the verified releases it changes nothing (one warning).
    """
    if not _verified_keras():
        yield
        return
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def in_this_thread(fn: Any) -> Any:
    """``fn`` that runs inside :func:`fused_in_this_thread` (the same signature, for ``tf.function``)."""

    @functools.wraps(fn)
    def fused(*args: Any, **kwargs: Any) -> Any:
        with fused_in_this_thread():
            return fn(*args, **kwargs)

    return fused
