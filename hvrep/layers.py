"""Batch-norm layers (one whose statistics span all replicas, one that uses TensorFlow's fused kernel) and a
convolution that keeps clear of a oneDNN crash."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvrep.compat import keras_batch_norm
from hvrep.replica import collectives
from hvrep.replica.context import active_backend


@keras.saving.register_keras_serializable(package="hvrep")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization that trains with TensorFlow's fused kernel (``FusedBatchNormV3``).

    Same arguments, variables, outputs and moving-statistics update as
    ``keras.layers.BatchNormalization``; only the training-mode arithmetic
    differs. Keras 3 computes batch norm from separate ops (moments, then
    normalise) and differentiates through each; tf_keras, and so Horovod's
    examples, used the fused kernel and its fused gradient
    (``hvrep.compat.keras_batch_norm`` has the measurements). Inside
    ``Replicator.run`` Keras' own layer trains this way too, by default
    (``Replicator(batch_norm="fused")``); this layer does it everywhere
    (``model.fit``, a step of your own).

    The fused path is taken when training a 4-D float16/bfloat16/float32 input
    normalised over its last axis (channels_last), without mask, renorm or
    ``synchronized``; every other call is Keras' own (inference is a cheap
    scale-and-shift either way; channels_first would need the NCHW kernel,
    which the CPU lacks).
    """

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if not keras_batch_norm.fusable(self, inputs, training, mask):
            return super().call(inputs, training=training, mask=mask)
        return keras_batch_norm.fused_training_call(self, inputs)


class CrossReplicaBatchNorm(keras.layers.BatchNormalization):
    """BatchNormalization whose batch moments are computed over every replica's batch.

    With N replicas of batch B it normalises exactly as BatchNormalization does
    on the concatenated N×B batch (TF-Replicator used it for SN-GAN). The sum,
    sum of squares and count cross replicas in one fused all-reduce; it must
    run inside ``Replicator.run`` when training. A mask (one value per
    position, shape = inputs' shape without the channel axis) weights each
    position, as in BatchNormalization; masked positions of every replica
    are left out. Outside a replica step (e.g. a plain ``model(x)`` call for inspection) it
    behaves as ordinary BatchNormalization.
    """

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if active_backend() is None:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float32)
        axes = list(self._reduction_axes)
        # Per-position weights: 1 everywhere, or the mask broadcast over the channels.
        w = tf.ones_like(x) if mask is None else tf.broadcast_to(tf.cast(mask, tf.float32)[..., None], tf.shape(x))
        total, total_sq, n = collectives.all_reduce(
            [tf.reduce_sum(x * w, axes), tf.reduce_sum(tf.square(x) * w, axes), tf.reduce_sum(w, axes)], "sum"
        )
        mean = total / n
        variance = tf.maximum(total_sq / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


# oneDNN's AVX-512 1x1 backward-weights kernel (jit_1x1, TF 2.21 / oneDNN 3.7.3) corrupts the heap when it
# compacts a strided input of fewer than this many channels at an odd batch, with more than one thread:
# docs/troubleshooting.md, "Known issues"; tests/unit/known_issues/onednn_strided_1x1.py reproduces it.
_ONEDNN_BLOCK = 16


@keras.saving.register_keras_serializable(package="hvrep")
class SubsamplingConv2D(keras.layers.Conv2D):
    """``keras.layers.Conv2D`` that takes a strided 1×1 convolution of a narrow input as subsample, then convolve.

    Same arguments, variables and outputs as ``keras.layers.Conv2D``. A 1×1
    kernel with strides (sh, sw) > 1 on a channels_last input of fewer than
    16 channels is computed as ``inputs[:, ::sh, ::sw, :]`` convolved with
    stride 1: the same function (a 1×1 window never pads), but TensorFlow's
    oneDNN backward-filter kernel for the strided case crashes the process
    (``free(): invalid size`` or SIGSEGV) at odd batch sizes on more than one
    thread. Every other convolution is Keras' own. hvrep's ResNets use it for
    their projection shortcuts (``res{stage}a_branch1``).
    """

    def convolution_op(self, inputs: Any, kernel: Any) -> Any:
        if not _subsample_first(self, inputs):
            return super().convolution_op(inputs, kernel)
        sh, sw = self.strides
        return keras.ops.conv(inputs[:, ::sh, ::sw, :], kernel, strides=1, padding=self.padding,
                              dilation_rate=self.dilation_rate, data_format=self.data_format)


def _subsample_first(layer: keras.layers.Conv2D, inputs: Any) -> bool:
    """Whether ``layer`` would run oneDNN's crashing kernel on ``inputs`` (the shapes, not the device: on a GPU
    the subsample is one small copy)."""
    channels = inputs.shape[-1]
    return (tuple(layer.kernel_size) == (1, 1) and tuple(layer.strides) != (1, 1) and layer.data_format ==
            "channels_last" and channels is not None and channels < _ONEDNN_BLOCK)
