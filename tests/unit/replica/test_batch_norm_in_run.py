"""Replicator.run trains keras.layers.BatchNormalization with TensorFlow's fused kernel, as tf_keras did.

In-graph backend, 2 logical CPU devices (each replica traces on its own
thread); the horovod backend's case is in tests/multirank/cases_replicator.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError
from hvrep.layers import CrossReplicaBatchNorm

FUSED = "FusedBatchNormV3"


def _model(seed=5, **bn_kwargs):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(momentum=0.8, **bn_kwargs),
        keras.layers.ReLU(),
        keras.layers.Conv2D(3, 3, strides=2, use_bias=False),
        keras.layers.BatchNormalization(momentum=0.8, **bn_kwargs),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(5),
    ])


def _batches(steps=3, replicas=2, per_replica=4):
    rng = np.random.default_rng(11)
    x = rng.normal(1.0, 2.0, size=(steps, replicas * per_replica, 6, 6, 2)).astype("float32")
    y = rng.integers(0, 5, size=(steps, replicas * per_replica)).astype("int32")
    return x, y


def _train(repl, steps=3):
    """Trains ``_model()`` ``steps`` SGD steps under ``repl``; returns (op types each trace built, the model)."""
    with repl.scope():
        model = _model()
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build(model.trainable_variables)
    traced: list[list[str]] = []
    x, y = _batches(steps, repl.num_replicas)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
        grads = hvrep.all_reduce(tape.gradient(loss, model.trainable_variables), "mean")
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        # Inside the trace the default graph is the step's own: what this replica built.
        traced.append([op.type for op in tf.compat.v1.get_default_graph().get_operations()])
        return loss

    def one_replica_each(i):
        def fn(ctx):
            pb = ctx.per_replica_batch_size
            ds = tf.data.Dataset.from_tensor_slices((x[:, ctx.replica_id * pb:(ctx.replica_id + 1) * pb],
                                                     y[:, ctx.replica_id * pb:(ctx.replica_id + 1) * pb]))
            return ds.skip(i).take(1)
        return fn

    for i in range(steps):
        batch = next(iter(repl.distribute_dataset(one_replica_each(i), global_batch_size=x.shape[1])))
        repl.run(step, args=batch)
    return traced, model


def test_keras_batch_norm_trains_with_the_fused_kernel_inside_run_by_default():
    repl = hvrep.Replicator("local")
    assert repl.batch_norm == "fused"
    traced, _ = _train(repl, steps=1)
    # Both replicas trace into one graph, each on its own thread: each fused both layers (forward and
    # gradient), and neither kept Keras' moments.
    assert len(traced) == repl.num_replicas == 2
    ops = traced[-1]
    assert ops.count(FUSED) == ops.count("FusedBatchNormGradV3") == 2 * 2, sorted(set(ops))
    assert "SquaredDifference" not in ops


def test_batch_norm_keras_keeps_keras_own_ops():
    traced, _ = _train(hvrep.Replicator("local", batch_norm="keras"), steps=1)
    assert FUSED not in traced[-1]
    assert traced[-1].count("SquaredDifference") == 2 * 2  # tf.nn.moments, which Keras' layer calls


def test_fused_and_keras_batch_norm_train_the_same_model():
    # Three SGD steps with momentum; outputs, gradients, weights and the moving statistics agree.
    _, fused = _train(hvrep.Replicator("local"))
    _, plain = _train(hvrep.Replicator("local", batch_norm="keras"))
    for a, b in zip(fused.weights, plain.weights, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=a.path)
    moving = [w for w in fused.weights if "moving" in w.path]
    assert len(moving) == 4 and all(np.any(np.asarray(w) != init) for w, init in
                                    zip(moving, [0.0, 1.0, 0.0, 1.0], strict=True))


def test_outside_run_keras_batch_norm_is_keras_own():
    _train(hvrep.Replicator("local"), steps=1)  # the dispatch is installed by now
    bn = keras.layers.BatchNormalization()
    graph = tf.function(lambda v: bn(v, training=True)).get_concrete_function(
        tf.TensorSpec((2, 3, 3, 4), tf.float32)).graph
    assert FUSED not in {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("case", ["inference", "float64", "mask", "synchronized", "renorm", "channels_first",
                                  "2d", "cross_replica", "symbolic_training", "eager_tensor_training"])
def test_what_the_fused_kernel_cannot_compute_stays_on_keras_path(case):
    shape, dtype, kwargs, call = (2, 3, 3, 4), tf.float32, {}, {"training": True}
    layer_class = keras.layers.BatchNormalization
    if case == "inference":
        call = {"training": False}
    elif case == "float64":
        dtype, kwargs = tf.float64, {"dtype": "float64"}
    elif case == "mask":
        call["mask"] = tf.ones((2, 3, 3), tf.bool)
    elif case in ("synchronized", "renorm"):
        kwargs = {case: True}
    elif case == "channels_first":
        kwargs = {"axis": 1}
    elif case == "2d":
        shape = (2, 4)
    elif case == "cross_replica":
        layer_class = CrossReplicaBatchNorm  # its own moments: cross-replica sums
    elif case == "eager_tensor_training":
        call = {"training": tf.constant(True)}  # captured by the trace: Keras reads it as True and trains
    layer = layer_class(**kwargs)
    layer.build(shape)
    x = tf.random.stateless_normal(shape, (1, 2), dtype=dtype)
    repl = hvrep.Replicator("local")
    seen: list[list[str]] = []

    @tf.autograph.experimental.do_not_convert  # Python semantics for the checks below
    def step(v):
        if case == "symbolic_training":
            # Keras' own layer refuses a tensor `training` in a graph; the dispatch must not change that.
            with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
                layer(v, training=tf.reduce_all(v > -1e9))
        else:
            layer(v, **call)
        seen.append([op.type for op in tf.compat.v1.get_default_graph().get_operations()])
        return tf.constant(0.0)

    repl.run(step, args=(x,))
    assert seen and all(FUSED not in ops for ops in seen)


def test_a_subclass_that_keeps_keras_moments_is_fused_and_its_own_call_runs():
    calls: list[int] = []

    class Logged(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            calls.append(1)
            return super().call(inputs, training=training, mask=mask)

    layer = Logged()
    layer.build((2, 3, 3, 4))
    seen: list[list[str]] = []

    def step(v):
        layer(v, training=True)
        seen.append([op.type for op in tf.compat.v1.get_default_graph().get_operations()])
        return tf.constant(0.0)

    hvrep.Replicator("local").run(step, args=(tf.ones((2, 3, 3, 4)),))
    assert calls and all(FUSED in ops for ops in seen)


def test_run_passes_keyword_arguments_through_the_fused_step():
    repl = hvrep.Replicator("local")
    out = repl.run(lambda a, *, scale: a * scale, args=(tf.constant(2.0),), kwargs={"scale": tf.constant(3.0)})
    assert repl.reduce(out, "sum") == 12.0


def test_an_unknown_batch_norm_names_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"batch_norm must be one of \('fused', 'keras'\), got 'cudnn'.*Fix"):
        hvrep.Replicator("local", batch_norm="cudnn")


@pytest.mark.parametrize("batch_norm", ["fused", "keras"])
def test_autograph_still_converts_the_step(batch_norm):
    # Python control flow on tensors in a step (and in a lambda) must still become graph control flow.
    repl = hvrep.Replicator("local", batch_norm=batch_norm)

    def step(x):
        if tf.reduce_sum(x) > 0:
            y = x * 2.0
        else:
            y = -x
        return y

    assert repl.reduce(repl.run(step, args=(tf.constant(3.0),)), "sum") == 12.0
    assert repl.reduce(repl.run(step, args=(tf.constant(-1.0),)), "sum") == 2.0
    flip = lambda x: x * 2.0 if tf.reduce_sum(x) > 0 else -x  # noqa: E731
    assert repl.reduce(repl.run(flip, args=(tf.constant(-1.0),)), "sum") == 2.0


def _ops_of_one_bn_step(repl, x):
    """The op types the trace of one training step through a built BatchNormalization made, and its output."""
    with repl.scope():
        bn = keras.layers.BatchNormalization(momentum=0.5)
        bn.build((None, 3, 3, 2))
    traced = []

    def step(t):
        out = bn(t, training=True)
        traced.append([op.type for op in tf.compat.v1.get_default_graph().get_operations()])
        return out

    out = repl.run(step, args=(x,))
    return traced[0], repl.reduce(out, "min")


def test_a_keras_outside_the_verified_releases_keeps_keras_own_batch_norm_with_one_warning(monkeypatch, caplog):
    from hvrep.compat import keras_versions

    monkeypatch.setattr(keras_versions, "KERAS_VERSION", "3.99.0")  # a release the replacement never saw
    monkeypatch.setattr(keras_versions, "_warned", set())
    x = tf.constant(np.random.default_rng(2).normal(size=(4, 3, 3, 2)).astype("float32"))
    with caplog.at_level("WARNING", logger="hvrep"):
        for _ in range(2):
            ops, _ = _ops_of_one_bn_step(hvrep.Replicator("local"), x)
            assert FUSED not in ops, "the fused kernel was used on an unverified Keras"
    warned = [r.getMessage() for r in caplog.records if "Keras 3.99.0" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "keeps Keras' own ops" in warned[0] and "Fix:" in warned[0]
    monkeypatch.setattr(keras_versions, "KERAS_VERSION", keras.version())  # the installed one: fused again
    ops, _ = _ops_of_one_bn_step(hvrep.Replicator("local"), x)
    assert FUSED in ops


def test_an_input_of_unknown_rank_keeps_keras_own_batch_norm_with_one_warning(monkeypatch, caplog):
    import traceback

    from hvrep.compat import keras_versions

    monkeypatch.setattr(keras_versions, "_warned", set())
    x = tf.constant(np.random.default_rng(2).normal(size=(4, 3, 3, 2)).astype("float32"))
    errors = {}
    with caplog.at_level("WARNING", logger="hvrep"):
        for batch_norm in ("keras", "fused", "fused"):
            repl = hvrep.Replicator("local", batch_norm=batch_norm)
            with repl.scope():
                bn = keras.layers.BatchNormalization(momentum=0.5)
                bn.build((None, 3, 3, 2))

            def step(t, bn=bn):
                # A reshape to a shape whose length is known only when it runs (a mask that is always true): the
                # rank is unknown when traced. Keras' Layer.__call__ refuses that itself; its call() (which a
                # custom layer's call may use) is where the fused path decides.
                unknown = tf.reshape(t, tf.boolean_mask(tf.shape(t), tf.random.uniform([4]) >= 0.0))
                assert unknown.shape.rank is None
                return bn.call(unknown, training=True)

            with pytest.raises(ValueError) as caught:  # Keras' own ops cannot update the moving statistics
                repl.run(step, args=(x,))
            errors[batch_norm] = caught.value
    # The fused path handed the input to Keras' own call (its len(inputs.shape) raised before): Keras' error.
    fused = "".join(traceback.format_exception(errors["fused"]))
    assert "in fusable" not in fused and "batch_normalization.py" in fused, fused[-3000:]
    assert str(errors["fused"]).splitlines()[-1] == str(errors["keras"]).splitlines()[-1]
    warned = [r.getMessage() for r in caplog.records if "unknown rank" in r.getMessage()]
    assert len(warned) == 1, warned
