"""The replica API's core promise, shared by the in-process and multi-rank tests:
K steps with N replicas x batch B equal K steps with 1 replica x batch N*B.

Every optimizer path users take: plain SGD, momentum, LARS, clipping
(``clipnorm``, ``global_clipnorm``, thresholds low enough that they clip),
loss scaling (``LossScaleOptimizer``), a ``keras.losses.Loss`` object instead
of the functional loss, and ``wrap_optimizer`` around each. Each replica gets
different data (equal gradients would hide a missing or doubled reduction).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import hvrep

K, B, SEED = 5, 4, 1234


def data(num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(K * num_replicas * B, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=(K * num_replicas * B,)).astype(np.int32)
    return x, y


def make_model(seed: int = SEED) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


# Optimizer kinds every backend is checked with (tests parametrize over these).
KINDS = ("sgd", "momentum", "lars", "clipnorm", "global_clipnorm", "loss_scale")


def make_optimizer(kind: str) -> keras.optimizers.Optimizer:
    if kind == "lars":
        from hvrep.optimizers import LARS

        return LARS(0.5, momentum=0.9, weight_decay=1e-4)
    if kind == "clipnorm":  # per-variable norms here are ~0.1-1: this clips
        return keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05)
    if kind == "global_clipnorm":
        return keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.1)
    if kind == "loss_scale":  # fp16 training's optimizer; float32 weights keep 1e-5 comparable
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    return keras.optimizers.SGD(0.1, momentum=0.9 if kind == "momentum" else 0.0)


def _loss(model: keras.Model, x: tf.Tensor, y: tf.Tensor, loss: str = "function") -> tf.Tensor:
    logits = model(x, training=True)
    if loss == "object":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def reference(kind: str, num_replicas: int, loss: str = "function") -> list[np.ndarray]:
    """One replica, global batch num_replicas*B, plain TensorFlow."""
    x, y = data(num_replicas)
    model, opt = make_model(), make_optimizer(kind)
    gb = num_replicas * B
    for k in range(K):
        with tf.GradientTape() as tape:
            value = _loss(model, x[k * gb:(k + 1) * gb], y[k * gb:(k + 1) * gb], loss)
            scaled = opt.scale_loss(value)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return [v.numpy() for v in model.weights]


def replicated(repl: hvrep.Replicator, kind: str, init_seed: int = SEED, wrap: bool = False,
               micro: int = 1, loss: str = "function", copies: list | None = None,
               losses: list | None = None) -> list[np.ndarray]:
    """The same training through hvrep: each replica takes its B of every global batch.

    With ``micro`` > 1 each replica feeds its B samples as ``micro`` micro-batches
    (the Replicator's CommConfig.accumulation_steps must equal ``micro``).
    ``copies``, if given, receives every replica's copy of the weights this
    process holds (in-graph backends hold one per device); ``losses`` the
    reduced loss of every step.
    """
    n = repl.num_replicas
    x, y = data(n)
    with repl.scope():
        model, opt = make_model(init_seed), make_optimizer(kind)
        if wrap:
            opt = repl.wrap_optimizer(opt)

    def input_fn(ctx: hvrep.InputContext) -> tf.data.Dataset:
        b, r = ctx.per_replica_batch_size, ctx.replica_id
        idx = np.concatenate([np.arange(k * n * b + r * b, k * n * b + (r + 1) * b) for k in range(K)])
        return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(b // micro)

    def step(xb: tf.Tensor, yb: tf.Tensor) -> dict:
        with tf.GradientTape() as tape:
            value = _loss(model, xb, yb, loss)
            scaled = opt.scale_loss(value)
        grads = tape.gradient(scaled, model.trainable_variables)
        if not wrap:
            grads = hvrep.all_reduce(grads, "mean")
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return {"loss": value}

    steps = 0
    for xb, yb in repl.distribute_dataset(input_fn, global_batch_size=n * B):
        out = repl.run(step, args=(xb, yb))
        mean_loss = repl.reduce(out["loss"], "mean")
        assert np.isfinite(mean_loss)
        if losses is not None:
            losses.append(float(mean_loss))
        steps += 1
    assert steps == K * micro, steps
    if copies is not None:
        strategy = getattr(repl._backend, "strategy", None)
        for v in model.weights:
            parts = strategy.experimental_local_results(getattr(v, "value", v)) if strategy else (v,)
            copies.append([np.asarray(p.numpy()) for p in parts])
    return [np.asarray(v.numpy()) for v in model.weights]


def reference_losses(num_replicas: int, loss: str = "function") -> list[float]:
    """The mean loss over each global batch before its update, for the plain SGD reference."""
    x, y = data(num_replicas)
    model, opt = make_model(), make_optimizer("sgd")
    gb, out = num_replicas * B, []
    for k in range(K):
        with tf.GradientTape() as tape:
            value = _loss(model, x[k * gb:(k + 1) * gb], y[k * gb:(k + 1) * gb], loss)
        out.append(float(value))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return out


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b, strict=True))
