"""The combination test's training and references, shared by the in-graph and multi-rank tests (issue 46).

Each case of ``hvrep.replica.support.pairwise_cases`` is a dict axis -> value. :func:`train` trains it through
hvrep on a Replicator for ``UPDATES`` updates; :func:`simulate` computes the same training in one process without
hvrep: the replicas' gradients one by one, combined as the case's algorithm says (the mean for synchronous SGD,
after a round trip through fp16/bf16 for compressed all-reduces; PowerSGD at full rank, where Algorithm 1's
P^ P^T M is M; local SGD's own copies averaged every H updates), and applied by the same kind of Keras optimizer
(a LossScaleOptimizer under fp16, which skips a non-finite update). :func:`difference` compares the two the way
the table's reference says (absolute for fp32, relative for fp16/bf16).

fp16 cases carry a forced overflow: one sample of replica 1's batch at update 1 is 1e5 (inf in float16), so
that update must be skipped and training go on finite. Resume cases stop at the middle update, write a
checkpoint, and go on with new objects restored from it, at the same world size or at another one.
"""

from __future__ import annotations

import tempfile

import keras
import numpy as np
import tensorflow as tf

import hvrep
import hvrep.keras
from hvrep.replica import support

B = 4  # per replica, per update
UPDATES = 4
K = 2  # micro-batches per update when accumulation = "k"
H = 2  # local steps when local_sgd = "H"
N_LOOP = 2  # steps per loop when steps_per_loop = "n"
OVERFLOW_UPDATE = 1
SEED = 5


def data(global_batch: int, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """UPDATES global batches of ``global_batch`` rows (see ``rows``)."""
    rng = np.random.default_rng(46)
    x = rng.normal(size=(UPDATES * global_batch, 6)).astype(np.float32)
    y = rng.integers(0, 5, size=(UPDATES * global_batch,)).astype(np.int32)
    return x, y


def rows(update: int, replica: int, micro: int, gb: int, b: int, k: int) -> np.ndarray:
    """Indices of replica ``replica``'s micro-batch ``micro`` of update ``update``: global batches of ``gb``
    consecutive rows, ``b`` per replica, in ``k`` micro-batches."""
    start = update * gb + replica * b + micro * (b // k)
    return np.arange(start, start + b // k)


def overflow(x: np.ndarray, case: dict, gb: int) -> np.ndarray:
    """fp16: one sample of update OVERFLOW_UPDATE (the second row: replica 0's) is inf in float16."""
    if case["precision"] == "fp16":
        x = x.copy()
        x[OVERFLOW_UPDATE * gb + 1, 0] = 1e5
    return x


def make_model(precision: str) -> keras.Model:
    keras.mixed_precision.set_global_policy({"fp16": "mixed_float16", "bf16": "mixed_bfloat16"}.get(
        precision, "float32"))
    keras.utils.set_random_seed(SEED)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(5),
                              keras.layers.Activation("linear", dtype="float32")])
    return model


def make_optimizer(case: dict) -> keras.optimizers.Optimizer:
    clip = {"global_clipnorm": 0.05} if case["clipping"] == "global-norm" else {}
    family = case["optimizer"]
    if family == "lars":
        from hvrep.optimizers import LARS

        opt = LARS(0.5, momentum=0.9, weight_decay=1e-4, **clip)
    elif family == "adam":
        opt = keras.optimizers.Adam(0.01, **clip)
    elif family == "nonlinear":
        opt = keras.optimizers.RMSprop(0.01, **clip)
    else:
        opt = keras.optimizers.SGD(0.1, momentum=0.9, **clip)
    assert support.optimizer_family(opt) == family and support.clipping(opt) == case["clipping"]
    return opt


def comm_config(case: dict) -> hvrep.CommConfig:
    kw: dict = {"compression": case["compression"], "accumulation_steps": K if case["accumulation"] == "k" else 1,
                "local_steps": H if case["local_sgd"] == "H" else None}
    if case["compression"] == "powersgd":
        kw.update(powersgd_rank=64, powersgd_min_compression_rate=0)  # full rank: Algorithm 1 gives the mean
    return hvrep.CommConfig(**kw)


def _loss(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True))


# ---- through hvrep ----------------------------------------------------------------------------------------------

class _Run:
    """One model, its wrapped optimizer and the loop's pieces on one Replicator."""

    def __init__(self, repl: hvrep.Replicator, case: dict, gb: int) -> None:
        self.repl, self.case, self.gb = repl, case, gb
        self.b = gb // repl.num_replicas
        self.fit = case["loop"] in ("fit", "elastic-fit")
        with repl.scope():
            self.model = make_model(case["precision"])
            inner = make_optimizer(case)
            if self.fit:
                self.opt = hvrep.keras.DistributedOptimizer(inner, repl, model=self.model)
                self.model.compile(optimizer=self.opt, loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), steps_per_execution=N_LOOP if case["steps_per_loop"] == "n" else 1)
                self.inner = self.opt.inner_optimizer
            else:
                if case["precision"] == "fp16":
                    inner = keras.optimizers.LossScaleOptimizer(inner)
                self.opt = repl.wrap_optimizer(inner, model=self.model)
                self.inner = inner
            self.opt.build(self.model.trainable_variables)
        self.state = None
        if case["loop"].startswith("elastic"):
            self.state = hvrep.elastic.State(repl, self.model, self.opt, update=0)

    def extras(self) -> dict:
        out = {}
        for name in ("accumulation", "powersgd"):
            if getattr(self.opt, name, None) is not None:
                out[name] = getattr(self.opt, name)
        local = getattr(self.opt, "local_sgd", None)
        if local is not None:
            out["local_sgd"] = local.state
        return out

    def checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(model=self.model, optimizer=self.inner, **self.extras())

    def before_save(self) -> None:
        """What a run does before a checkpoint: local SGD averages the optimizer's per-replica state (the models
        are equal at the round's end), PowerSGD averages its errors."""
        local = getattr(self.opt, "local_sgd", None)
        if local is not None:
            from hvrep.replica.localsgd import optimizer_state

            self.repl.run(lambda: local.average_now(optimizer_state(self.inner), model=False))
        psgd = getattr(self.opt, "powersgd", None)
        if psgd is not None:
            self.repl.run(psgd.average_errors)

    def train(self, x: np.ndarray, y: np.ndarray, first: int, last: int) -> None:
        """Updates first..last-1 (x, y: the whole run's data, n replicas x B per update)."""
        repl, case, gb, b = self.repl, self.case, self.gb, self.b
        k = K if case["accumulation"] == "k" else 1
        if self.fit:
            xs, ys = x[first * gb:last * gb], y[first * gb:last * gb]
            xs, ys = hvrep.keras.shard_arrays((xs, ys), repl, b)
            callbacks = [hvrep.keras.callbacks.CommitStateCallback(self.state, 1)] if self.state else []
            self.model.fit(xs, ys, batch_size=hvrep.keras.process_batch_size(repl, b), epochs=1, shuffle=False,
                           verbose=0, callbacks=callbacks)
            return
        per_run = N_LOOP if case["steps_per_loop"] == "n" else 1

        def input_fn(ctx: hvrep.InputContext) -> tf.data.Dataset:
            r = ctx.replica_id
            idx = np.concatenate([rows(u, r, m, gb, b, k) for u in range(first, last) for m in range(k)])
            return tf.data.Dataset.from_tensor_slices((x[idx], y[idx])).batch(b // k).batch(per_run)

        model, opt = self.model, self.opt

        def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            for j in range(per_run):  # steps_per_loop: several steps per host round-trip
                with tf.GradientTape() as tape:
                    value = _loss(model, xb[j], yb[j])
                    scaled = self.inner.scale_loss(value)
                grads = tape.gradient(scaled, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return value

        done = 0
        for xb, yb in repl.distribute_dataset(input_fn, global_batch_size=gb // k * per_run):
            repl.run(step, args=(xb, yb))
            done += per_run
            if self.state is not None and done % k == 0:
                self.state.update = first + done // k
                self.state.commit()
        assert done == (last - first) * k, done

    def weights(self) -> list[np.ndarray]:
        return [np.asarray(v.numpy(), np.float64) for v in self.model.trainable_variables]


def train(repl: hvrep.Replicator, case: dict, other_world: hvrep.Replicator | None = None) -> list[np.ndarray]:
    """The case trained through hvrep on ``repl``; a resume case stops at the middle update and goes on, with new
    objects restored from a checkpoint, on ``repl`` ("same-world") or ``other_world`` ("other-world"), keeping the
    global batch."""
    gb = repl.num_replicas * B
    x, y = data(gb, 1)
    x = overflow(x, case, gb)
    try:
        run = _Run(repl, case, gb)
        if case["resume"] == "fresh":
            run.train(x, y, 0, UPDATES)
            return run.weights()
        half = UPDATES // 2
        run.train(x, y, 0, half)
        run.before_save()
        after = other_world if case["resume"] == "other-world" else repl
        assert after is not None
        with tempfile.TemporaryDirectory() as own:
            folder = repl.broadcast_object(own)
            path = run.checkpoint().write(f"{folder}/ckpt") if repl.is_chief else None
            path = repl.broadcast_object(path)
            resumed = _Run(after, case, gb)
            resumed.checkpoint().read(path).assert_existing_objects_matched()
            repl.broadcast_object(0)  # every rank has read before the chief's folder goes
        resumed.train(x, y, half, UPDATES)
        return resumed.weights()
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ---- the reference, in one process --------------------------------------------------------------------------

def _compress(grads: list[list[tf.Tensor]], compression: str) -> list[tf.Tensor]:
    """The mean over replicas of ``grads[replica][variable]``, as a compressed all-reduce computes it."""
    n = len(grads)
    if compression in ("fp16", "bf16"):
        dt = tf.float16 if compression == "fp16" else tf.bfloat16
        total = [tf.cast(g, dt) for g in grads[0]]
        for r in range(1, n):
            total = [t + tf.cast(g, dt) for t, g in zip(total, grads[r], strict=True)]
        return [tf.cast(t, tf.float32) / n for t in total]
    return [tf.add_n([grads[r][i] for r in range(n)]) / n for i in range(len(grads[0]))]


def simulate(case: dict, n: int, n_after: int | None = None) -> list[np.ndarray]:
    """The reference of ``case`` for n replicas (n_after from the middle update on for "other-world")."""
    k = K if case["accumulation"] == "k" else 1
    x, y = data(n * B, 1)
    x = overflow(x, case, n * B)
    local = case["local_sgd"] == "H"
    copies = n if local else 1
    models = [make_model(case["precision"]) for _ in range(copies)]
    opts = []
    for m in models:
        o = make_optimizer(case)
        if case["precision"] == "fp16":
            o = keras.optimizers.LossScaleOptimizer(o)
        o.build(m.trainable_variables)
        opts.append(o)
    world = n
    for u in range(UPDATES):
        if u == UPDATES // 2 and case["resume"] != "fresh":
            if local:  # the optimizer state averaged before the checkpoint
                _average([_optimizer_state(o) for o in opts])
            if case["resume"] == "other-world" and n_after is not None and n_after != world:
                world = n_after
                if local:
                    models, opts = _resize(models, opts, world, case)
        per = n * B // world  # the global batch is kept
        grads = []
        for r in range(world):
            model = models[r if local else 0]
            opt = opts[r if local else 0]
            micro = []
            for m in range(k):
                lo = u * n * B + r * per + m * (per // k)
                idx = np.arange(lo, lo + per // k)
                with tf.GradientTape() as tape:
                    scaled = opt.scale_loss(_loss(model, tf.constant(x[idx]), tf.constant(y[idx])))
                micro.append(tape.gradient(scaled, model.trainable_variables))
            grads.append([tf.add_n([g[i] for g in micro]) / k for i in range(len(micro[0]))])
        if local:
            for r in range(world):
                opts[r].apply_gradients(zip(grads[r], models[r].trainable_variables, strict=True))
            if (u + 1) % H == 0:
                _average([m.trainable_variables for m in models])
        else:
            mean = _compress(grads, case["compression"])
            opts[0].apply_gradients(zip(mean, models[0].trainable_variables, strict=True))
    keras.mixed_precision.set_global_policy("float32")
    return [np.asarray(v.numpy(), np.float64) for v in models[0].trainable_variables]


def _optimizer_state(opt: keras.optimizers.Optimizer) -> list:
    """The per-replica optimizer state local SGD averages before a checkpoint (momentum, Adam's moments)."""
    return [v for v in opt.variables if len(v.shape) >= 1 and tf.as_dtype(v.dtype).is_floating]


def _average(groups: list[list]) -> None:
    for vs in zip(*groups, strict=True):
        mean = tf.add_n([tf.convert_to_tensor(v) for v in vs]) / len(vs)
        for v in vs:
            v.assign(mean)


def _resize(models: list, opts: list, world: int, case: dict) -> tuple[list, list]:
    """Local SGD at another world size: every copy starts from the (equal) model and averaged optimizer state."""
    models2, opts2 = [], []
    for _ in range(world):
        m = make_model(case["precision"])
        for a, b in zip(m.variables, models[0].variables, strict=True):
            a.assign(b)
        o = make_optimizer(case)
        o.build(m.trainable_variables)
        for a, b in zip(o.variables, opts[0].variables, strict=True):
            a.assign(b)
        models2.append(m)
        opts2.append(o)
    return models2, opts2


def difference(got: list[np.ndarray], want: list[np.ndarray], case: dict) -> tuple[float, float]:
    """(the difference the case's reference measures, its tolerance)."""
    ref = support.reference(case)
    assert all(np.all(np.isfinite(g)) for g in got), "non-finite weights"
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))
    if ref.relative:
        diff /= max(float(np.max(np.abs(b))) for b in want)
    return diff, ref.tolerance
