"""hvrep.elastic's State, run and the Keras callbacks in one process (the local backend): what a commit keeps,
what a restore puts back, which errors are a lost worker, and that any other error propagates.

The multi-process behaviour (kills, joins, drops under horovodrun's elastic driver) is
tests/multirank/test_elastic.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError


def _model_and_optimizer():
    # Plain variables (made outside the local backend's scope, which mirrors them), as on the horovod backend.
    repl = hvrep.Replicator("local")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    return repl, model, optimizer


def _values(state):
    return [np.array(v.numpy()) for v in state.variables]


def test_restore_puts_back_the_last_commit_after_in_place_updates():
    repl, model, optimizer = _model_and_optimizer()
    state = hvrep.elastic.State(repl, model, optimizer, step=0, segments=[])
    assert optimizer.built and len(state.variables) == len(model.variables) + len(optimizer.variables)
    state.step, state.segments = 3, [[2, 8, 3]]
    state.commit()
    committed = _values(state)
    # In-place writes after the commit: an optimizer step (momentum, iterations) and assign_add on the weights.
    x, y = tf.random.normal((8, 3)), tf.random.normal((8, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                  strict=True))
    for v in model.trainable_variables:
        v.assign_add(tf.ones_like(v))
    state.step = 7
    state.segments.append([1, 8, 1])
    assert any(not np.array_equal(a, b) for a, b in zip(_values(state), committed, strict=True))
    assert state._rollback_distance() == {"step": 4.0}
    state.restore()
    for a, b in zip(_values(state), committed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert state.step == 3 and state.segments == [[2, 8, 3]]


def test_lost_worker_is_horovods_failure_only():
    from horovod.common.exceptions import HorovodInternalError

    assert hvrep.elastic.lost_worker(HorovodInternalError("x"))
    assert hvrep.elastic.lost_worker(tf.errors.UnknownError(None, None, "Detected at node HorovodAllreduce_x_0"))
    assert hvrep.elastic.lost_worker(tf.errors.UnknownError(None, None, "Horovod has been shut down. This was ..."))
    assert not hvrep.elastic.lost_worker(tf.errors.UnknownError(None, None, "some other kernel failed"))
    assert not hvrep.elastic.lost_worker(ValueError("HorovodAllreduce"))


def test_run_lets_every_other_error_through():
    repl, model, optimizer = _model_and_optimizer()
    state = hvrep.elastic.State(repl, model, optimizer, step=0)

    @hvrep.elastic.run
    def train(state):
        state.step += 1
        raise ValueError("the user's own bug")

    with pytest.raises(ValueError, match="the user's own bug"):
        train(state)
    assert train.__name__ == "train"

    @hvrep.elastic.run
    def finish(state, k):
        return state.step + k

    assert finish(state, 10) == 10  # the sync at the start set step back to its last commit (0)


def test_a_model_without_variables_and_clashing_names_are_refused():
    repl = hvrep.Replicator("local")
    with pytest.raises(ConfigError, match="has no variables yet"):
        hvrep.elastic.State(repl, keras.Sequential([keras.layers.Dense(2)]))
    _, model, _ = _model_and_optimizer()
    with pytest.raises(ConfigError, match="clash"):
        hvrep.elastic.State(repl, model, commit=1)


def test_the_fit_callbacks_keep_epoch_and_batch_and_commit_on_schedule():
    repl, model, optimizer = _model_and_optimizer()
    model.compile(optimizer=optimizer, loss="mse")
    state = hvrep.elastic.State(repl, model, optimizer, epoch=0, batch=0)
    commits = []
    state.save = lambda save=state.save: (commits.append((state.epoch, state.batch)), save())[1]
    callbacks = [hvrep.keras.callbacks.UpdateBatchStateCallback(state),
                 hvrep.keras.callbacks.UpdateEpochStateCallback(state),
                 hvrep.keras.callbacks.CommitStateCallback(state, batches_per_commit=2)]
    x, y = np.random.default_rng(0).normal(size=(20, 3)), np.zeros((20, 2))
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)  # 5 batches an epoch
    assert commits == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)], commits
    assert (state.epoch, state.batch) == (2, 0)
    # A later fit that starts where the state stands (initial_epoch) counts on from there.
    model.fit(x, y, batch_size=4, initial_epoch=2, epochs=3, callbacks=callbacks, verbose=0)
    assert state.epoch == 3
    with pytest.raises(ConfigError, match="batches_per_commit must be >= 1"):
        hvrep.keras.callbacks.CommitStateCallback(state, batches_per_commit=0)


def test_auto_picks_horovod_under_the_elastic_driver_even_alone():
    # HOROVOD_ELASTIC=1 is what horovodrun's elastic driver sets in its workers: a world of one may grow.
    # (Without it, one process is "local": tests/unit/replica/test_backend_choice.py.)
    import os
    import subprocess
    import sys

    code = "import hvrep; r = hvrep.Replicator(); print(r.backend, r.num_replicas)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "3", "HOROVOD_ELASTIC": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-2:] == ["horovod", "1"], res.stdout


# --- what a step carries besides the model and the optimizer (issue 46) ----------------------------------------

def _plain(v):
    # A Keras 3 variable wraps a tf.Variable (its .value); a tf.Variable's own .value is a method.
    return v if isinstance(v, tf.Variable) else v.value


def _carried_config(**kw) -> hvrep.CommConfig:
    return hvrep.CommConfig(accumulation_steps=2, compression="powersgd", powersgd_rank=1,
                            powersgd_min_compression_rate=0, **kw)


def _wrapped_run(repl):
    """A model and ``repl.wrap_optimizer(LossScaleOptimizer(SGD with momentum))`` (accumulation 2, PowerSGD rank 1;
    the loss scale doubles every 2 finite updates), its step, and the batches it trains on."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), keras.layers.Dense(3)])
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=8.0,
                                                 dynamic_growth_steps=2)
    optimizer = repl.wrap_optimizer(scaled)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(scaled.scale_loss(loss), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    rng = np.random.default_rng(5)
    batches = [(tf.constant(rng.normal(size=(8, 4)), tf.float32), tf.constant(rng.normal(size=(8, 3)), tf.float32))
               for _ in range(9)]
    return model, scaled, optimizer, step, batches


def test_the_state_tracks_accumulation_powersgd_and_the_loss_scale():
    repl = hvrep.Replicator("horovod", config=_carried_config())
    model, scaled, optimizer, _, _ = _wrapped_run(repl)
    state = hvrep.elastic.State(repl, model, optimizer, step=0)  # builds the wrapper's state too
    tracked = {id(_plain(v)) for v in state.variables}
    carried = [optimizer.accumulation.micro_step, *optimizer.accumulation.accumulators, optimizer.powersgd.step,
               optimizer.powersgd.world_size, *optimizer.powersgd.errors, *optimizer.powersgd.qs]
    assert optimizer.powersgd.errors and optimizer.powersgd.qs
    missing = [v.name for v in carried if id(v) not in tracked]
    assert not missing, f"the elastic state does not roll back {missing}"
    for v in (scaled.dynamic_scale, scaled.step_counter, scaled.iterations):
        assert id(_plain(v)) in tracked, v.name

    # model.fit's wrapper: PowerSGD's state and the loss scale (the inner LossScaleOptimizer's). Without
    # accumulation, which fit's DistributedOptimizer refuses (hvrep.replica.support).
    fit_repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(
        compression="powersgd", powersgd_rank=1, powersgd_min_compression_rate=0))
    fit_optimizer = hvrep.keras.DistributedOptimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)), fit_repl)
    state = hvrep.elastic.State(fit_repl, model, fit_optimizer, epoch=0)
    tracked = {id(_plain(v)) for v in state.variables}
    assert fit_optimizer.powersgd is not None
    for v in [*fit_optimizer.powersgd.variables, fit_optimizer.inner_optimizer.dynamic_scale]:
        assert id(_plain(v)) in tracked, v.name


def test_a_rollback_mid_accumulation_reruns_bit_exactly():
    # Committed after micro-step 3 (mid-update, k=2), 5 more micro-steps (3 updates, PowerSGD steps, loss-scale
    # growth), rolled back, and the same 5 again: the same weights and carried state, bit for bit, as the
    # first time.
    repl = hvrep.Replicator("horovod", config=_carried_config())
    model, scaled, optimizer, step, batches = _wrapped_run(repl)
    state = hvrep.elastic.State(repl, model, optimizer, step=0)
    for x, y in batches[:3]:
        repl.run(step, args=(x, y))
    state.commit()
    assert int(optimizer.accumulation.micro_step.numpy()) == 3

    def rest():
        for x, y in batches[3:8]:
            repl.run(step, args=(x, y))
        return [np.array(v.numpy()) for v in
                [*model.variables, *scaled.variables, *optimizer.accumulation.variables,
                 *optimizer.powersgd.variables]]

    first = rest()
    # Updates at micro-steps 2 (before the commit), 4, 6 and 8: the scale doubled after the 2nd and the 4th.
    assert float(scaled.dynamic_scale.numpy()) == 32.0
    state.restore()
    assert int(optimizer.accumulation.micro_step.numpy()) == 3 and float(scaled.dynamic_scale.numpy()) == 8.0
    again = rest()
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_local_sgd_is_refused_by_the_state():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=2))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = repl.wrap_optimizer(keras.optimizers.SGD(0.1), model=model)
    with pytest.raises(ConfigError, match=r"local_steps=2 cannot be combined.*Fix: local_steps=None"):
        hvrep.elastic.State(repl, model, optimizer, step=0)
