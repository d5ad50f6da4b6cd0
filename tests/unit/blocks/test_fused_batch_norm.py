"""hvrep.layers.FusedBatchNormalization computes what keras.layers.BatchNormalization computes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep import models
from hvrep.errors import ConfigError
from hvrep.layers import FusedBatchNormalization


def _pair(**kwargs):
    """A Keras layer and a fused one with the same (non-trivial) weights, built for 3 channels."""
    plain, fused = keras.layers.BatchNormalization(**kwargs), FusedBatchNormalization(**kwargs)
    shape = (4, 3, 3, 3) if kwargs.get("axis", -1) == 1 else (4, 5, 5, 3)
    rng = np.random.default_rng(1)
    for layer in (plain, fused):
        layer.build(shape)
    for a, b in zip(plain.weights, fused.weights, strict=True):
        value = rng.uniform(0.5, 1.5, a.shape).astype("float32")
        a.assign(value)
        b.assign(value)
    x = tf.constant(rng.normal(2.0, 3.0, shape).astype("float32"))
    return plain, fused, x


def _train_step(layer, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        # A weighted sum, so the gradient w.r.t. x is not zero (sum(bn(x)) is constant in x).
        weights = tf.reshape(tf.range(tf.size(y), dtype=tf.float32), y.shape) / 100.0
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * weights)
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return y, grads


@pytest.mark.parametrize("kwargs", [{}, {"momentum": 0.5, "epsilon": 1e-3}, {"scale": False}, {"center": False},
                                    {"axis": 1}], ids=["default", "momentum-eps", "no-scale", "no-center", "axis1"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "function"])
def test_training_matches_keras(kwargs, compiled):
    plain, fused, x = _pair(**kwargs)
    step = tf.function(_train_step) if compiled else _train_step
    y_plain, g_plain = step(plain, x)
    y_fused, g_fused = step(fused, x)
    np.testing.assert_allclose(y_fused, y_plain, atol=1e-5)
    for a, b in zip(g_fused, g_plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # The moving statistics: the biased batch variance, as Keras updates them.
    np.testing.assert_allclose(fused.moving_mean, plain.moving_mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fused.moving_variance, plain.moving_variance, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(fused(x, training=False), plain(x, training=False), atol=1e-5)


@pytest.mark.parametrize("policy,dtype,atol", [("mixed_float16", tf.float16, 2e-3),
                                                ("mixed_bfloat16", tf.bfloat16, 2e-2)])
def test_mixed_precision_matches_keras(policy, dtype, atol):
    # Tolerances: one rounding of y (and of the input gradient) to the half type, on values of order 1.
    plain, fused, x = _pair(dtype=policy)
    y_plain, g_plain = _train_step(plain, tf.cast(x, dtype))
    y_fused, g_fused = _train_step(fused, tf.cast(x, dtype))
    assert y_fused.dtype == y_plain.dtype == dtype
    np.testing.assert_allclose(tf.cast(y_fused, tf.float32), tf.cast(y_plain, tf.float32), atol=atol)
    for a, b in zip(g_fused, g_plain, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(tf.cast(a, tf.float32), tf.cast(b, tf.float32), rtol=atol * 5, atol=atol * 5)
    np.testing.assert_allclose(fused.moving_mean, plain.moving_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused.moving_variance, plain.moving_variance, rtol=1e-5)


def test_the_fused_kernel_is_what_runs():
    _, fused, x = _pair()
    graph = tf.function(lambda v: fused(v, training=True)).get_concrete_function(x).graph
    assert "FusedBatchNormV3" in {op.type for op in graph.get_operations()}


def test_a_half_precision_input_goes_to_the_kernel_as_it_is():
    # As tf_keras did: no cast to float32 and back around the kernel (on GPUs, cuDNN's half kernel).
    _, fused, x = _pair(dtype="mixed_float16")
    graph = tf.function(lambda v: fused(v, training=True)).get_concrete_function(tf.cast(x, tf.float16)).graph
    (op,) = [op for op in graph.get_operations() if op.type == "FusedBatchNormV3"]
    assert op.get_attr("T") == tf.float16 and op.get_attr("U") == tf.float32


def test_with_fused_batch_norm_copies_the_model_and_its_weights():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                              keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
    model.layers[1].moving_mean.assign(np.arange(4, dtype="float32"))
    fused = models.with_fused_batch_norm(model)
    assert [type(layer) for layer in fused.layers] == [keras.layers.Conv2D, FusedBatchNormalization,
                                                         keras.layers.ReLU, keras.layers.GlobalAveragePooling2D,
                                                         keras.layers.Dense]
    assert type(model.layers[1]) is keras.layers.BatchNormalization  # the original is left alone
    x = np.random.default_rng(0).normal(size=(5, 6, 6, 2)).astype("float32")
    np.testing.assert_allclose(fused(x, training=False), model(x, training=False), atol=1e-6)
    np.testing.assert_allclose(fused(x, training=True), model(x, training=True), atol=1e-5)


def test_with_fused_batch_norm_refuses_a_subclassed_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    net = Net()
    net(np.zeros((1, 2, 2, 1), "float32"))
    with pytest.raises(ConfigError, match=r"functional or Sequential.*Fix"):
        models.with_fused_batch_norm(net)


def test_hvrep_resnets_use_it_when_channels_last():
    assert any(isinstance(layer, FusedBatchNormalization) for layer in models.small_resnet().layers)
