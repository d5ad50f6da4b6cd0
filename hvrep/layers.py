"""Layers whose statistics span all replicas."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvrep.replica import collectives
from hvrep.replica.context import active_backend


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
