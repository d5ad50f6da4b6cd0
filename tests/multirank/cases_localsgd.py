"""Local SGD on the horovod backend, 2 ranks, against a single-process simulation (see runner.py). Fails by raising.

Every case runs the same collectives on every rank before it asserts. Each builds its own Replicator
(``CommConfig.local_steps`` is the Replicator's) and closes it, leaving the shared one of the other case
modules untouched.
"""

import tempfile

import numpy as np

import hvrep
from tests import localsgd_sim as sim


def _same_everywhere(repl, got: list) -> float:
    """Max difference between this rank's weights and every other rank's (the same number on every rank)."""
    flat = np.concatenate([np.ravel(w) for w in got]).astype(np.float64)
    return float(np.max(np.abs(repl.reduce(flat, "max") - repl.reduce(flat, "min"))))


def _check(comm: dict, want: list, run=lambda r: sim.replicated(r, bn=True)):
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(**comm))
    try:
        got = run(repl)
        spread = _same_everywhere(repl, got)
    finally:
        repl.close()
    assert sim.max_difference(got, want) <= 1e-5, sim.max_difference(got, want)
    assert spread == 0.0, spread


def case_h1_without_outer_optimizer_equals_synchronous_momentum_sgd():
    _check({"local_steps": 1}, sim.synchronous(2), lambda r: sim.replicated(r, bn=False))


def case_h4_equals_two_simulated_workers_batch_norm_statistics_included():
    _check({"local_steps": 4}, sim.simulate(2, 4, bn=True))


def case_diloco_outer_nesterov_step_equals_the_simulation():
    _check({"local_steps": 4, "outer_optimizer": "nesterov"}, sim.simulate(2, 4, bn=True, outer=(0.7, 0.9)))


def case_keras_fit_with_distributed_optimizer_equals_the_simulation():
    _check({"local_steps": 4}, sim.simulate(2, 4, bn=True), lambda r: sim.fit(r, bn=True))


def case_a_checkpoint_saved_mid_round_resumes_bit_identically():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=4, outer_optimizer="nesterov"))
    try:
        with tempfile.TemporaryDirectory() as own:
            folder = repl.broadcast_object(own)  # the chief's folder: one machine, every rank reads it
            diff = sim.resume_is_exact(repl, folder)
            repl.reduce(np.zeros(1), "sum")  # the chief's folder outlives every rank's read
    finally:
        repl.close()
    assert diff == 0.0, diff


def _evaluation_run(repl, data, val_images: int, evaluate_at: int | None, steps: int = 4):
    """A Runner on a small model with local SGD (H=4): rank r trains on labels r (the replicas' models diverge);
    evaluated through the Runner after step ``evaluate_at``. Returns (final weights, what the check saw)."""
    import keras
    import tensorflow as tf

    from hvrep.train.steps import Evaluator, Runner

    keras.utils.set_random_seed(7)
    with repl.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                                  keras.layers.BatchNormalization(momentum=0.5), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    runner = Runner(repl, model, optimizer, num_classes=10, label_smoothing=0.0, fp16=False, jit_compile=False)
    rng = np.random.default_rng(100 + repl.rank)
    seen = {}
    for step in range(1, steps + 1):
        x = tf.constant(rng.normal(size=(8, 8, 8, 3)).astype(np.float32))
        runner.train(x, tf.fill([8], repl.rank))
        if step != evaluate_at:
            continue
        own = [w.copy() for w in model.get_weights()]
        seen["spread"] = _same_everywhere(repl, own)
        seen["got"] = runner.evaluate(data, val_images, 16)
        seen["unchanged"] = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), own, strict=True))
        # The reference: every rank sets the mean of the replicas' weights (summed by the host, halved) and
        # evaluates it without local SGD in the picture; then its own weights go back.
        model.set_weights([repl.reduce(w, "sum") / repl.num_replicas for w in own])
        seen["mean"] = Evaluator(repl, model, 10).evaluate(data, val_images, 16)
        model.set_weights(own)
    return [w.copy() for w in model.get_weights()], seen


def case_an_evaluation_mid_round_is_of_the_averaged_model_and_leaves_training_unchanged():
    from hvrep.data import num_examples, write_demo
    from hvrep.train import config as configs

    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=4))
    try:
        with tempfile.TemporaryDirectory() as own:
            root = repl.broadcast_object(own)  # the chief's folder: one machine, every rank reads it
            if repl.is_chief:
                write_demo(root, size=8)
            repl.reduce(np.zeros(1), "sum")
            data = configs.build("demo", [f"data.data_dir={root}/tfrecord", "data.image_size=8",
                                          "data.resize_size=8"]).data
            val_images = num_examples(data, "val")
            plain, _ = _evaluation_run(repl, data, val_images, evaluate_at=None)
            evaluated, seen = _evaluation_run(repl, data, val_images, evaluate_at=3)
            repl.reduce(np.zeros(1), "sum")  # the chief's folder outlives every rank's read
    finally:
        repl.close()
    assert seen["spread"] > 0, "the replicas' models should differ mid-round"
    assert seen["got"] == seen["mean"], seen
    assert seen["unchanged"] == 0.0, seen
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(evaluated, plain, strict=True))
    assert diff == 0.0, diff


def _fit_with_validation(repl, validate: bool, steps: int = 3):
    """Keras fit with local SGD (H=4) for one epoch of ``steps`` (not a multiple of H: it ends mid-round), rank r
    training on labels r (the replicas' models diverge), with fit's validation on ``validate``. Returns the
    model, this rank's own weights after the last step (before fit's end) and fit's history."""
    import keras

    import hvrep.keras

    class OwnWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.weights = [w.copy() for w in self.model.get_weights()]

    x, _ = sim.data(repl.num_replicas, steps)
    rows = x[repl.rank * steps * sim.B:(repl.rank + 1) * steps * sim.B]
    val_x, val_y = sim.data(1, 4)
    with repl.scope():
        model = sim.make_model(bn=True)
        model.compile(optimizer=hvrep.keras.DistributedOptimizer(sim.make_optimizer(), repl, model=model),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    own = OwnWeights()
    history = model.fit(rows, np.full(len(rows), repl.rank, np.int32), batch_size=sim.B, epochs=1, shuffle=False,
                        verbose=0, validation_data=(val_x, val_y) if validate else None, validation_batch_size=8,
                        callbacks=[hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
                                   hvrep.keras.callbacks.MetricAverageCallback(repl), own])
    return model, own.weights, history.history


def _evaluate_alone(weights, val_x, val_y) -> list:
    """A one-process Keras evaluation of ``weights`` (no Replicator, no local SGD): loss, accuracy."""
    import keras

    model = sim.make_model(bn=True)
    model.set_weights(weights)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model.evaluate(val_x, val_y, batch_size=8, verbose=0)


def case_keras_fit_validates_and_ends_on_the_replicas_mean_model():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=4))
    try:
        val_x, val_y = sim.data(1, 4)
        model, own, history = _fit_with_validation(repl, validate=True)
        spread_before_end = _same_everywhere(repl, own)
        # The replicas' mean, summed by the host: what fit's validation and every evaluation after fit must see.
        mean = [repl.reduce(w.astype(np.float64), "sum") / repl.num_replicas for w in own]
        after = model.get_weights()
        spread_after = _same_everywhere(repl, after)
        evaluated = model.evaluate(val_x, val_y, batch_size=8, verbose=0)  # Keras' own, no hvrep callback
        evaluations = [repl.reduce(np.array(evaluated), "max"), repl.reduce(np.array(evaluated), "min")]
        validated = [history["val_loss"][0], history["val_accuracy"][0]]
        validations = [repl.reduce(np.array(validated), "max"), repl.reduce(np.array(validated), "min")]
        plain_model, _, _ = _fit_with_validation(repl, validate=False)
        unchanged = max(float(np.max(np.abs(a - b))) for a, b in zip(after, plain_model.get_weights(), strict=True))
    finally:
        repl.close()
    reference = _evaluate_alone([m.astype(np.float32) for m in mean], val_x, val_y)
    assert spread_before_end > 0, "rank r trains on labels r: the models should differ mid-round"
    assert spread_after == 0.0, spread_after  # fit ended on one model
    assert sim.max_difference(after, mean) <= 1e-6, sim.max_difference(after, mean)
    assert np.allclose(evaluated, reference, rtol=1e-5, atol=1e-6), (evaluated, reference)
    assert np.array_equal(evaluations[0], evaluations[1]), evaluations  # every rank evaluated the same model
    assert np.array_equal(validations[0], validations[1]), validations  # every rank validated the same model
    assert np.allclose(validated, reference, rtol=1e-5, atol=1e-6), (validated, reference)
    assert unchanged == 0.0, unchanged  # validating, in a copy, changed nothing in training
