"""LARS against a NumPy reference written from the paper's equations (You et al. 2017, Alg. 1,
with the MLPerf reference's momentum form), and LARS in real use: tf.function, XLA, mixed
precision, checkpoints, serialisation."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.optimizers import LARS

# A ResNet-like set: conv kernels, BN gamma/beta, a dense kernel and bias, a zero-norm kernel.
SHAPES = {
    "conv1/kernel": (3, 3, 3, 8),
    "bn_conv1/gamma": (8,),
    "bn_conv1/beta": (8,),
    "res2a_branch2a/kernel": (1, 1, 8, 16),
    "bn2a_branch2a/gamma": (16,),
    "bn2a_branch2a/beta": (16,),
    "zero/kernel": (4, 4),
    "fc/kernel": (16, 10),
    "fc/bias": (10,),
}
EXCLUDED = {"bn_conv1/gamma", "bn_conv1/beta", "bn2a_branch2a/gamma", "bn2a_branch2a/beta", "fc/bias"}


def reference_step(w, g, v, lr, m, wd, eta, eps, nesterov, excluded):
    """One LARS step in float64 NumPy, from the equations."""
    w, g, v = (np.asarray(a, np.float64) for a in (w, g, v))
    if excluded:  # plain momentum SGD
        update_dir, ratio = g, 1.0
    else:
        update_dir = g + wd * w
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        ratio = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    v_new = m * v + lr * ratio * update_dir
    w_new = w - (m * v_new + lr * ratio * update_dir if nesterov else v_new)
    return w_new, v_new


def _variables(rng, dtype=np.float32):
    out = {}
    for path, shape in SHAPES.items():
        scope, name = path.split("/")
        init = np.zeros(shape, dtype) if scope == "zero" else rng.normal(size=shape).astype(dtype)
        if name == "gamma":
            init = np.abs(init) + 0.5
        with keras.name_scope(scope):
            out[path] = keras.Variable(init, name=name, dtype=dtype)
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize(("wd", "eps"), [(0.0, 0.0), (5e-4, 1e-9)])
def test_update_equals_the_numpy_reference_step_by_step(nesterov, wd, eps, dtype):
    rng = np.random.default_rng(0)
    variables = _variables(rng, dtype)
    assert {v.path for v in variables.values()} == set(SHAPES)
    lr, m, eta = 0.7, 0.9, 0.001
    opt = LARS(lr, momentum=m, weight_decay=wd, eta=eta, epsilon=eps, nesterov=nesterov)
    ref_w = {p: v.numpy().astype(np.float64) for p, v in variables.items()}
    ref_v = {p: np.zeros(SHAPES[p]) for p in SHAPES}
    for step in range(5):
        grads = {}
        for p, shape in SHAPES.items():
            # Step 2 gives one variable a zero gradient: ratio 1, no NaN.
            zero = step == 2 and p == "conv1/kernel"
            grads[p] = np.zeros(shape, dtype) if zero else rng.normal(size=shape).astype(dtype)
        opt.apply_gradients([(tf.constant(grads[p]), variables[p]) for p in SHAPES])
        for p in SHAPES:
            # Keras holds the learning rate in a float32 variable: the reference uses that value.
            ref_w[p], ref_v[p] = reference_step(ref_w[p], grads[p], ref_v[p], float(np.float32(lr)), m, wd, eta,
                                                eps, nesterov, p in EXCLUDED)
        for p, var in variables.items():
            got = var.numpy()
            assert np.all(np.isfinite(got)), p
            if dtype == np.float64:  # element by element
                np.testing.assert_allclose(got, ref_w[p], rtol=1e-6, err_msg=f"{p} at step {step}")
            else:  # float32 rounds each element: compare the tensor, relative to its norm
                err = np.linalg.norm(got - ref_w[p]) / max(np.linalg.norm(ref_w[p]), 1e-30)
                assert err <= 1e-6 or np.all(ref_w[p] == 0), (p, step, err)


def test_default_exclusions_are_batch_norm_and_biases():
    variables = _variables(np.random.default_rng(1))
    opt = LARS(0.1, weight_decay=1e-4)
    opt.build(list(variables.values()))
    for p, v in variables.items():
        decay, adapt = opt.decay_and_adapt(v)
        assert decay == adapt == (p not in EXCLUDED), p


def test_zero_weights_and_gradients_give_no_nan():
    with keras.name_scope("conv"):
        w = keras.Variable(np.zeros((3, 3), np.float32), name="kernel")
    opt = LARS(1.0, weight_decay=1e-4, epsilon=0.0)
    for _ in range(3):
        opt.apply_gradients([(tf.zeros((3, 3)), w)])
    assert np.all(np.isfinite(w.numpy())) and np.all(w.numpy() == 0)


def test_user_patterns_that_match_nothing_warn_with_the_variable_names():
    variables = _variables(np.random.default_rng(2))
    opt = LARS(0.1, exclude_from_weight_decay=["batchnrom"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.build(list(variables.values()))
    messages = [str(w.message) for w in caught]
    assert any("'batchnrom' matches no variable" in msg and "conv1/kernel" in msg for msg in messages), messages


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
    ({"learning_rate": -1.0}, "learning_rate must be > 0, got -1.0"),
    ({"learning_rate": 0.1, "eta": 0.0}, "eta must be > 0, got 0.0"),
    ({"learning_rate": 0.1, "eta": -0.001}, "eta must be > 0"),
    ({"learning_rate": 0.1, "momentum": 1.0}, "momentum must be in [0, 1), got 1.0"),
    ({"learning_rate": 0.1, "weight_decay": -1e-4}, "weight_decay must be >= 0"),
    ({"learning_rate": 0.1, "exclude_from_weight_decay": ["("]}, "not a valid regular expression"),
])
def test_bad_arguments_are_named(kwargs, fragment):
    with pytest.raises(ConfigError) as e:
        LARS(**kwargs)
    assert fragment in str(e.value)


def _model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(3)])
    x = tf.random.stateless_normal((16, 6), seed=(1, 2))
    y = tf.random.stateless_uniform((16,), seed=(3, 4), maxval=3, dtype=tf.int32)
    return model, x, y


def _train(opt, steps=3, jit=False, scale_loss=False):
    model, x, y = _model_and_data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=jit)
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = opt.scale_loss(loss) if scale_loss else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for _ in range(steps):
        step()
    return [v.numpy() for v in model.trainable_variables]


def test_tf_function_and_xla_give_the_eager_result():
    eager = _train(LARS(0.5, weight_decay=1e-4), jit=False)
    xla = _train(LARS(0.5, weight_decay=1e-4), jit=True)
    for a, b in zip(eager, xla, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mixed_precision_loss_scaling_unscales_before_lars():
    plain = _train(LARS(0.5, weight_decay=1e-4))
    scaled = _train(keras.optimizers.LossScaleOptimizer(LARS(0.5, weight_decay=1e-4), initial_scale=2.0**10),
                    scale_loss=True)
    for a, b in zip(plain, scaled, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_slots_checkpoint_and_restore(tmp_path):
    model, _, _ = _model_and_data()
    opt = LARS(0.5, weight_decay=1e-4)
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=v.shape).astype(np.float32)) for v in model.trainable_variables]
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    saved = [v.numpy().copy() for v in opt.variables]
    path = tf.train.Checkpoint(optimizer=opt, model=model).write(str(tmp_path / "ckpt"))

    model2, _, _ = _model_and_data()
    opt2 = LARS(0.5, weight_decay=1e-4)
    opt2.build(model2.trainable_variables)
    tf.train.Checkpoint(optimizer=opt2, model=model2).read(path).assert_consumed()
    assert len(opt2.variables) == len(saved) and any(np.any(s != 0) for s in saved[2:])
    for a, b in zip(opt2.variables, saved, strict=True):
        np.testing.assert_array_equal(a.numpy(), b)


def test_config_round_trip_keeps_coupled_decay_and_patterns():
    from hvrep.schedules import PolynomialDecayWithWarmup

    opt = LARS(PolynomialDecayWithWarmup(2.0, 100, 10), momentum=0.95, weight_decay=5e-5, eta=0.002,
               epsilon=1e-8, nesterov=True, exclude_from_weight_decay=["bn"], exclude_from_layer_adaptation=[])
    again = LARS.from_config(opt.get_config())
    assert (again.momentum, again.coupled_weight_decay, again.eta, again.epsilon, again.nesterov) == (
        0.95, 5e-5, 0.002, 1e-8, True)
    assert again.weight_decay is None  # never Keras' decoupled decay
    assert again.exclude_from_weight_decay_patterns == ("bn",)
    assert again.exclude_from_layer_adaptation_patterns == ()
    assert float(again.learning_rate) == pytest.approx(float(opt.learning_rate))
