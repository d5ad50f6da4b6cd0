"""`hvrep train`'s own step (Runner) on 2 in-graph replicas equals one replica with twice the batch.

The app's step uses a keras.losses.Loss object (label smoothing) and, with
train.precision=fp16, a LossScaleOptimizer: the two paths that updated N x too
little (the Loss object divided by N) or N x too much (Keras summed the
unscaled, already-reduced gradients again) on a multi-device `local` run.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.train.steps import Runner

B, K, CLASSES = 4, 3, 5


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def _optimizer(fp16: bool) -> keras.optimizers.Optimizer:
    sgd = keras.optimizers.SGD(0.2, momentum=0.9)
    return keras.optimizers.LossScaleOptimizer(sgd) if fp16 else sgd


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    return (rng.normal(size=(K * 2 * B, 6)).astype(np.float32),
            rng.integers(0, CLASSES, size=(K * 2 * B,)).astype(np.int32))


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16_loss_scaling"])
def test_the_train_apps_step_on_two_replicas_equals_one_replica_with_twice_the_batch(fp16):
    x, y = _data()
    repl = hvrep.Replicator("local")
    assert repl.num_replicas == 2
    with repl.scope():
        model, opt = _model(), _optimizer(fp16)
    runner = Runner(repl, model, opt, num_classes=CLASSES, label_smoothing=0.1, fp16=fp16, jit_compile=False)

    def input_fn(ctx):
        r = ctx.replica_id
        idx = np.concatenate([np.arange(k * 2 * B + r * B, k * 2 * B + (r + 1) * B) for k in range(K)])
        return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(B)

    losses = []
    for xb, yb in repl.distribute_dataset(input_fn, global_batch_size=2 * B):
        loss, _ = runner.train(xb, yb)
        losses.append(float(repl.reduce(loss, "mean")))

    ref_model, ref_opt = _model(), _optimizer(fp16)
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    want_losses = []
    for k in range(K):
        xb, yb = x[k * 2 * B:(k + 1) * 2 * B], y[k * 2 * B:(k + 1) * 2 * B]
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.one_hot(yb, CLASSES), ref_model(xb, training=True))
            scaled = ref_opt.scale_loss(loss)
        want_losses.append(float(loss))
        ref_opt.apply_gradients(zip(tape.gradient(scaled, ref_model.trainable_variables),
                                    ref_model.trainable_variables, strict=True))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(model.weights, ref_model.weights, strict=True):
        for part in repl._backend.strategy.experimental_local_results(got.value):
            np.testing.assert_allclose(part.numpy(), want.numpy(), atol=1e-5)
