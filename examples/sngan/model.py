"""The networks of a class-conditional SN-GAN (Miyato et al. 2018; Miyato & Koyama 2018) for 32x32 images.

- Discriminator: every weight spectrally normalised (one power iteration per training call, the paper's
  u kept in a non-trainable variable), a projection head for the class: D(x, y) = w.h(x) + e_y.h(x).
- Generator: class-conditional batch norm whose batch statistics span every replica
  (``hvrep.layers.CrossReplicaBatchNorm``, normalising without its own gamma/beta) and whose gamma and beta
  are looked up from the class.

Shapes: images (B, 32, 32, 3) in [-1, 1], NHWC; labels (B,) int32 class ids; noise (B, z_dim).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

import hvrep


def _l2_normalize(x: tf.Tensor) -> tf.Tensor:
    return x * tf.math.rsqrt(tf.reduce_sum(tf.square(x)) + 1e-12)


class _SpectralNorm(keras.layers.Layer):
    """A weight ``kernel`` divided by its largest singular value, estimated by power iteration.

    sigma = u^T W v with u and v held constant in the gradient (the paper's reference code); u advances by
    one iteration per training call. Every replica computes the same u from the same weights, so u needs
    no collective: it stays equal on every replica by construction.
    """

    def _add_sn(self, shape: tuple[int, ...], out_dim: int) -> None:
        self.kernel = self.add_weight(shape=shape, initializer="glorot_uniform", name="kernel")
        self.sn_u = self.add_weight(shape=(1, out_dim), initializer=keras.initializers.RandomNormal(seed=1),
                                    trainable=False, name="sn_u", aggregation="only_first_replica")

    def normalized_kernel(self, training: Any) -> tf.Tensor:
        w = tf.reshape(self.kernel, [-1, self.kernel.shape[-1]])  # (in, out)
        u = tf.convert_to_tensor(self.sn_u)
        v = tf.stop_gradient(_l2_normalize(tf.matmul(u, w, transpose_b=True)))  # (1, in)
        u = tf.stop_gradient(_l2_normalize(tf.matmul(v, w)))  # (1, out)
        if training:
            self.sn_u.assign(u)
        sigma = tf.reduce_sum(tf.matmul(v, w) * u)
        return self.kernel / sigma


class SNConv2D(_SpectralNorm):
    """Conv2D (NHWC, bias) with a spectrally normalised kernel."""

    def __init__(self, filters: int, kernel_size: int, strides: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters, self.kernel_size, self.strides = filters, kernel_size, strides

    def build(self, input_shape: Any) -> None:
        k = self.kernel_size
        self._add_sn((k, k, int(input_shape[-1]), self.filters), self.filters)
        self.bias = self.add_weight(shape=(self.filters,), initializer="zeros", name="bias")

    def call(self, x: tf.Tensor, training: Any = None) -> tf.Tensor:
        y = tf.nn.conv2d(x, self.normalized_kernel(training), self.strides, "SAME")
        return tf.nn.bias_add(y, self.bias)


class SNDense(_SpectralNorm):
    """Dense (bias) with a spectrally normalised kernel."""

    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        self._add_sn((int(input_shape[-1]), self.units), self.units)
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, x: tf.Tensor, training: Any = None) -> tf.Tensor:
        return tf.matmul(x, self.normalized_kernel(training)) + self.bias


class SNEmbedding(_SpectralNorm):
    """A class embedding table (num_classes, dim), spectrally normalised: the projection head's e_y."""

    def __init__(self, num_classes: int, dim: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes, self.dim = num_classes, dim

    def build(self, input_shape: Any) -> None:
        self._add_sn((self.num_classes, self.dim), self.dim)

    def call(self, y: tf.Tensor, training: Any = None) -> tf.Tensor:
        return tf.gather(self.normalized_kernel(training), y)


class ConditionalBatchNorm(keras.layers.Layer):
    """Batch norm over every replica's batch, then a per-class scale and shift: gamma_y * x_hat + beta_y."""

    def __init__(self, num_classes: int, momentum: float = 0.9, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.norm = hvrep.layers.CrossReplicaBatchNorm(center=False, scale=False, momentum=momentum,
                                                       epsilon=1e-5, name="norm")

    def build(self, input_shape: Any) -> None:
        channels = int(input_shape[0][-1])
        self.norm.build(input_shape[0])
        self.gamma = self.add_weight(shape=(self.num_classes, channels), initializer="ones", name="gamma")
        self.beta = self.add_weight(shape=(self.num_classes, channels), initializer="zeros", name="beta")

    def call(self, inputs: Any, training: Any = None) -> tf.Tensor:
        x, y = inputs
        h = self.norm(x, training=training)
        return h * tf.gather(self.gamma, y)[:, None, None, :] + tf.gather(self.beta, y)[:, None, None, :]


class Generator(keras.Model):
    """(noise (B, z_dim), labels (B,)) -> images (B, 32, 32, 3) in [-1, 1]: 4x4 -> 8 -> 16 -> 32 by
    nearest upsampling and 3x3 convolutions, each preceded by conditional batch norm and ReLU.

    The class also enters at the input, as a learned embedding concatenated to the noise (as BigGAN's
    shared embedding does). With the class only in the batch norms' gamma and beta (and Adam at 2e-4), a
    2-rank run on the digits still drew the wrong class for 82% of its samples after 1,000 steps (FID 60,
    class accuracy 0.18); with the embedding (and 5e-4) it reached FID 13 and 0.98 after 500 (docs/sngan.md).
    """

    def __init__(self, num_classes: int = 10, z_dim: int = 64, width: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes, self.z_dim, self.width = num_classes, z_dim, width
        chans = [4 * width, 2 * width, width]
        self.class_embedding = keras.layers.Embedding(num_classes, z_dim, name="class_embedding")
        self.fc = keras.layers.Dense(4 * 4 * chans[0], name="fc")
        self.reshape = keras.layers.Reshape((4, 4, chans[0]))
        self.norms = [ConditionalBatchNorm(num_classes, name=f"cbn{i}") for i in range(len(chans) + 1)]
        outs = [*chans[1:], width]
        self.convs = [keras.layers.Conv2D(c, 3, padding="same", name=f"conv{i}") for i, c in enumerate(outs)]
        self.up = keras.layers.UpSampling2D(2)
        self.to_rgb = keras.layers.Conv2D(3, 3, padding="same", name="to_rgb")

    def call(self, inputs: Any, training: Any = None) -> tf.Tensor:
        z, y = inputs
        h = self.reshape(self.fc(tf.concat([z, self.class_embedding(y)], -1)))
        for norm, conv in zip(self.norms[:-1], self.convs, strict=True):
            h = conv(self.up(tf.nn.relu(norm((h, y), training=training))))
        h = tf.nn.relu(self.norms[-1]((h, y), training=training))
        return tf.tanh(self.to_rgb(h))


class Discriminator(keras.Model):
    """(images (B, 32, 32, 3), labels (B,)) -> logits (B,): a 3x3 then three strided 4x4 SN convolutions
    to 4x4, a sum over positions, then w.h + e_y.h (the projection head)."""

    def __init__(self, num_classes: int = 10, width: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_classes, self.width = num_classes, width
        spec = [(width, 3, 1), (2 * width, 4, 2), (4 * width, 4, 2), (8 * width, 4, 2)]
        self.convs = [SNConv2D(f, k, s, name=f"conv{i}") for i, (f, k, s) in enumerate(spec)]
        self.head = SNDense(1, name="head")
        self.embed = SNEmbedding(num_classes, 8 * width, name="embed")

    def call(self, inputs: Any, training: Any = None) -> tf.Tensor:
        x, y = inputs
        h = x
        for conv in self.convs:
            h = tf.nn.leaky_relu(conv(h, training=training), 0.1)
        h = tf.reduce_sum(h, axis=[1, 2])  # (B, 8 * width)
        return self.head(h, training=training)[:, 0] + tf.reduce_sum(self.embed(y, training=training) * h, -1)


def build(num_classes: int = 10, z_dim: int = 64, g_width: int = 32, d_width: int = 32,
          image_size: int = 32) -> tuple[Generator, Discriminator]:
    """The two networks, built (their variables exist) for ``image_size`` x ``image_size`` RGB images."""
    if image_size != 32:
        raise hvrep.errors.ConfigError(f"image_size must be 32 for these networks, got {image_size}. Fix: "
                                       "image_size=32 (the data pipeline resizes any folder of images to it).")
    g = Generator(num_classes, z_dim, g_width, name="generator")
    d = Discriminator(num_classes, d_width, name="discriminator")
    y = tf.zeros([2], tf.int32)
    g((tf.zeros([2, z_dim]), y))
    d((tf.zeros([2, image_size, image_size, 3]), y))
    return g, d
