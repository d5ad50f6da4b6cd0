"""PowerSGD on 2 in-graph replicas (2 logical CPU devices): Algorithm 1, its state, its bytes, its wrappers.

The same checks run on 2 horovod ranks in tests/multirank/cases_powersgd.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError
from hvrep.perf import costmodel
from hvrep.replica import powersgd
from hvrep.replica.comm import powersgd_matrix
from tests import fidelity
from tests import powersgd_sim as sim


@pytest.fixture
def make_repl():
    made = []

    def make(config):
        made.append(hvrep.Replicator("local", config=config))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("rank", [1, 2])
def test_two_replicas_equal_algorithm_1_in_numpy_and_send_only_the_factors(make_repl, rank):
    repl = make_repl(sim.config(rank))
    grads = sim.gradients(2)
    got, _, traced = sim.replicated(repl, grads)
    want = sim.simulate(grads, rank)
    for replica in range(2):
        assert sim.max_error([g[replica] for g in got], want) <= 1e-5
    compressed, full = sim.factor_bytes(rank)
    assert traced == 2 * compressed < 2 * full  # both replicas' traces: P's, Q's and the exact bias, in fp32
    assert costmodel.payload_bytes(sim.SHAPES, "powersgd", powersgd_rank=rank, powersgd_min_compression_rate=0) \
        == compressed


@pytest.mark.parametrize("compression,scheme", [("none", "fp32"), ("fp16", "fp16")])
def test_the_cost_models_payload_is_what_the_backend_was_asked_to_reduce(make_repl, compression, scheme):
    repl = make_repl(hvrep.CommConfig(compression=compression))
    before = repl.collective_bytes
    repl.run(lambda: hvrep.all_reduce([tf.ones(s) for s in sim.SHAPES], "mean", compress=True))
    assert repl.collective_bytes - before == 2 * costmodel.payload_bytes(sim.SHAPES, scheme)  # 2 replicas' traces


def test_error_feedback_state_saved_and_restored_continues_bit_identically(make_repl, tmp_path):
    repl = make_repl(sim.config(2))
    grads = sim.gradients(2)
    _, state, _ = sim.replicated(repl, grads[:2])
    repl.run(state.average_errors)  # what the checkpoint holds is then what every replica holds
    path = tf.train.Checkpoint(powersgd=state).write(str(tmp_path / "ckpt"))
    assert np.abs(state.errors[0].numpy()).max() > 0  # there is feedback to lose
    went_on, _, _ = sim.replicated(repl, grads[2:], state=state)

    fresh = make_repl(sim.config(2))
    with fresh.scope():
        restored = powersgd.PowerSGDState([tf.zeros(s) for s in sim.SHAPES], fresh.config, 2)
    tf.train.Checkpoint(powersgd=restored).read(path).assert_consumed()
    resumed, _, _ = sim.replicated(fresh, grads[2:], state=restored)
    for a, b in zip(went_on, resumed, strict=True):
        for pa, pb in zip(a, b, strict=True):
            for x, y in zip(pa, pb, strict=True):
                np.testing.assert_array_equal(x, y)


def test_a_zero_gradient_leaves_q_degenerate_and_both_replicas_redraw_the_same(make_repl):
    repl = make_repl(sim.config(2))
    grads = sim.gradients(2, zero_first=0)
    got, state, _ = sim.replicated(repl, grads)
    want = sim.simulate(grads, 2)
    for replica in range(2):
        assert sim.max_error([g[replica] for g in got], want) <= 1e-5
    assert np.abs(got[0][0][0]).max() == 0  # step 0: nothing to send
    assert np.abs(got[1][0][0]).max() > 0.1  # step 1: Q was redrawn, not left at 0
    q0, q1 = repl._backend.strategy.experimental_local_results(state.qs[0])
    np.testing.assert_array_equal(q0.numpy(), q1.numpy())


def test_a_state_restored_at_another_world_size_starts_afresh(make_repl, tmp_path):
    repl = make_repl(sim.config(1))
    grads = sim.gradients(2)
    three = powersgd.PowerSGDState([tf.zeros(s) for s in sim.SHAPES], repl.config, 3)  # saved by 3 ranks
    for v in [*three.errors, *three.qs]:
        v.assign(tf.ones_like(v))
    path = tf.train.Checkpoint(powersgd=three).write(str(tmp_path / "ckpt"))
    with repl.scope():
        state = powersgd.PowerSGDState([tf.zeros(s) for s in sim.SHAPES], repl.config, 2)
    tf.train.Checkpoint(powersgd=state).read(path).assert_consumed()
    got, _, _ = sim.replicated(repl, grads, state=state)
    assert sim.max_error([g[0] for g in got], sim.simulate(grads, 1)) <= 1e-5


def test_before_the_start_step_the_reduction_is_exact_and_the_state_untouched(make_repl):
    repl = make_repl(sim.config(1, powersgd_start_step=2))
    grads = sim.gradients(2)
    got, state, _ = sim.replicated(repl, grads[:2])
    for t in range(2):
        for i in range(len(sim.SHAPES)):
            np.testing.assert_allclose(got[t][0][i], (grads[t][0][i] + grads[t][1][i]) / 2, atol=1e-6)
    assert all(float(tf.reduce_max(tf.abs(v))) == 0 for v in [*state.errors, *state.qs])
    later, _, _ = sim.replicated(repl, grads[2:], state=state)  # from step 2: Algorithm 1 started there
    assert sim.max_error([g[0] for g in later], sim.simulate(grads, 1, start_step=2)[2:]) <= 1e-5


def test_wrap_optimizer_at_full_rank_equals_one_replica_with_twice_the_batch(make_repl):
    # At r >= min(rows, cols), P^ spans M's columns and P^ P^T M = M: PowerSGD is the exact mean.
    repl = make_repl(hvrep.CommConfig(compression="powersgd", powersgd_rank=64, powersgd_min_compression_rate=0))
    got = fidelity.replicated(repl, "momentum", wrap=True)
    assert fidelity.max_difference(got, fidelity.reference("momentum", 2)) <= 1e-5


def test_all_reduce_compress_without_a_state_names_the_fix(make_repl):
    repl = make_repl(sim.config(1))
    with pytest.raises(ConfigError, match="wrap_optimizer"):
        repl.run(lambda: hvrep.all_reduce([tf.ones([4, 4])], "mean", compress=True))


@pytest.mark.parametrize("field,value", [("powersgd_rank", 0), ("powersgd_rank", 1.5), ("powersgd_start_step", -1),
                                         ("powersgd_error_feedback", 1), ("powersgd_warm_start", None),
                                         ("powersgd_min_compression_rate", -1.0)])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        hvrep.CommConfig(compression="powersgd", **{field: value})


def test_which_tensors_are_compressed_follows_pytorchs_rule():
    assert powersgd_matrix((5,), 4, 0) is None  # vectors: exact
    assert powersgd_matrix((3, 3, 64, 128), 4, 2) == (576, 128, 4)  # conv kernel: [kh*kw*in, out]
    assert powersgd_matrix((3, 7), 9, 0) == (3, 7, 3)  # r clipped to min(rows, cols)
    assert powersgd_matrix((9, 9), 2, 2) == (9, 9, 2)  # 81 > 2 * (9+9)*2
    assert powersgd_matrix((9, 9), 2, 2.25) is None  # 81 = 2.25 * 36
