"""The foundation's promise: Horovod 0.28.1's core ops, built against TF 2.21,
work on Keras 3 variables under both launchers, and hvrep resolves the same
placement Horovod does. Runs on every rank (see runner.py); fails by raising.
"""

import os

import numpy as np
import tensorflow as tf

from hvrep import compat, resolve_placement

hvd = compat.import_horovod()


def case_placement_matches_horovod():
    p = resolve_placement()
    assert (p.rank, p.size) == (hvd.rank(), hvd.size()), (p, hvd.rank(), hvd.size())
    assert (p.local_rank, p.local_size) == (hvd.local_rank(), hvd.local_size()), p
    expected = "horovodrun" if hvd.gloo_enabled() else "openmpi"
    assert p.launcher == expected, (p.launcher, expected)
    assert p.is_chief == (hvd.rank() == 0)


def case_controller_matches_launcher():
    # horovodrun --gloo must run on Gloo; mpirun on MPI. Both were built in.
    assert hvd.mpi_built() and hvd.gloo_built()
    assert hvd.gloo_enabled() != hvd.mpi_enabled()


def case_allreduce_sum_average_max_min():
    r = hvd.rank()
    x = tf.constant([r + 1.0, 10.0 * (r + 1)], tf.float32)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, name="c.sum").numpy(), [3.0, 30.0])
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Average, name="c.avg").numpy(), [1.5, 15.0])
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Max, name="c.max").numpy(), [2.0, 20.0])
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Min, name="c.min").numpy(), [1.0, 10.0])
    xi = tf.constant([r + 1, 7], tf.int32)
    np.testing.assert_array_equal(hvd.allreduce(xi, op=hvd.Sum, name="c.isum").numpy(), [3, 14])
    xh = tf.constant([r + 0.5], tf.float16)
    np.testing.assert_allclose(hvd.allreduce(xh, op=hvd.Sum, name="c.hsum").numpy(), [2.0])


def case_grouped_allreduce_of_keras3_gradients_in_tf_function():
    import keras

    keras.utils.set_random_seed(0)  # same weights on both ranks for this case
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    x = tf.fill((5, 4), float(hvd.rank() + 1))

    @tf.function
    def grads_fn():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        return grads, hvd.grouped_allreduce(grads, op=hvd.Average)

    local, averaged = grads_fn()
    gathered = [hvd.allgather(g[None], name=f"c.g{i}") for i, g in enumerate(local)]
    for g_avg, g_all in zip(averaged, gathered, strict=True):
        np.testing.assert_allclose(g_avg.numpy(), tf.reduce_mean(g_all, axis=0).numpy(), rtol=1e-6)


def case_broadcast_makes_keras3_variables_identical():
    import keras

    keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    before = hvd.allgather(model.variables[0].value[None], name="c.before")
    assert not np.allclose(before[0].numpy(), before[1].numpy()), "seeds did not differ"
    for i, v in enumerate(model.variables):
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"c.bcast.{i}"))
    for i, v in enumerate(model.variables):
        both = hvd.allgather(v.value[None], name=f"c.after.{i}").numpy()
        np.testing.assert_array_equal(both[0], both[1])


def case_allgather_uneven_first_dimension():
    r = hvd.rank()
    x = tf.fill((r + 1, 2), float(r))
    out = hvd.allgather(x, name="c.uneven").numpy()
    np.testing.assert_array_equal(out, [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])


def case_horovod_settings_after_the_users_own_hvd_init_are_refused():
    # runner.py called hvd.init() itself, as a user may, and this module runs before any Replicator of the
    # launch: Horovod has read its settings, so a CommConfig asking for others must be refused, not recorded.
    import hvrep
    from hvrep.errors import ConfigError
    from hvrep.replica.backends import horovod as backend

    assert backend._started_with is None, "a Replicator ran before this case: it no longer tests a user's hvd.init()"
    assert hvd.is_initialized()
    for field, value in (("horovod_fusion_threshold_bytes", 8 << 20), ("cycle_time_ms", 7.5)):
        try:
            hvrep.Replicator("horovod", config=hvrep.CommConfig(**{field: value}))
        except ConfigError as e:
            assert f"{field}={value!r}" in str(e) and "hvd.init()" in str(e) and "Fix:" in str(e), e
        else:
            raise AssertionError(f"{field}={value!r} was accepted after Horovod had started")
        assert backend._started_with is None  # nothing recorded as applied
    for name in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME"):
        assert name not in os.environ, name  # and nothing written after the fact
    # Settings it does not ask for: the Replicator runs on the Horovod the user started.
    r = hvrep.Replicator("horovod")
    assert r.num_replicas == 2 and backend._started_with is not None
    r.close()
