"""Gradient compression under fp16 dynamic loss scaling with one overflow step, shared by the in-graph
(tests/unit/replica/test_powersgd_loss_scale.py) and multi-rank (tests/multirank/cases_powersgd.py) tests.

A two-Dense model trains :data:`STEPS` steps through a ``keras.optimizers.LossScaleOptimizer``. At
:data:`OVERFLOW_STEP` the replicas named overflow: one target of their batch is :data:`HUGE`, whose loss-scaled
gradient is inf in float32 (the unscaled one would be finite), as an fp16 activation overflow gives. Every replica
must skip that step and halve the scale once, as Keras' LossScaleOptimizer does on one replica, and training must
go on finite and equal to :func:`reference`: one process, no loss scaling, every worker's gradients reduced by the
NumPy Algorithm 1 (tests/powersgd_sim.py) or their exact mean, that step left out.

The model computes in float32 and the scale is a power of two, so unscaling is exact: what is tested is the
bookkeeping of the scale and of the skip, and the reference holds to fp32's 1e-5, not fp16's 2e-3.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import hvrep
import hvrep.keras
from tests.powersgd_sim import Algorithm1

STEPS, OVERFLOW_STEP, B, SEED = 6, 1, 4, 46
HUGE = np.float32(1e36)  # (1e36)^2 overflows the loss; 2e36 x 2^15 / 12 the gradient
SHAPES = [(4, 6), (6,), (6, 3), (3,)]  # two Dense layers' kernels and biases: the kernels are compressed
INITIAL_SCALE = 2.0**15  # LossScaleOptimizer's default


def config(compression: str = "powersgd", **kw) -> hvrep.CommConfig:
    if compression != "powersgd":
        return hvrep.CommConfig(compression=compression, **kw)
    return hvrep.CommConfig(compression="powersgd", powersgd_rank=1, powersgd_min_compression_rate=0, **kw)


def data(workers: int, overflow: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """x[step][worker] ([B, 4]) and y[step][worker] ([B, 3]); the ``overflow`` workers' first target at
    OVERFLOW_STEP is HUGE."""
    rng = np.random.default_rng(46)
    x = rng.normal(size=(STEPS, workers, B, 4)).astype(np.float32)
    y = rng.normal(size=(STEPS, workers, B, 3)).astype(np.float32)
    for w in overflow:
        y[OVERFLOW_STEP, w, 0, 0] = HUGE
    return x, y


def make_model() -> keras.Model:
    keras.utils.set_random_seed(SEED)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _loss(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(model(x, training=True) - y))  # = keras' "mse"


def reference(workers: int, powersgd_rank: int | None, skip: tuple[int, ...] = (OVERFLOW_STEP,),
              start_step: int = 0) -> tuple[list[np.ndarray], Algorithm1 | None]:
    """The weights after STEPS steps but ``skip``, unscaled, each step's gradients reduced by Algorithm 1 at
    ``powersgd_rank`` (None: their mean; exact before ``start_step`` steps were taken); and the Algorithm1 (its
    errors and Q's)."""
    x, y = data(workers)
    model, opt = make_model(), make_optimizer()
    algorithm = Algorithm1(SHAPES, workers, powersgd_rank, start_step=start_step) if powersgd_rank else None
    for t in range(STEPS):
        if t in skip:
            continue
        grads = []
        for w in range(workers):
            with tf.GradientTape() as tape:
                loss = _loss(model, x[t, w], y[t, w])
            grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
        reduced = algorithm.step(grads) if algorithm else [np.mean([g[i] for g in grads], axis=0)
                                                          for i in range(len(SHAPES))]
        opt.apply_gradients(zip([tf.constant(r, tf.float32) for r in reduced], model.trainable_variables,
                                strict=True))
    return [v.numpy() for v in model.weights], algorithm


def local_values(repl: hvrep.Replicator, variable) -> list[np.ndarray]:
    """Every copy of ``variable`` this process holds (in-graph: one per replica)."""
    strategy = getattr(repl._backend, "strategy", None)
    value = getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable
    parts = strategy.experimental_local_results(value) if strategy else (value,)
    return [np.asarray(p.numpy() if hasattr(p, "numpy") else p) for p in parts]


def state_of(repl: hvrep.Replicator, state) -> list[np.ndarray]:
    """PowerSGD's state, every copy this process holds: errors, Q's, step counter, world size."""
    return [c for v in [*state.errors, *state.qs, state.step, state.world_size] for c in local_values(repl, v)]


class Run:
    """What a run leaves: this process's weights (every replica's copy), the LossScaleOptimizer, the PowerSGD state
    (or None) and PowerSGD's state after each step (custom loop only)."""

    def __init__(self, repl, model, optimizer, powersgd, states) -> None:
        self.weights = [local_values(repl, v) for v in model.weights]
        self.iterations = int(optimizer.iterations.numpy())
        self.scale = float(optimizer.dynamic_scale.numpy())
        self.powersgd = powersgd
        self.states = states


def custom_loop(repl: hvrep.Replicator, overflow: tuple[int, ...], micro: int = 1) -> Run:
    """``repl.wrap_optimizer(LossScaleOptimizer(SGD))`` in a step of ``repl.run``; each replica takes its worker's
    batch of :func:`data` (as ``micro`` micro-batches with ``CommConfig.accumulation_steps=micro``)."""
    n = repl.num_replicas
    x, y = data(n, overflow)
    with repl.scope():
        model = make_model()
        lso = keras.optimizers.LossScaleOptimizer(make_optimizer())
        opt = repl.wrap_optimizer(lso)
        opt.build(model.trainable_variables)
    mine = list(range(n)) if repl.num_processes == 1 else [repl.rank]

    def step(xs: tf.Tensor, ys: tf.Tensor) -> None:
        who = hvrep.replica_id() if repl.num_processes == 1 else 0
        with tf.GradientTape() as tape:
            scaled = lso.scale_loss(_loss(model, tf.gather(xs, who), tf.gather(ys, who)))
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    states = []
    rows = B // micro
    for t in range(STEPS):
        for j in range(micro):
            part = slice(j * rows, (j + 1) * rows)
            repl.run(step, args=(tf.constant(x[t, mine, part]), tf.constant(y[t, mine, part])))
        if opt.powersgd is not None:
            states.append(state_of(repl, opt.powersgd))
    return Run(repl, model, lso, opt.powersgd, states)


def fit(repl: hvrep.Replicator, overflow: tuple[int, ...]) -> Run:
    """``model.fit`` with ``hvrep.keras.DistributedOptimizer(LossScaleOptimizer(SGD))``, batch B per replica."""
    n = repl.num_replicas
    x, y = data(n, overflow)
    with repl.scope():
        model = make_model()
        opt = hvrep.keras.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(make_optimizer()), repl)
        model.compile(optimizer=opt, loss="mse")
    xs, ys = hvrep.keras.shard_arrays((x.reshape(-1, 4), y.reshape(-1, 3)), repl, B)
    model.fit(xs, ys, batch_size=hvrep.keras.process_batch_size(repl, B), epochs=1, shuffle=False, verbose=0,
              callbacks=[hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl)])
    return Run(repl, model, opt, opt.powersgd, [])


def max_difference(copies: list[list[np.ndarray]], want: list[np.ndarray]) -> float:
    """The largest |difference| between any replica's copy of any weight and ``want``."""
    return max(float(np.max(np.abs(c - w))) for cs, w in zip(copies, want, strict=True) for c in cs)


def max_relative_difference(copies: list[list[np.ndarray]], want: list[np.ndarray]) -> float:
    """:func:`max_difference` relative to each weight's largest magnitude."""
    return max(float(np.max(np.abs(c - w)) / np.max(np.abs(w))) for cs, w in zip(copies, want, strict=True)
               for c in cs)
