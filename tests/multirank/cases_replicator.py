"""The replica API on the horovod backend, on every rank (see runner.py). Fails by raising.

Every case calls the same collectives on every rank before it asserts, so a
failure on one rank does not leave the other waiting in a collective.
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError, ReplicaMismatchError
from tests import fidelity

_repl = None


def repl() -> hvrep.Replicator:
    global _repl
    if _repl is None:
        _repl = hvrep.Replicator("horovod")
    return _repl


@contextlib.contextmanager
def replicator_with(config: hvrep.CommConfig):
    global _repl
    repl().close()
    _repl = None
    _repl = hvrep.Replicator("horovod", config=config)
    try:
        yield _repl
    finally:
        _repl.close()
        _repl = None


def _rank() -> int:
    return hvrep.resolve_placement().rank


def _same_on_all_ranks(weights):
    """Max difference between this rank's weights and rank 0's, as seen by every rank."""
    r = repl()
    flat = np.concatenate([w.ravel() for w in weights]).astype(np.float32)
    out = r.run(lambda t: hvrep.broadcast(t, root=0), args=(tf.constant(flat),))
    return r.reduce(tf.reduce_max(tf.abs(out - flat)), "max")


def _fidelity(kind, wrap=False, loss="function"):
    r = repl()
    # A different initialisation on each rank: scope() must broadcast rank 0's.
    got = fidelity.replicated(r, kind, init_seed=fidelity.SEED + 1000 * _rank(), wrap=wrap, loss=loss)
    want = fidelity.reference(kind, r.num_replicas, loss=loss)
    drift = _same_on_all_ranks(got)
    assert r.num_replicas == 2 and r.backend == "horovod"
    assert fidelity.max_difference(got, want) <= 1e-5, fidelity.max_difference(got, want)
    assert drift == 0.0, drift


def case_fidelity_plain_sgd():
    _fidelity("sgd")


def case_fidelity_momentum():
    _fidelity("momentum")


def case_fidelity_lars():
    _fidelity("lars")


def case_fidelity_wrap_optimizer():
    _fidelity("momentum", wrap=True)


def case_fidelity_clipnorm_global_clipnorm_and_loss_scaling():
    for kind in ("clipnorm", "global_clipnorm", "loss_scale"):
        _fidelity(kind)
        _fidelity(kind, wrap=True)


def case_fidelity_keras_loss_object():
    _fidelity("sgd", loss="object")
    _fidelity("loss_scale", loss="object", wrap=True)


def case_fidelity_gradient_accumulation_over_two_micro_batches():
    # 2 replicas x 2 micro-batches of B/2, one all-reduce per 2 micro-steps == 1 replica x 2B.
    with replicator_with(hvrep.CommConfig(accumulation_steps=2, fusion_threshold_bytes=128 << 20)) as r:
        before = r.collective_calls
        got = fidelity.replicated(r, "momentum", init_seed=fidelity.SEED + 1000 * _rank(), wrap=True, micro=2)
        calls = r.collective_calls - before
    want = fidelity.reference("momentum", 2)
    drift = _same_on_all_ranks(got)
    assert fidelity.max_difference(got, want) <= 1e-5, fidelity.max_difference(got, want)
    assert drift == 0.0, drift
    # One fused all-reduce in the conditional update; tf.function traces a step that
    # creates variables (the accumulators) twice, hence up to 2 - never one per tensor.
    assert calls in (1, 2), calls


def case_is_chief_on_exactly_one_rank():
    r = repl()
    chiefs = r.reduce(tf.constant(int(r.is_chief)), "sum")
    assert chiefs == 1, chiefs


def case_collectives_on_nested_structures_and_dtypes():
    r, me = repl(), _rank()
    v = float(me + 1)  # 1 on rank 0, 2 on rank 1

    def step():
        value = {
            "f32": tf.fill([2, 3], v),
            "pair": (tf.constant([v, -v], tf.float16), tf.constant([me + 1, 7], tf.int32)),
            "bf16": tf.constant([v], tf.bfloat16),
            "unused": None,
        }
        return {op: hvrep.all_reduce(value, op) for op in ("sum", "mean", "max", "min")} | {
            "gather0": hvrep.all_gather(tf.fill([1, 2], v), axis=0),
            "gather1": hvrep.all_gather(tf.fill([2, 1], v), axis=1),
            "gather_bf16": hvrep.all_gather(tf.constant([v], tf.bfloat16), axis=0),
            "bcast": hvrep.broadcast((tf.constant(v), tf.constant([me], tf.int32)), root=1),
            "id": hvrep.replica_id(),
            "n": tf.constant(hvrep.num_replicas()),
        }

    out = r.run(step)
    expect = {"sum": (3.0, 3), "mean": (1.5, 1), "max": (2.0, 2), "min": (1.0, 1)}
    for op, (fv, iv) in expect.items():
        o = out[op]
        np.testing.assert_allclose(o["f32"].numpy(), np.full([2, 3], fv))
        assert o["f32"].dtype == tf.float32
        np.testing.assert_allclose(o["pair"][0].numpy(), [fv, -{"max": 1.0, "min": 2.0}.get(op, fv)])
        assert o["pair"][0].dtype == tf.float16
        np.testing.assert_array_equal(o["pair"][1].numpy(), [iv, {"sum": 14}.get(op, 7)])
        assert o["pair"][1].dtype == tf.int32  # integer mean keeps the dtype: 3 // 2 == 1
        assert o["bf16"].dtype == tf.bfloat16
        np.testing.assert_allclose(tf.cast(o["bf16"], tf.float32).numpy(), [fv])
        assert o["unused"] is None
    np.testing.assert_array_equal(out["gather0"].numpy(), [[1, 1], [2, 2]])
    np.testing.assert_array_equal(out["gather1"].numpy(), [[1, 2], [1, 2]])
    np.testing.assert_array_equal(tf.cast(out["gather_bf16"], tf.float32).numpy(), [1, 2])
    assert float(out["bcast"][0]) == 2.0 and out["bcast"][1].numpy().tolist() == [1]
    assert int(out["id"]) == me and int(out["n"]) == 2


def case_reduce_returns_the_same_numpy_on_every_rank():
    r, me = repl(), _rank()
    got = r.reduce({"a": tf.constant([me + 1.0, 4.0]), "b": tf.constant(me + 2)}, "mean")
    np.testing.assert_allclose(got["a"], [1.5, 4.0])
    assert isinstance(got["a"], np.ndarray) and got["b"] == 2  # (2 + 3) // 2


def case_a_small_eager_reduce_is_one_collective_and_equals_horovods_all_reduce():
    # A small eager reduce travels in its call check's allgather: one Horovod collective whatever its leaves and
    # dtypes (was one for the check and one per leaf, each waiting out Horovod's fusion window); its values are
    # those of Horovod's all-reduce leaf by leaf, which larger values still take.
    from hvrep.replica.backends import horovod as backend

    r, me = repl(), _rank()
    hvd = r._backend.hvd
    calls = []
    real = {name: getattr(hvd, name) for name in ("allgather", "allreduce")}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return call

    value = {"f32": tf.constant([me + 1.0, 0.25 * (me + 1)]), "i32": tf.constant(me + 2),
             "f64": np.float64(me + 1) / 3, "f16": tf.constant([[me + 0.5]], tf.float16),
             "bf16": tf.constant([me + 1.0], tf.bfloat16), "i64": np.array([me, -7], np.int64), "none": None}
    limit = backend.GATHERED_REDUCE_BYTES
    try:
        for name in real:
            setattr(hvd, name, counting(name))
        for op in ("sum", "mean", "max", "min"):
            before = len(calls)
            small = r.reduce(value, op)
            assert calls[before:] == ["allgather"], (op, calls[before:])
            backend.GATHERED_REDUCE_BYTES = 0  # every leaf through Horovod's all-reduce, as before
            before = len(calls)
            large = r.reduce(value, op)
            backend.GATHERED_REDUCE_BYTES = limit
            assert calls[before:] == ["allgather"] + ["allreduce"] * 6, (op, calls[before:])
            assert small["none"] is None and large["none"] is None
            for k, v in value.items():
                if v is None:
                    continue
                a, b = np.asarray(small[k]), np.asarray(large[k])
                assert a.dtype == b.dtype and a.shape == b.shape == np.shape(v), (op, k, a, b)
                np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64), err_msg=f"{op} {k}")
        assert r.reduce({"n": tf.constant(1)}, "sum")["n"] == 2
    finally:
        backend.GATHERED_REDUCE_BYTES = limit
        for name, fn in real.items():
            setattr(hvd, name, fn)


def case_fused_path_issues_far_fewer_collectives_than_tensors():
    shapes = [(3, 3, 4, 8), (8,), (8,), (128, 10), (10,)] * 4  # 20 tensors

    def step():
        return hvrep.all_reduce([tf.ones(s) for s in shapes], "mean")

    calls = {}
    for name, cfg in {"fused": hvrep.CommConfig(fusion_threshold_bytes=128 << 20),
                      "unfused": hvrep.CommConfig(fusion_threshold_bytes=0), "default": hvrep.CommConfig(),
                      "groups": hvrep.CommConfig(num_groups=3)}.items():
        with replicator_with(cfg) as r:
            before = r.collective_calls
            out = r.run(step)
            calls[name] = r.collective_calls - before
            assert all(np.allclose(o.numpy(), 1.0) for o in out)
    assert calls == {"fused": 1, "unfused": 20, "default": 1, "groups": 3}, calls


def case_fp16_compression_is_within_fp16_precision():
    rng = np.random.default_rng(_rank())
    mine = [rng.normal(size=s).astype(np.float32) for s in [(64, 32), (32,), (5, 5, 3)]]
    with replicator_with(hvrep.CommConfig(compression="fp16")) as r:
        got = r.run(lambda xs: hvrep.all_reduce(xs, "mean", compress=True), args=([tf.constant(m) for m in mine],))
        exact = r.run(lambda xs: [hvrep.all_gather(x[None], 0) for x in xs], args=([tf.constant(m) for m in mine],))
    for g, e in zip(got, exact, strict=True):
        assert g.dtype == tf.float32
        np.testing.assert_allclose(g.numpy(), e.numpy().mean(axis=0), rtol=2e-3, atol=2e-3)


def case_fp16_compression_never_reaches_cross_replica_batch_norms_statistics():
    # 64 x 32 x 32 positions per rank: a count of 65,536, past fp16's largest value (65,504); compressed, the
    # output was NaN. Compression is for gradients (compress=True); statistics travel in float32.
    x = np.random.default_rng(5 + _rank()).normal(1.0, 2.0, size=(64, 32, 32, 2)).astype(np.float32)
    outs = {}
    for compression in ("none", "fp16"):
        with replicator_with(hvrep.CommConfig(compression=compression)) as r:
            with r.scope():
                crbn = hvrep.layers.CrossReplicaBatchNorm(momentum=0.5)
                crbn.build((None, 32, 32, 2))
            outs[compression] = r.run(lambda t, crbn=crbn: crbn(t, training=True), args=(tf.constant(x),)).numpy()
            outs[compression + " moving_variance"] = crbn.moving_variance.numpy()
    assert np.isfinite(outs["fp16"]).all()
    np.testing.assert_array_equal(outs["fp16"], outs["none"])
    np.testing.assert_array_equal(outs["fp16 moving_variance"], outs["none moving_variance"])


def case_bf16_compression_is_refused_on_horovod_with_the_fix():
    try:
        with replicator_with(hvrep.CommConfig(compression="bf16")):
            pass
    except ConfigError as e:  # the support table's (hvrep.replica.support), before Horovod starts a backend
        assert "fp16" in str(e) and "bfloat16" in str(e)
    else:
        raise AssertionError("bf16 compression was accepted on horovod")


def case_shapes_that_differ_across_ranks_raise_instead_of_hanging():
    n = 3 + _rank()  # 3 on rank 0, 4 on rank 1

    def step():
        return hvrep.all_reduce(tf.ones([n]), "sum")

    try:
        repl().run(step)
    except ReplicaMismatchError as e:
        assert "float32[3]" in str(e) and "float32[4]" in str(e), e
    else:
        raise AssertionError("mismatched collectives were not detected")


def case_variables_outside_scope_and_lazily_built_layers_start_identical():
    # The commonest mistake (a model built outside scope(), different on each rank) and a layer whose
    # weights are created inside the first step: both broadcast from rank 0 before that step runs.
    r = repl()
    keras.utils.set_random_seed(100 + _rank())
    outside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    lazy = keras.layers.Dense(2)  # built by its first call, inside the step
    opt = keras.optimizers.SGD(0.1)
    x = tf.constant(np.random.default_rng(_rank()).normal(size=(5, 3)).astype(np.float32))

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(lazy(outside(x)) ** 2)
        variables = outside.trainable_variables + lazy.trainable_variables
        grads = hvrep.all_reduce(tape.gradient(loss, variables), "mean")
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.run(step, args=(x,))
    weights = [v.numpy() for v in outside.weights + lazy.weights]
    drift = _same_on_all_ranks(weights)
    assert drift == 0.0, drift
    said = [str(w.message) for w in caught if "Replicator.scope()" in str(w.message)]
    assert (len(said) == 1) == r.is_chief, said
    assert not said or "broadcast rank 0's values" in said[0]


def case_a_rank_conditional_reduce_is_refused_on_every_rank():
    # Eager collectives pair by a per-process counter: a call made on one rank only would pair
    # with a different call on the other. Both ranks must raise the same clear error.
    r = repl()
    try:
        if _rank() == 0:
            r.reduce(tf.constant([1.0]), "sum")
        else:
            r.reduce(tf.constant([2.0]), "mean")
    except ReplicaMismatchError as e:
        text = str(e)
        assert "rank 0: reduce(sum) at cases_replicator.py:" in text, text
        assert "rank 1: reduce(mean) at cases_replicator.py:" in text, text
    else:
        raise AssertionError("a rank-conditional reduce was not detected")
    # The ranks are still in step afterwards.
    assert r.reduce(tf.constant(1.0), "sum") == 2.0


def case_horovod_settings_for_a_later_replicator_are_refused():
    repl()  # Horovod is running
    try:
        hvrep.Replicator("horovod", config=hvrep.CommConfig(cycle_time_ms=7.5))
    except ConfigError as e:
        assert "cycle_time_ms=7.5" in str(e) and "first Replicator" in str(e), e
    else:
        raise AssertionError("a cycle time Horovod would ignore was accepted")
    # hvrep's own bucket size applies to every Replicator: not refused.
    hvrep.Replicator("horovod", config=hvrep.CommConfig(fusion_threshold_bytes=1024)).close()


def case_cross_replica_batchnorm_equals_batchnorm_on_the_concatenated_batch():
    r, me = repl(), _rank()
    x_all = np.random.default_rng(3).normal(2.0, 3.0, size=(2 * 6, 5)).astype(np.float32)
    with r.scope():
        crbn = hvrep.layers.CrossReplicaBatchNorm(momentum=0.5)
        crbn.build((None, 5))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    bn.build((None, 5))
    want = bn(x_all, training=True).numpy()

    def step(x):
        return hvrep.all_gather(crbn(x, training=True), axis=0)

    got = r.run(step, args=(tf.constant(x_all[me * 6:(me + 1) * 6]),)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(crbn.moving_mean.numpy(), bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(crbn.moving_variance.numpy(), bn.moving_variance.numpy(), rtol=1e-5, atol=1e-6)


def case_keras_batch_norm_trains_fused_inside_run_and_as_keras_own_ops_would():
    """Replicator(batch_norm="fused"), the default, on horovod: 2 ranks' steps of a model with Keras'
    BatchNormalization build FusedBatchNormV3 and train the weights and moving statistics that
    Replicator(batch_norm="keras") (Keras' own ops) trains, to 1e-5."""
    me = _rank()
    rng = np.random.default_rng(21)
    x = rng.normal(1.0, 2.0, size=(3, 2, 4, 6, 6, 2)).astype(np.float32)  # step, rank, batch, h, w, c
    y = rng.integers(0, 5, size=(3, 2, 4)).astype(np.int32)

    def train(batch_norm):
        r = hvrep.Replicator("horovod", batch_norm=batch_norm)
        with r.scope():
            keras.utils.set_random_seed(8)
            model = keras.Sequential([
                keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
                keras.layers.BatchNormalization(momentum=0.8), keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
            opt = keras.optimizers.SGD(0.1, momentum=0.9)
            opt.build(model.trainable_variables)
        ops: list = []

        def step(xb, yb):
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
            grads = hvrep.all_reduce(tape.gradient(loss, model.trainable_variables), "mean")
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            ops.extend(op.type for op in tf.compat.v1.get_default_graph().get_operations())
            return loss

        for i in range(3):
            r.run(step, args=(tf.constant(x[i, me]), tf.constant(y[i, me])))
        return ops, [w.numpy() for w in model.weights], [w.numpy() for w in model.trainable_weights]

    fused_ops, fused, fused_trainable = train("fused")
    keras_ops, plain, _ = train("keras")
    assert "FusedBatchNormV3" in fused_ops and "FusedBatchNormV3" not in keras_ops
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # (The moving statistics are each rank's own batches', as with Keras' layer: not compared across ranks.)
    assert _same_on_all_ranks(fused_trainable) == 0.0


def case_process_placement_and_the_input_contexts_gpu():
    from hvrep import compat

    r, hvd = repl(), compat.import_horovod()
    seen = []

    def input_fn(ctx):
        seen.append(ctx)
        return tf.data.Dataset.range(2).batch(1)

    r.distribute_dataset(input_fn, global_batch_size=2)
    ranks = r.reduce(tf.constant([r.rank, r.local_rank]), "sum")  # every rank reaches this before asserting
    placement = hvrep.resolve_placement()
    assert (r.rank, r.num_processes) == (hvd.rank(), hvd.size()) == (placement.rank, 2)
    assert (r.local_rank, r.local_size) == (hvd.local_rank(), hvd.local_size()) == (placement.local_rank, 2)
    assert ranks.tolist() == [1, 1]  # ranks 0 and 1, both on this node
    [ctx] = seen
    assert (ctx.replica_id, ctx.num_replicas, ctx.per_replica_batch_size) == (r.rank, 2, 1)
    # No GPU here; with one, bind_gpu makes TensorFlow's /gpu:0 CUDA device local_rank % visible GPUs.
    gpus = len(tf.config.list_physical_devices("GPU"))
    want = (r.local_rank % gpus, "/gpu:0") if gpus else (None, None)
    assert (ctx.cuda_device, ctx.tf_device) == want
