"""``model.fit`` with ``hvrep.keras`` on the local backend (2 logical CPU devices, in-graph)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
import hvrep.keras
from hvrep.errors import ConfigError
from tests import fidelity, keras_fit


@pytest.fixture
def repl():
    return hvrep.Replicator("local")


@pytest.mark.parametrize("kind", fidelity.KINDS)
def test_fit_on_two_replicas_equals_fit_on_one_with_twice_the_batch(repl, kind):
    # Keras divides the loss by 2 under the strategy and would sum: the wrapper's sum is the one reduction.
    got, history = keras_fit.replicated(repl, kind)
    want, losses = keras_fit.reference(kind, repl.num_replicas)
    assert repl.num_replicas == 2
    assert fidelity.max_difference(got, want) <= 1e-5
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)


def test_steps_per_execution_gives_the_same_weights(repl):
    got, _ = keras_fit.replicated(repl, "momentum", steps_per_execution=2)
    want, _ = keras_fit.reference("momentum", repl.num_replicas)
    assert fidelity.max_difference(got, want) <= 1e-5


def test_a_model_built_outside_scope_is_refused_with_the_fix(repl):
    with pytest.raises(ConfigError, match=r"inside `with repl\.scope"):
        keras_fit.replicated(repl, "sgd", in_scope=False)


def test_compile_accepts_it_and_it_delegates_what_fit_calls(repl):
    inner = keras.optimizers.SGD(0.25, momentum=0.9)
    opt = hvrep.keras.DistributedOptimizer(inner, repl)
    assert isinstance(opt, keras.optimizers.Optimizer) and opt.inner_optimizer is inner
    model = fidelity.make_model()
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
    assert float(opt.learning_rate.numpy()) == 0.25
    opt.learning_rate = 0.5
    assert float(inner.learning_rate.numpy()) == 0.5
    opt.build(model.trainable_variables)
    assert all(any(v is w for v in opt.variables) for w in inner.variables)
    assert opt.iterations is inner.iterations


def test_get_config_leaves_the_replicator_out_and_from_config_binds_the_latest(repl):
    opt = hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), repl)
    config = opt.get_config()
    assert "replicator" not in str(config)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(again, hvrep.keras.DistributedOptimizer)
    assert again.replicator is repl and again.inner_optimizer.momentum == 0.9


def test_mixed_float16_in_both_orders_is_one_loss_scale_optimizer_inside(repl):
    policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        auto = hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
        explicit = hvrep.keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                                                    repl)
        for opt in (auto, explicit):
            assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
            assert isinstance(opt.inner_optimizer, keras.optimizers.LossScaleOptimizer)
            with repl.scope():
                model = fidelity.make_model()
                model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            assert model.optimizer is opt  # compile did not wrap it a second time
            x, y = keras_fit.data(2)
            model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)
            assert np.all([np.isfinite(w).all() for w in model.get_weights()])
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_loss_scale_optimizer_around_it_is_refused_with_the_fix(repl):
    opt = hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
    with pytest.raises(ConfigError, match=r"DistributedOptimizer\(LossScaleOptimizer\(opt\), repl\)"):
        keras.optimizers.LossScaleOptimizer(opt)


def test_wrong_arguments_are_refused(repl):
    with pytest.raises(ConfigError, match=r"keras\.optimizers\.Optimizer"):
        hvrep.keras.DistributedOptimizer("sgd", repl)
    with pytest.raises(ConfigError, match=r"hvrep\.Replicator"):
        hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), None)
    opt = hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
    with pytest.raises(ConfigError, match="already"):
        hvrep.keras.DistributedOptimizer(opt, repl)


def test_shard_arrays_gives_every_replica_the_same_steps_in_global_batch_order():
    class Fake:
        num_replicas, num_processes = 2, 2

        def __init__(self, rank):
            self.rank = rank

    x = np.arange(21)
    parts = [hvrep.keras.shard_arrays(x, Fake(r), 4) for r in range(2)]
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert hvrep.keras.shard_arrays(x, Fake(0), 4).tolist() == parts[0].tolist()
    with pytest.raises(ConfigError, match="per_replica_batch_size must be an int >= 1, got 0"):
        hvrep.keras.shard_arrays(x, Fake(0), 0)


def test_the_fit_helpers_name_their_batch_per_replica_and_keep_the_old_name_with_a_warning():
    class Fake:
        num_replicas, num_processes, rank = 4, 2, 1  # two in-graph replicas in each of two processes

    x = np.arange(40)
    new = hvrep.keras.shard_arrays(x, Fake(), per_replica_batch_size=3)
    assert new.tolist() == [6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23, 30, 31, 32, 33, 34, 35]
    assert hvrep.keras.process_batch_size(Fake(), per_replica_batch_size=3) == 6
    ds = tf.data.Dataset.from_tensor_slices(x)
    batches = [b.tolist() for b in hvrep.keras.shard_dataset(ds, Fake(), per_replica_batch_size=3).as_numpy_iterator()]
    assert batches == [new[i:i + 6].tolist() for i in range(0, len(new), 6)]
    with pytest.warns(DeprecationWarning, match=r"shard_arrays\(batch_size=\.\.\.\) is deprecated.*per replica.*"
                                                r"per_replica_batch_size=3"):
        assert hvrep.keras.shard_arrays(x, Fake(), batch_size=3).tolist() == new.tolist()
    with pytest.warns(DeprecationWarning, match=r"process_batch_size\(batch_size=\.\.\.\) is deprecated"):
        assert hvrep.keras.process_batch_size(Fake(), batch_size=3) == 6
    with pytest.warns(DeprecationWarning, match=r"shard_dataset\(batch_size=\.\.\.\) is deprecated"):
        old = hvrep.keras.shard_dataset(ds, Fake(), batch_size=3)
    assert [b.tolist() for b in old.as_numpy_iterator()] == batches
    with pytest.raises(ConfigError, match=r"per_replica_batch_size=3 and batch_size=4 are the same argument"), \
            pytest.warns(DeprecationWarning):
        hvrep.keras.shard_arrays(x, Fake(), 3, batch_size=4)


def test_warmup_callback_gives_horovods_learning_rates(repl):
    # Horovod: lr = initial / size * (e' * (size - 1) / warmup + 1), e' = epoch + (batch + 1) / steps_per_epoch.
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    with repl.scope():
        model = fidelity.make_model()
        model.compile(optimizer=hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = keras_fit.data(2)
    warmup = hvrep.keras.callbacks.LearningRateWarmupCallback(repl, initial_lr=0.4, warmup_epochs=2)
    history = model.fit(x[:24], y[:24], batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[warmup, Record()])
    want = [0.4 / 2 * ((e + (b + 1) / 3) * 1 / 2 + 1) for e in range(2) for b in range(3)] + [0.4] * 3
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    np.testing.assert_allclose(history.history["lr"], [want[2], want[5], 0.4], rtol=1e-6)


def test_on_a_keras_outside_the_verified_releases_it_warns_once_that_the_wrong_order_may_go_unrefused(
        repl, monkeypatch, caplog):
    from hvrep.compat import keras_versions

    monkeypatch.setattr(keras_versions, "_warned", set())
    with caplog.at_level("WARNING", logger="hvrep"):
        hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
        assert not caplog.records  # the verified Keras: nothing to say
        monkeypatch.setattr(keras_versions, "KERAS_VERSION", "3.99.0")
        for _ in range(2):
            hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "Keras 3.99.0" in warned[0], warned
    assert "DistributedOptimizer(LossScaleOptimizer(opt), repl)" in warned[0] and "Fix:" in warned[0]
