"""The in-graph path (local backend, 2 logical CPU devices; TPUs take the same code)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import CollectiveError, ConfigError
from tests import fidelity


@pytest.fixture
def repl():
    r = hvrep.Replicator("local")
    yield r
    r.close()


def test_local_backend_has_two_replicas(repl):
    assert repl.backend == "local" and repl.num_replicas == 2 and repl.is_chief


@pytest.mark.parametrize("kind,loss", [(k, "function") for k in fidelity.KINDS]
                         + [("sgd", "object"), ("loss_scale", "object"), ("clipnorm", "object")])
@pytest.mark.parametrize("wrap", [False, True], ids=["all_reduce", "wrap_optimizer"])
def test_two_replicas_equal_one_replica_with_twice_the_batch(repl, kind, loss, wrap):
    # Each gradient reduced exactly once: Keras' own cross-replica SUM (after clipping or
    # unscaling made new tensors) must not add a second reduction; every device's copy checked.
    copies: list = []
    got = fidelity.replicated(repl, kind, wrap=wrap, loss=loss, copies=copies)
    want = fidelity.reference(kind, repl.num_replicas, loss=loss)
    assert fidelity.max_difference(got, want) <= 1e-5
    assert all(len(parts) == 2 for parts in copies)
    for replica in range(2):
        assert fidelity.max_difference([parts[replica] for parts in copies], want) <= 1e-5, replica


def test_a_loss_object_inside_run_averages_over_the_replicas_own_batch(repl):
    # Keras divides a Loss object's value by num_replicas_in_sync for its own later SUM;
    # inside run the step is one replica's step, so the logged loss is the true mean.
    losses: list = []
    fidelity.replicated(repl, "sgd", loss="object", losses=losses)
    np.testing.assert_allclose(losses, fidelity.reference_losses(2, loss="object"), rtol=1e-5)


def test_a_plain_keras_step_keeps_keras_own_sum_and_sync_batchnorm_is_untouched(repl):
    # No hvrep collective in the step: Keras' optimizer sums the replicas' gradients.
    # Replica r's gradient of sum(w * x_r) is x_r = r + 1: SGD(0.1) moves w by -0.1 * (1 + 2).
    with repl.scope():
        w = tf.Variable(0.0)
        opt = keras.optimizers.SGD(0.1)
        bn = keras.layers.BatchNormalization(synchronized=True, momentum=0.0)
        bn.build((None, 1))

    def step():
        x = tf.cast(hvrep.replica_id(), tf.float32) + 1.0
        with tf.GradientTape() as tape:
            loss = w * x
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        bn(tf.reshape(x, [1, 1]), training=True)  # cross-replica mean of {1, 2}
        return loss

    repl.run(step)
    for part in repl._backend.strategy.experimental_local_results(w):  # a tf.Variable
        np.testing.assert_allclose(part.numpy(), -0.3, rtol=1e-6)
    for part in repl._backend.strategy.experimental_local_results(bn.moving_mean.value):
        np.testing.assert_allclose(part.numpy(), [1.5], rtol=1e-6)


def test_collectives_outside_run_are_refused(repl):
    with pytest.raises(CollectiveError, match="inside a replica step"):
        hvrep.all_reduce(tf.ones(2), "sum")


def test_unknown_op_and_backend_are_refused(repl):
    with pytest.raises(CollectiveError, match="'avg'"):
        repl.reduce(np.ones(2), "avg")
    with pytest.raises(CollectiveError, match="'avg'"):
        repl.run(lambda: hvrep.all_reduce(tf.ones(2), "avg"))


def test_collectives_act_on_the_replicator_that_is_running(repl):
    other = hvrep.Replicator("local", config=hvrep.CommConfig(fusion_threshold_bytes=0))
    before = (repl.collective_calls, other.collective_calls)
    other.run(lambda: hvrep.all_reduce([tf.ones(2), tf.ones(3)], "sum"))
    assert repl.collective_calls == before[0]
    assert other.collective_calls - before[1] == 2 * other.num_replicas  # unfused: 2 per replica


def test_unknown_backend_names_the_choices():
    with pytest.raises(ConfigError, match="'horovd'"):
        hvrep.Replicator("horovd")


def test_collectives_on_nested_structures_and_dtypes(repl):
    def step():
        v = tf.cast(hvrep.replica_id(), tf.float32) + 1.0  # 1, 2
        i = hvrep.replica_id() + 1
        value = {"f32": tf.fill([2], v), "pair": (tf.reshape(tf.cast(v, tf.float16), [1]), tf.reshape(i, [1])),
                 "bf16": tf.reshape(tf.cast(v, tf.bfloat16), [1]), "none": None}
        return {op: hvrep.all_reduce(value, op) for op in ("sum", "mean", "max", "min")} | {
            "gather": hvrep.all_gather(tf.reshape(v, [1, 1]), axis=1),
            "bcast": hvrep.broadcast(v, root=1),
        }

    out = repl.run(step)
    expect = {"sum": (3.0, 3), "mean": (1.5, 1), "max": (2.0, 2), "min": (1.0, 1)}
    for op, (fv, iv) in expect.items():
        for replica_value in repl._backend.strategy.experimental_local_results(out[op]["f32"]):
            np.testing.assert_allclose(replica_value.numpy(), [fv, fv])
        got = repl.reduce(out[op], "max")  # identical on both replicas, so max is the value
        assert got["pair"][0].dtype == np.float16 and got["pair"][1].dtype == np.int32
        np.testing.assert_allclose(got["pair"][0], [fv])
        assert got["pair"][1].tolist() == [iv]
        np.testing.assert_allclose(np.asarray(got["bf16"], np.float32), [fv])
        assert out[op]["none"] is None
    assert repl.reduce(out["gather"], "min").tolist() == [[1.0, 2.0]]
    assert float(repl.reduce(out["bcast"], "min")) == 2.0


def test_fusion_issues_one_collective_for_many_tensors(repl):
    before = repl.collective_calls
    repl.run(lambda: hvrep.all_reduce([tf.ones([3]) for _ in range(12)], "sum"))
    # In-graph, each of the 2 replicas is traced in this process: 1 collective each, not 12.
    assert repl.collective_calls - before == repl.num_replicas


def test_bf16_and_fp16_compression_stay_within_their_precision_and_apply_only_when_asked():
    for compression, rtol in (("fp16", 2e-3), ("bf16", 1e-2)):
        r = hvrep.Replicator("local", config=hvrep.CommConfig(compression=compression))
        try:
            def step():
                rid = tf.cast(hvrep.replica_id(), tf.float32)
                x = (tf.linspace(-3.0, 3.0, 50) + 1e-3) * (rid + 1.0)
                return hvrep.all_reduce(x, "mean", compress=True), hvrep.all_reduce(x, "mean")

            compressed, plain = (r.reduce(t, "min") for t in r.run(step))
            want = (np.linspace(-3, 3, 50, dtype=np.float32) + np.float32(1e-3)) * np.float32(1.5)
            np.testing.assert_allclose(compressed, want, rtol=rtol, atol=rtol)
            assert not np.array_equal(compressed, want)  # rounded on the wire: compression applied
            np.testing.assert_allclose(plain, want, rtol=1e-6)  # not asked: float32 on the wire
        finally:
            r.close()


def test_fp16_compression_never_reaches_cross_replica_batch_norms_statistics():
    # 64 x 32 x 32 positions per replica: a count of 65,536, past fp16's largest value (65,504). With the count
    # compressed, the output was NaN.
    x = np.random.default_rng(5).normal(1.0, 2.0, size=(2, 64, 32, 32, 2)).astype(np.float32)
    outs = {}
    for compression in ("none", "fp16"):
        r = hvrep.Replicator("local", config=hvrep.CommConfig(compression=compression))
        with r.scope():
            crbn = hvrep.layers.CrossReplicaBatchNorm(momentum=0.5)
            crbn.build((None, 32, 32, 2))
        parts = r._backend.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(x[ctx.replica_id_in_sync_group]))
        out = r.run(lambda t, crbn=crbn: crbn(t, training=True), args=(parts,))
        outs[compression] = np.concatenate([np.asarray(v) for v in r._backend.strategy.experimental_local_results(out)])
        outs[compression + " moving_variance"] = crbn.moving_variance.numpy()
        r.close()
    assert np.isfinite(outs["fp16"]).all()
    np.testing.assert_array_equal(outs["fp16"], outs["none"])
    np.testing.assert_array_equal(outs["fp16 moving_variance"], outs["none moving_variance"])


def test_cross_replica_batchnorm_equals_batchnorm_on_the_concatenated_batch(repl):
    import keras

    x_all = np.random.default_rng(3).normal(2.0, 3.0, size=(12, 5)).astype(np.float32)
    with repl.scope():
        crbn = hvrep.layers.CrossReplicaBatchNorm(momentum=0.5)
        crbn.build((None, 5))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    bn.build((None, 5))
    want = bn(x_all, training=True).numpy()
    halves = repl._backend.strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(x_all[ctx.replica_id_in_sync_group * 6:(ctx.replica_id_in_sync_group + 1) * 6]))
    out = repl.run(lambda x: hvrep.all_gather(crbn(x, training=True), axis=0), args=(halves,))
    np.testing.assert_allclose(repl.reduce(out, "min"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(crbn.moving_mean.numpy(), bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6)


def test_input_context_shards_and_checks_the_global_batch(repl):
    seen = []

    def input_fn(ctx):
        seen.append(ctx)
        return ctx.shard(tf.data.Dataset.range(8)).batch(ctx.per_replica_batch_size)

    batches = list(repl.distribute_dataset(input_fn, global_batch_size=4))
    assert [(c.replica_id, c.num_replicas, c.per_replica_batch_size) for c in seen] == [(0, 2, 2), (1, 2, 2)]
    values = sorted(int(v) for b in batches for part in repl._backend.strategy.experimental_local_results(b)
                    for v in part.numpy())
    assert values == list(range(8))  # every element exactly once
    with pytest.raises(CollectiveError, match="global_batch_size=5"):
        repl.distribute_dataset(input_fn, global_batch_size=5)


def test_gradient_accumulation_is_refused_in_graph_with_the_fix():
    # When the Replicator is built (hvrep.replica.support), before any optimizer or step.
    with pytest.raises(ConfigError, match=r"accumulation_steps=2 with backend='local' cannot be combined.*Fix: "
                                          "accumulation_steps=1"):
        hvrep.Replicator("local", config=hvrep.CommConfig(accumulation_steps=2))


def test_cross_replica_batchnorm_with_a_mask_equals_masked_batchnorm_on_the_concatenated_batch(repl):
    import keras

    rng = np.random.default_rng(4)
    x_all = rng.normal(1.0, 2.0, size=(8, 3, 5)).astype(np.float32)  # (batch, time, channels)
    mask_all = rng.random((8, 3)) > 0.3
    with repl.scope():
        crbn = hvrep.layers.CrossReplicaBatchNorm(momentum=0.5)
        crbn.build((None, 3, 5))
    bn = keras.layers.BatchNormalization(momentum=0.5)
    bn.build((None, 3, 5))
    want = bn(x_all, training=True, mask=mask_all).numpy()
    halves = repl._backend.strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.constant(x_all[ctx.replica_id_in_sync_group * 4:(ctx.replica_id_in_sync_group + 1) * 4]),
                     tf.constant(mask_all[ctx.replica_id_in_sync_group * 4:(ctx.replica_id_in_sync_group + 1) * 4])))
    out = repl.run(lambda xm: hvrep.all_gather(crbn(xm[0], training=True, mask=xm[1]), axis=0), args=(halves,))
    np.testing.assert_allclose(repl.reduce(out, "min"), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(crbn.moving_mean.numpy(), bn.moving_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(crbn.moving_variance.numpy(), bn.moving_variance.numpy(), rtol=1e-5, atol=1e-6)


def test_a_fresh_lambda_each_step_reuses_the_compiled_step(repl):
    traces = []
    v = tf.constant([1.0, 2.0])

    def step(x):
        traces.append(1)  # runs once per trace
        return hvrep.all_reduce(x * 2.0, "sum")

    for _ in range(20):
        out = repl.run(lambda: step(v))  # a new function object every iteration
    assert len(traces) == 2, len(traces)  # one trace per replica, once
    assert len(repl._backend._functions) == 1
    np.testing.assert_allclose(repl.reduce(out, "mean"), [4.0, 8.0])
    # A lambda over a different value is a different step.
    got = [float(repl.reduce(repl.run(lambda i=i: tf.constant(float(i))), "sum")) for i in range(3)]
    assert got == [0.0, 2.0, 4.0], got


def test_the_compiled_step_cache_is_bounded(repl):
    cache = repl._backend._functions
    for i in range(cache.size + 5):
        repl.run(lambda i=i: tf.constant(float(i)))
    assert len(cache) == cache.size


def test_one_process_drives_every_replica_and_each_context_carries_its_gpu(repl):
    from hvrep.replica import devices

    assert (repl.rank, repl.num_processes, repl.local_rank, repl.local_size) == (0, 1, 0, 1)
    seen = []

    def input_fn(ctx):
        seen.append(ctx)
        return tf.data.Dataset.range(2).batch(1)

    repl.distribute_dataset(input_fn)
    # Replica i on GPU i; no GPU here, so every context says None (the GPU rule: tests/unit/replica/test_devices.py).
    gpus = tf.config.list_logical_devices("GPU")
    want = (devices.replica_gpus(len(gpus), devices.count_cuda_devices()) if gpus
            else [devices.NO_GPU] * repl.num_replicas)
    assert [(c.replica_id, c.cuda_device, c.tf_device) for c in seen] == [(i, *g) for i, g in enumerate(want)]


def test_local_replicas_all_reduce_with_nccl_on_gpus_and_through_one_device_on_cpus():
    # No GPU here: the choice is checked on device names; NCCL itself was not run.
    from hvrep.replica.backends._ingraph import cross_device_ops_for

    gpus = ["/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1"]
    assert isinstance(cross_device_ops_for(gpus), tf.distribute.NcclAllReduce)
    assert isinstance(cross_device_ops_for(["/device:CPU:0", "/device:CPU:1"]), tf.distribute.ReductionToOneDevice)


def test_bound_methods_of_two_objects_are_two_steps(repl):
    class Scaler:
        def __init__(self, k):
            self.k = k

        def step(self):
            return tf.constant(self.k)

    a, b = Scaler(1.0), Scaler(5.0)
    assert float(repl.reduce(repl.run(a.step), "sum")) == 2.0
    assert float(repl.reduce(repl.run(b.step), "sum")) == 10.0


def test_a_tensor_of_unknown_shape_is_reduced_unfused_beside_fused_ones(repl):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def step_of(x):
        return repl.run(lambda: hvrep.all_reduce([x * 2.0, tf.ones([3]), x], "sum"))

    before = repl.collective_calls
    dynamic, fixed, again = (repl.reduce(t, "min") for t in step_of(tf.constant([1.0, 2.0])))
    np.testing.assert_array_equal(dynamic, [4.0, 8.0])
    np.testing.assert_array_equal(again, [2.0, 4.0])
    np.testing.assert_array_equal(fixed, [2.0, 2.0, 2.0])
    # Per replica: one buffer for the fully known tensor, one collective for each tensor of unknown shape.
    assert repl.collective_calls - before == 3 * repl.num_replicas


def test_marks_of_reduced_values_do_not_keep_every_traced_step_alive(repl):
    marks = repl._backend._marks
    for i in range(6):
        repl.run(lambda i=i: hvrep.all_reduce([tf.ones([2]) * i, tf.zeros([3])], "sum"))
        assert len(marks) <= 2 * repl.num_replicas, len(marks)  # this step's, not every step's so far


def test_backends_keep_no_run_depth():
    # Never read, and its += raced across MirroredStrategy's replica threads.
    from hvrep.replica.backends.base import Backend

    assert not hasattr(Backend, "in_replica")
    assert "_run_depth" not in vars(hvrep.Replicator("local")._backend)
