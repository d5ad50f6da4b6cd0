"""Local SGD checked against a single-process simulation, shared by the in-graph and multi-rank tests.

The simulation keeps one Keras model and one optimizer per worker, trains worker r on its B rows of every
global batch, and every H steps replaces every worker's weights and batch-norm statistics by their mean, or,
with DiLoCo's outer step, moves the round's start by SGD with Nesterov momentum on start - mean (in NumPy).
The replicated run goes through ``Replicator.wrap_optimizer(opt, model=model)``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import hvrep

K, B, SEED = 8, 4, 4321


def data(num_replicas: int, steps: int = K) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(steps * num_replicas * B, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=(steps * num_replicas * B,)).astype(np.int32)
    return x, y


def make_model(bn: bool, seed: int = SEED) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu")]
    if bn:  # momentum 0.5: the moving statistics move visibly within 8 steps
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    layers += [keras.layers.Flatten(), keras.layers.Dense(10)]
    return keras.Sequential(layers)


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _loss(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    logits = model(x, training=True)
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def _rows(k: int, n: int, r: int) -> slice:
    return slice(k * n * B + r * B, k * n * B + (r + 1) * B)


def simulate(num_replicas: int, h: int, *, bn: bool, outer: tuple[float, float] | None = None,
             steps: int = K) -> list[np.ndarray]:
    """Every worker's weights (``model.weights`` order) after ``steps`` steps, ending on a synchronisation."""
    assert steps % h == 0
    x, y = data(num_replicas, steps)
    models = [make_model(bn) for _ in range(num_replicas)]
    opts = [make_optimizer() for _ in range(num_replicas)]
    n_train = len(models[0].trainable_variables)
    start = [v.numpy() for v in models[0].trainable_variables]
    momentum = [np.zeros_like(a) for a in start]
    for k in range(steps):
        for r, (model, opt) in enumerate(zip(models, opts, strict=True)):
            with tf.GradientTape() as tape:
                value = _loss(model, x[_rows(k, num_replicas, r)], y[_rows(k, num_replicas, r)])
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if (k + 1) % h:
            continue
        variables = [m.trainable_variables + [v for v in m.non_trainable_variables if v.dtype.startswith("float")]
                     for m in models]
        means = [np.mean([vs[i].numpy() for vs in variables], axis=0) for i in range(len(variables[0]))]
        if outer is not None:
            lr, mu = outer
            for i in range(n_train):
                delta = start[i] - means[i]
                momentum[i] = mu * momentum[i] + delta
                means[i] = start[i] - lr * (delta + mu * momentum[i])
                start[i] = means[i]
        for vs in variables:
            for v, m in zip(vs, means, strict=True):
                v.assign(m)
    return [v.numpy() for v in models[0].weights]


def synchronous(num_replicas: int, steps: int = K) -> list[np.ndarray]:
    """One replica, global batch num_replicas*B, plain TensorFlow (no batch norm)."""
    x, y = data(num_replicas, steps)
    model, opt = make_model(False), make_optimizer()
    gb = num_replicas * B
    for k in range(steps):
        with tf.GradientTape() as tape:
            value = _loss(model, x[k * gb:(k + 1) * gb], y[k * gb:(k + 1) * gb])
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return [v.numpy() for v in model.weights]


def replicated(repl: hvrep.Replicator, *, bn: bool, steps: int = K, init_seed: int = SEED,
               start: int = 0, parts: bool = False, built: tuple | None = None) -> list:
    """The same training through ``repl.wrap_optimizer(opt, model=model)`` (the Replicator's CommConfig sets
    H); returns this process's weights, or with ``parts`` every copy it holds (in-graph: one per replica) as
    ``[[copy of weight i for each replica] for each weight]``. ``built``: (model, optimizer) to go on with;
    ``start``: the first global batch to train on."""
    n = repl.num_replicas
    x, y = data(n, start + steps)
    if built is None:
        with repl.scope():
            model = make_model(bn, init_seed)
            opt = repl.wrap_optimizer(make_optimizer(), model=model)
    else:
        model, opt = built

    def input_fn(ctx: hvrep.InputContext) -> tf.data.Dataset:
        b, r = ctx.per_replica_batch_size, ctx.replica_id
        idx = np.concatenate([np.arange(k * n * b + r * b, k * n * b + (r + 1) * b)
                              for k in range(start, start + steps)])
        return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(b)

    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            value = _loss(model, xb, yb)
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return value

    for xb, yb in repl.distribute_dataset(input_fn, global_batch_size=n * B):
        assert np.isfinite(repl.reduce(repl.run(step, args=(xb, yb)), "mean"))
    replicated.last = (model, opt)
    if not parts:
        return [np.asarray(v.numpy()) for v in model.weights]
    strategy = getattr(repl._backend, "strategy", None)
    return [[np.asarray(p.numpy()) for p in (strategy.experimental_local_results(v.value) if strategy else (v,))]
            for v in model.weights]


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b, strict=True))


def fit(repl: hvrep.Replicator, *, bn: bool, steps: int = K, parts: bool = False) -> list:
    """The same training through Keras' ``fit`` and ``hvrep.keras.DistributedOptimizer(opt, repl, model=model)``:
    one epoch of ``steps`` global batches, no shuffle; returns as :func:`replicated`."""
    import hvrep.keras

    n = repl.num_replicas
    x, y = data(n, steps)
    with repl.scope():
        model = make_model(bn)
        model.compile(optimizer=hvrep.keras.DistributedOptimizer(make_optimizer(), repl, model=model),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    xs, ys = hvrep.keras.shard_arrays((x, y), repl, B)
    model.fit(xs, ys, batch_size=hvrep.keras.process_batch_size(repl, B), epochs=1, shuffle=False, verbose=0,
              callbacks=[hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl)])
    if not parts:
        return [np.asarray(v.numpy()) for v in model.weights]
    strategy = getattr(repl._backend, "strategy", None)
    return [[np.asarray(p.numpy()) for p in (strategy.experimental_local_results(v.value) if strategy else (v,))]
            for v in model.weights]


def resume_is_exact(repl: hvrep.Replicator, folder: str, *, first: int = 6, then: int = 4) -> float:
    """Trains ``first`` steps (with H = 4: mid-round), averages the replicas' state for a checkpoint, saves it
    (the chief), goes on ``then`` steps; then a new model and optimizer restored from the checkpoint train the
    same ``then`` steps. Returns the largest difference between the two runs' copies on any replica (0.0:
    bit-identical), the same on every rank."""
    sim_model_bn = True  # the batch-norm statistics go through the checkpoint too
    replicated(repl, bn=sim_model_bn, steps=first)
    model, opt = replicated.last
    mid = opt.local_sgd.mid_round
    repl.run(lambda: opt.average_local_state(model=mid))
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt.inner, local_sgd=opt.local_sgd.state)
    path = ckpt.write(f"{folder}/ckpt") if repl.is_chief else None
    path = repl.broadcast_object(path)
    went_on = replicated(repl, bn=sim_model_bn, steps=then, start=first, parts=True, built=(model, opt))
    with repl.scope():
        model2 = make_model(sim_model_bn, SEED + 1)  # other initial weights: all must come from the checkpoint
        opt2 = repl.wrap_optimizer(make_optimizer(), model=model2)
        opt2.inner.build(model2.trainable_variables)
    tf.train.Checkpoint(model=model2, optimizer=opt2.inner, local_sgd=opt2.local_sgd.state).read(path).assert_consumed()
    resumed = replicated(repl, bn=sim_model_bn, steps=then, start=first, parts=True, built=(model2, opt2))
    mine = max(max(float(np.max(np.abs(a - b))) for a, b in zip(u, v, strict=True))
               for u, v in zip(went_on, resumed, strict=True))
    return float(repl.reduce(tf.constant(mine, tf.float64), "max"))  # every rank's copies, the same answer
