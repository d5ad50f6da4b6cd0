"""Batch-norm layers: one whose statistics span all replicas, one that uses TensorFlow's fused kernel."""

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
