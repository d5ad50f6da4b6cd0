"""Batch-norm layers: one whose statistics span all replicas, one that uses TensorFlow's fused kernel."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvrep.replica import collectives
from hvrep.replica.context import active_backend


@keras.saving.register_keras_serializable(package="hvrep")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization that trains with TensorFlow's fused kernel (``FusedBatchNormV3``).

    Same arguments, variables, outputs and moving-statistics update as
    ``keras.layers.BatchNormalization``; only the training-mode arithmetic
    differs. Keras 3 computes batch norm from separate ops (moments, then
    normalise) and differentiates through each; tf_keras, and so Horovod's
    examples, used the fused kernel and its fused gradient. Measured on this
    project's CPU machine, one process, one TF thread, ResNet-50 at 224 px,
    batch 8, SGD step: Keras 3 2.46-2.66 s, Keras 3 with this layer
    2.15-2.26 s, tf_keras 2.14-2.23 s (``benchmarks/vs_horovod.py`` has the
    2-rank comparison). On GPUs the fused kernel is cuDNN's.

    The fused path is taken when training a 4-D input normalised over its last
    axis (channels_last), without mask, renorm or ``synchronized``; every
    other call is Keras' own (inference is a cheap scale-and-shift either way;
    channels_first would need the NCHW kernel, which the CPU lacks).
    """

    def _fusable(self, inputs: Any, training: Any, mask: Any) -> bool:
        rank = len(inputs.shape)
        return bool(
            training and self.trainable and mask is None and rank == 4 and self.axis in (-1, rank - 1)
            and not self.renorm and not getattr(self, "synchronized", False)
        )

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if not self._fusable(inputs, training, mask):
            return super().call(inputs, training=training, mask=mask)
        # float32 arithmetic, as Keras' own layer does: half-precision moments overflow.
        x = tf.cast(inputs, tf.float32)
        channels = x.shape[-1]
        gamma = tf.cast(self.gamma, tf.float32) if self.scale else tf.ones([channels], tf.float32)
        beta = tf.cast(self.beta, tf.float32) if self.center else tf.zeros([channels], tf.float32)
        empty = tf.constant([], tf.float32)
        y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=self.epsilon,
            data_format="NHWC", is_training=True)
        # The kernel's batch variance is Bessel-corrected (n / (n - 1)); Keras'
        # moving variance, like the normalisation itself, uses the biased one.
        n = tf.cast(tf.size(x) // channels, tf.float32)
        variance = variance * ((n - 1.0) / tf.maximum(n, 1.0))
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(y, self.compute_dtype)


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
