"""`hvrep train` with local SGD (comm.local_steps): its step, its checkpoint preparation and its settings."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train.steps import Runner

B, K, CLASSES = 4, 3, 5


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def _train(comm: hvrep.CommConfig, steps: int = K) -> tuple[hvrep.Replicator, Runner]:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(steps * 2 * B, 6)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps * 2 * B,)).astype(np.int32)
    repl = hvrep.Replicator("local", config=comm)
    with repl.scope():
        model, opt = _model(), keras.optimizers.SGD(0.2, momentum=0.9)
    runner = Runner(repl, model, opt, num_classes=CLASSES, label_smoothing=0.1, fp16=False, jit_compile=False)

    def input_fn(ctx):
        r = ctx.replica_id
        idx = np.concatenate([np.arange(k * 2 * B + r * B, k * 2 * B + (r + 1) * B) for k in range(steps)])
        return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(B)

    for xb, yb in repl.distribute_dataset(input_fn, global_batch_size=2 * B):
        runner.train(xb, yb)
    return repl, runner


def _copies(repl: hvrep.Replicator, variables) -> list[list[np.ndarray]]:
    local = repl._backend.strategy.experimental_local_results
    return [[p.numpy() for p in local(getattr(v, "value", v))] for v in variables]


def test_the_apps_step_with_h1_equals_its_synchronous_step():
    sync_repl, sync = _train(hvrep.CommConfig())
    want = [v.numpy() for v in sync.model.weights]
    sync_repl.close()
    repl, runner = _train(hvrep.CommConfig(local_steps=1))
    for parts, w in zip(_copies(repl, runner.model.weights), want, strict=True):
        for p in parts:
            np.testing.assert_allclose(p, w, atol=1e-5)
    repl.close()


def test_prepare_checkpoint_mid_round_leaves_one_copy_of_model_and_momentum():
    repl, runner = _train(hvrep.CommConfig(local_steps=2))  # 3 steps: one past the last synchronisation
    assert runner.local_sgd is not None and int(runner.local_sgd.step.numpy()) == 3
    momenta = [v for v in runner.optimizer.variables if len(v.shape) >= 1]
    before = _copies(repl, runner.model.weights + momenta)
    assert max(float(np.max(np.abs(a - b))) for a, b in before) > 1e-4  # the replicas diverged
    runner.prepare_checkpoint()
    after = _copies(repl, runner.model.weights + momenta)
    for (a, b), (a0, b0) in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, (a0 + b0) / 2, rtol=1e-6, atol=1e-7)
    assert runner.local_sgd_record() == {"local_steps": 2, "outer_optimizer": None}
    repl.close()


def test_evaluation_mid_round_sees_each_replicas_copy_at_the_mean_and_puts_them_back():
    # In-graph (2 replicas in one process): the evaluator's averaging reads and restores every replica's copy.
    repl, runner = _train(hvrep.CommConfig(local_steps=2))  # 3 steps: mid-round
    local = runner._evaluator.local_sgd
    before = _copies(repl, runner.model.weights)
    assert max(float(np.max(np.abs(a - b))) for a, b in before) > 1e-4  # the replicas diverged
    with local.averaged_model(repl.run) as averaged:
        inside = _copies(repl, runner.model.weights)
    assert averaged
    for (a, b), (a0, b0) in zip(inside, before, strict=True):
        np.testing.assert_allclose(a, (a0 + b0) / 2, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(a, b)
    for parts, parts0 in zip(_copies(repl, runner.model.weights), before, strict=True):
        for p, p0 in zip(parts, parts0, strict=True):
            np.testing.assert_array_equal(p, p0)
    repl.close()


def test_checkpoint_cadence_must_be_a_multiple_of_h_and_the_fit_loop_is_refused():
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps=6 is not a multiple of comm.local_steps=4.*"
                                          r"Fix: checkpoint.every_steps=8"):
        configs.build("demo", ["comm.local_steps=4", "checkpoint.every_steps=6"])
    cfg = configs.build("demo", ["comm.local_steps=4", "comm.outer_optimizer=nesterov", "comm.outer_lr=0.5",
                                 "checkpoint.every_steps=8"])
    assert (cfg.comm.local_steps, cfg.comm.outer_optimizer, cfg.comm.outer_lr) == (4, "nesterov", 0.5)
    with pytest.raises(ConfigError, match=r"train.loop=fit with comm.local_steps=4 cannot be combined.*Fix: "
                                          "train.loop=custom"):
        configs.build("demo", ["comm.local_steps=4", "train.loop=fit"])
