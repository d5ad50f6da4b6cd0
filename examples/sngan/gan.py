"""The SN-GAN training step, written for one replica: ``n_dis`` discriminator updates, then one generator update.

Collectives, and why each is there:

- ``hvrep.all_reduce(grads, "mean")`` once per update (D's, then G's): every replica applies the mean
  gradient, so the weights stay identical and the update equals one process's on the global batch.
- ``CrossReplicaBatchNorm`` inside the generator: one fused all-reduce of (sum, sum of squares, count) per
  batch-norm layer and forward pass, so the batch statistics are those of the global batch (the
  TF-Replicator paper's ingredient for large-batch SN-GAN; per-replica statistics would make the update
  depend on how the batch is split).
- Nothing else: the noise and the fake classes of the global batch are drawn from the step number on every
  replica and sliced by ``hvrep.replica_id()`` (no broadcast), and spectral norm's power iteration sees the
  same weights on every replica (no collective).

Hinge loss; Adam with beta1 = 0, beta2 = 0.9 (SN-GAN's); an exponential moving average of the generator's
weights, kept outside the replicated step (every process updates its own copy identically), for sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

import hvrep
from examples.sngan import model as models
from hvrep.errors import ConfigError
from hvrep.train.settings import check_ranges


@dataclasses.dataclass(frozen=True)
class GANConfig:
    """The model and its optimisation.

    Attributes:
      num_classes: classes of the data set (the digits: 10).
      z_dim: noise dimensions.
      g_width, d_width: base channel counts (G: 4w, 2w, w; D: w .. 8w).
      n_dis: discriminator updates per generator update (SN-GAN: 5 at batch 64; 2 trains faster here).
      lr_g, lr_d: Adam learning rates. SN-GAN used 2e-4 for runs of 10^5 steps; these defaults are the
        ones of the minutes-long run in docs/sngan.md (2e-4 was not tried with the final networks).
      beta1, beta2: Adam's (SN-GAN: 0.0, 0.9).
      ema_decay: of the generator's weights, per generator update, reached after a warm-up
        (min(ema_decay, (1 + t) / (10 + t)) at step t; 0: no averaging).
      optimizer: "adam" (the app) or "sgd" (the exactness test: no division by a near-zero second moment,
        so float32 rounding stays small after a few steps).
      seed: draws the noise and the fake classes of every step.
    """

    num_classes: int = 10
    z_dim: int = 64
    g_width: int = 16
    d_width: int = 16
    n_dis: int = 2
    lr_g: float = 5e-4
    lr_d: float = 5e-4
    beta1: float = 0.0
    beta2: float = 0.9
    ema_decay: float = 0.999
    optimizer: str = "adam"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.n_dis < 64:  # the noise's seed counts 64 draws per step (_draw)
            raise ConfigError(f"n_dis must be in [1, 63], got {self.n_dis}.")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}.")
        check_ranges(self, {"num_classes": "[1, inf)", "z_dim": "[1, inf)", "g_width": "[1, inf)",
                            "d_width": "[1, inf)", "lr_g": "(0, inf)", "lr_d": "(0, inf)", "beta1": "[0, 1)",
                            "beta2": "[0, 1)", "ema_decay": "[0, 1)", "seed": "[0, inf)"}, prefix="gan.")


class SNGAN:
    """The networks, their optimizers and the replicated step.

    Args:
      repl: runs the step on every replica; G, D and the optimizers are built in its scope.
      cfg: the model and optimisation settings.
    """

    def __init__(self, repl: hvrep.Replicator, cfg: GANConfig) -> None:
        self.repl, self.cfg = repl, cfg
        with repl.scope():
            keras.utils.set_random_seed(cfg.seed)
            self.generator, self.discriminator = models.build(cfg.num_classes, cfg.z_dim, cfg.g_width, cfg.d_width)
            self.opt_g, self.opt_d = self._optimizer(cfg.lr_g), self._optimizer(cfg.lr_d)
            self.opt_g.build(self.generator.trainable_variables)
            self.opt_d.build(self.discriminator.trainable_variables)
        # The EMA generator is only sampled from: plain variables of this process, never in a replica step.
        self.ema, _ = models.build(cfg.num_classes, cfg.z_dim, cfg.g_width, cfg.d_width)
        self._copy_to_ema()

    def _optimizer(self, lr: float) -> Any:
        if self.cfg.optimizer == "sgd":
            return keras.optimizers.SGD(lr)
        return keras.optimizers.Adam(lr, beta_1=self.cfg.beta1, beta_2=self.cfg.beta2)

    def checkpoint_items(self) -> dict[str, Any]:
        """What a checkpoint carries: both networks, both optimizers, the EMA generator."""
        return {"generator": self.generator, "discriminator": self.discriminator, "opt_g": self.opt_g,
                "opt_d": self.opt_d, "generator_ema": self.ema}

    def _copy_to_ema(self) -> None:
        for e, w in zip(self.ema.weights, self.generator.weights, strict=True):
            e.assign(tf.convert_to_tensor(w))

    @tf.function
    def _update_ema(self, step: tf.Tensor) -> None:
        # Warm-up: early on the average follows the generator closely, so short runs sample a trained network.
        t = tf.cast(step, tf.float32)
        d = tf.minimum(self.cfg.ema_decay, (1.0 + t) / (10.0 + t))
        for e, w in zip(self.ema.trainable_variables, self.generator.trainable_variables, strict=True):
            e.assign(d * e + (1.0 - d) * tf.convert_to_tensor(w))
        # Batch-norm moving statistics are not averaged: sampling uses the batch's own statistics.

    def _draw(self, step: tf.Tensor, k: int, batch: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """This replica's slice of the global batch's noise and fake classes for update ``k`` of ``step``."""
        n, rid = hvrep.num_replicas(), hvrep.replica_id()
        seed = tf.stack([tf.constant(self.cfg.seed, tf.int64), tf.cast(step, tf.int64) * 64 + k])
        z = tf.random.stateless_normal(tf.stack([n * batch, self.cfg.z_dim]), seed=seed)
        y_seed = seed + tf.constant([0, 1 << 40], tf.int64)
        y = tf.random.stateless_uniform(tf.stack([n * batch]), seed=y_seed, minval=0, maxval=self.cfg.num_classes,
                                        dtype=tf.int32)
        lo = tf.cast(rid, tf.int32) * batch
        return z[lo:lo + batch], y[lo:lo + batch]

    def _d_update(self, real: tf.Tensor, labels: tf.Tensor, step: tf.Tensor, k: int) -> tf.Tensor:
        g, d = self.generator, self.discriminator
        b = tf.shape(real)[0]
        z, y_fake = self._draw(step, k, b)
        fake = g((z, y_fake), training=True)
        with tf.GradientTape() as tape:
            # One call on real and fake together: one power iteration per D update.
            logits = d((tf.concat([real, fake], 0), tf.concat([labels, y_fake], 0)), training=True)
            loss = tf.reduce_mean(tf.nn.relu(1.0 - logits[:b])) + tf.reduce_mean(tf.nn.relu(1.0 + logits[b:]))
        grads = hvrep.all_reduce(tape.gradient(loss, d.trainable_variables), "mean")
        self.opt_d.apply_gradients(zip(grads, d.trainable_variables, strict=True))
        return loss

    def _g_update(self, step: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
        g, d = self.generator, self.discriminator
        z, y_fake = self._draw(step, self.cfg.n_dis, batch)
        with tf.GradientTape() as tape:
            loss = -tf.reduce_mean(d((g((z, y_fake), training=True), y_fake), training=False))
        grads = hvrep.all_reduce(tape.gradient(loss, g.trainable_variables), "mean")
        self.opt_g.apply_gradients(zip(grads, g.trainable_variables, strict=True))
        return loss

    def step_fn(self, images: tf.Tensor, labels: tf.Tensor, step: tf.Tensor) -> dict[str, tf.Tensor]:
        """One replica's step. ``images`` (n_dis * B, 32, 32, 3) and ``labels`` (n_dis * B,): a real batch of B
        for each D update; ``step``: the global step (draws the noise). Returns this replica's losses."""
        n_dis = self.cfg.n_dis
        b = tf.shape(images)[0] // n_dis
        d_loss = tf.add_n([self._d_update(images[k * b:(k + 1) * b], labels[k * b:(k + 1) * b], step, k)
                           for k in range(n_dis)]) / n_dis
        g_loss = self._g_update(step, b)
        return {"d_loss": d_loss, "g_loss": g_loss}

    def train_step(self, images: Any, labels: Any, step: int) -> Any:
        """Runs the step on every replica, then the EMA update; returns the per-replica losses (``repl.reduce``
        them; reading them waits for the step)."""
        out = self.repl.run(self.step_fn, args=(images, labels, tf.constant(step, tf.int64)))
        if self.cfg.ema_decay:
            self._update_ema(tf.constant(step, tf.int64))
        else:
            self._copy_to_ema()
        return out

    def sample(self, labels: tf.Tensor, seed: int = 1234) -> tf.Tensor:
        """Images of the EMA generator for ``labels`` (N,), with the batch's own normalisation statistics."""
        z = tf.random.stateless_normal([int(labels.shape[0]), self.cfg.z_dim], seed=[seed, 0])
        return self._sample(z, labels)

    @tf.function
    def _sample(self, z: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        return self.ema((z, labels), training=True)
