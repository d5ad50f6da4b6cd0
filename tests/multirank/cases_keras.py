"""``model.fit`` with ``hvrep.keras`` on the horovod backend, on every rank (see runner.py). Fails by raising.

Every case runs the same collectives on every rank before it asserts, so a
failure on one rank does not leave the other waiting.
"""

import keras
import numpy as np
import tensorflow as tf

import hvrep
import hvrep.keras
from tests import fidelity, keras_fit

_repl = None


def repl() -> hvrep.Replicator:
    global _repl
    if _repl is None:
        _repl = hvrep.Replicator("horovod")
    return _repl


def _rank() -> int:
    return hvrep.resolve_placement().rank


def _spread(values) -> float:
    """Max over ranks of |this rank's values - rank 0's| (every rank gets the answer)."""
    r = repl()
    flat = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])
    root = flat.copy()
    bcast = r.run(lambda t: hvrep.broadcast(t, root=0), args=(tf.constant(root),)).numpy()
    return float(r.reduce(np.array(np.max(np.abs(bcast - flat))), "max"))


def _equals_one_process(kind, **kwargs):
    r = repl()
    got, history = keras_fit.replicated(r, kind, **kwargs)
    want, losses = keras_fit.reference(kind, r.num_replicas)
    weight_spread, loss_spread = _spread(got), _spread([history["loss"], history["accuracy"]])
    assert r.backend == "horovod" and r.num_replicas == 2
    assert fidelity.max_difference(got, want) <= 1e-5, (kind, fidelity.max_difference(got, want))
    assert weight_spread == 0.0, weight_spread
    assert loss_spread == 0.0, loss_spread  # MetricAverageCallback: the same epoch logs on every rank
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)


def case_keras_fit_momentum_equals_one_process_with_twice_the_batch():
    _equals_one_process("momentum")


def case_keras_fit_models_built_outside_scope_from_different_seeds():
    # Only BroadcastGlobalVariablesCallback makes the ranks start equal here.
    _equals_one_process("momentum", in_scope=False, init_seed=fidelity.SEED + 1000 * _rank())


def case_keras_fit_lars_clipping_and_loss_scale_optimizer_inside():
    for kind in ("lars", "clipnorm", "global_clipnorm", "loss_scale"):
        _equals_one_process(kind, init_seed=fidelity.SEED + 1000 * _rank())


def case_keras_fit_steps_per_execution_and_jit_compile_true():
    # jit_compile=True would put Horovod's ops into XLA (no CPU kernels): the callbacks turn it off.
    _equals_one_process("momentum", steps_per_execution=2, compile_kwargs={"jit_compile": True})


def case_keras_mixed_float16_in_both_orders_when_one_rank_overflows():
    # Rank 1's first batch overflows float16; rank 0's does not. The loss scaler's finite check sees the
    # reduced gradients, so both ranks skip that step and halve the scale together (no hang, no drift).
    r = repl()
    policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for make in (lambda: keras.optimizers.SGD(0.01),
                     lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))):
            x, y = keras_fit.data(r.num_replicas)
            xs, ys = hvrep.keras.shard_arrays((x, y), r, keras_fit.B)
            if _rank() == 1:
                xs = xs.copy()
                xs[: keras_fit.B] *= 3e4
            with r.scope():
                model = fidelity.make_model()
                opt = hvrep.keras.DistributedOptimizer(make(), r)
                model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            assert model.optimizer is opt
            model.fit(xs, ys, batch_size=keras_fit.B, epochs=1, shuffle=False, verbose=0,
                      callbacks=[hvrep.keras.callbacks.MetricAverageCallback(r)])
            scale = float(opt.dynamic_scale.numpy())
            spread = _spread([w for w in model.get_weights()] + [[scale]])
            assert spread == 0.0, spread
            assert scale < 2.0**15, scale  # the overflowing step was skipped and the scale halved
            assert all(np.isfinite(w).all() for w in model.get_weights())
    finally:
        keras.mixed_precision.set_global_policy(policy)


def case_keras_evaluate_gives_global_metrics():
    r = repl()
    x, y = keras_fit.data(r.num_replicas)
    rows = keras_fit.STEPS * r.num_replicas * keras_fit.B
    with r.scope():
        model = fidelity.make_model()
        model.compile(optimizer=hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), r),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    xs, ys = hvrep.keras.shard_arrays((x, y), r, keras_fit.B)
    local = model.evaluate(xs, ys, batch_size=keras_fit.B, verbose=0, return_dict=True)
    both = model.evaluate(xs, ys, batch_size=keras_fit.B, verbose=0, return_dict=True,
                          callbacks=[hvrep.keras.callbacks.MetricAverageCallback(r)])
    spread_local = _spread([local["loss"]])
    spread = _spread([both["loss"], both["accuracy"]])
    whole = model.evaluate(x[:rows], y[:rows], batch_size=rows, verbose=0, return_dict=True)
    assert spread_local > 0, "each rank's own shard should give its own loss"
    assert spread == 0.0, spread
    np.testing.assert_allclose(both["loss"], whole["loss"], rtol=1e-5)
    np.testing.assert_allclose(both["accuracy"], whole["accuracy"], rtol=1e-6)


def case_keras_shard_dataset_gives_every_rank_the_same_steps():
    r = repl()
    x, y = keras_fit.data(r.num_replicas)
    ds = hvrep.keras.shard_dataset(tf.data.Dataset.from_tensor_slices((x, y)), r, keras_fit.B)
    got, _ = keras_fit.replicated(r, "momentum")
    with r.scope():
        model = fidelity.make_model()
        opt = hvrep.keras.DistributedOptimizer(fidelity.make_optimizer("momentum"), r)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(ds, epochs=keras_fit.EPOCHS, verbose=0)
    steps = r.reduce(np.array([int(opt.iterations.numpy())]), "max")[0]
    assert int(opt.iterations.numpy()) == steps == keras_fit.EPOCHS * keras_fit.STEPS, steps
    assert fidelity.max_difference([w.numpy() for w in model.weights], got) <= 1e-6
