"""PowerSGD on 2 horovod ranks, on every rank (see runner.py; the in-graph twins: tests/unit/replica/test_powersgd.py).

The cases share one Replicator per CommConfig (left open, as the other modules' are: closing and
re-creating them restarts the hang watchdog). Every case runs the same collectives on every rank before it
asserts.
"""

import tempfile

import numpy as np
import tensorflow as tf

import hvrep
from hvrep.replica import powersgd
from tests import fidelity, keras_fit
from tests import powersgd_sim as sim

_repls: dict = {}


def _with(config, fn):
    if config not in _repls:
        _repls[config] = hvrep.Replicator("horovod", config=config)
    return fn(_repls[config])


def _spread(repl, values) -> float:
    """Max over ranks of |this rank's values - rank 0's|."""
    flat = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values])
    root = repl.run(lambda t: hvrep.broadcast(t, root=0), args=(tf.constant(flat),)).numpy()
    return float(repl.reduce(np.array(np.max(np.abs(root - flat))), "max"))


def case_powersgd_rank_1_and_2_equal_algorithm_1_in_numpy_and_send_only_the_factors():
    for rank in (1, 2):
        def check(repl, rank=rank):
            grads = sim.gradients(2)
            got, _, traced = sim.replicated(repl, grads)
            want = sim.simulate(grads, rank)
            compressed, full = sim.factor_bytes(rank)
            assert repl.num_replicas == 2 and repl.backend == "horovod"
            assert sim.max_error([g[0] for g in got], want) <= 1e-5, (rank, sim.max_error([g[0] for g in got], want))
            assert traced == compressed < full, (rank, traced, compressed, full)

        _with(sim.config(rank), check)


def case_powersgd_zero_gradient_redraws_the_same_q_on_both_ranks():
    def check(repl):
        grads = sim.gradients(2, zero_first=0)
        got, state, _ = sim.replicated(repl, grads)
        spread = _spread(repl, [q.numpy() for q in state.qs])
        assert spread == 0.0, spread
        assert np.abs(got[0][0][0]).max() == 0 and np.abs(got[1][0][0]).max() > 0.1
        assert sim.max_error([g[0] for g in got], sim.simulate(grads, 2)) <= 1e-5

    _with(sim.config(2), check)


def case_powersgd_before_the_start_step_is_exact_and_then_algorithm_1():
    # Horovod takes one branch of a tf.cond (exact before the start step, compressed from it on).
    def check(repl):
        grads = sim.gradients(2)
        got, _, _ = sim.replicated(repl, grads)
        for t in range(2):
            for i in range(len(sim.SHAPES)):
                np.testing.assert_allclose(got[t][0][i], (grads[t][0][i] + grads[t][1][i]) / 2, atol=1e-6)
        # From step 2: Algorithm 1 started at step 2 (zero errors, Q drawn then).
        want = sim.simulate(grads, 1, start_step=2)
        assert sim.max_error([g[0] for g in got[2:]], want[2:]) <= 1e-5, sim.max_error([g[0] for g in got[2:]],
                                                                                      want[2:])

    _with(sim.config(1, powersgd_start_step=2), check)


def case_powersgd_state_saved_and_restored_continues_bit_identically():
    grads = sim.gradients(2)

    def first(repl):
        _, state, _ = sim.replicated(repl, grads[:2])
        repl.run(state.average_errors)
        # Each rank writes its own copy (after average_errors they are equal: the chief's would serve both).
        path = tf.train.Checkpoint(powersgd=state).write(tempfile.mkdtemp() + "/ckpt")
        went_on, _, _ = sim.replicated(repl, grads[2:], state=state)
        return path, went_on

    def second(repl, path):
        state = powersgd.PowerSGDState([tf.zeros(s) for s in sim.SHAPES], repl.config, 2)
        tf.train.Checkpoint(powersgd=state).read(path).assert_consumed()
        return sim.replicated(repl, grads[2:], state=state)[0]

    path, went_on = _with(sim.config(2), first)
    resumed = _with(sim.config(2), lambda repl: second(repl, path))
    for a, b in zip(went_on, resumed, strict=True):
        for x, y in zip(a[0], b[0], strict=True):
            np.testing.assert_array_equal(x, y)


def case_powersgd_keras_fit_at_full_rank_equals_one_process_with_twice_the_batch():
    # hvrep.keras.DistributedOptimizer's PowerSGD path; at r >= min(rows, cols) PowerSGD is the exact mean.
    config = hvrep.CommConfig(compression="powersgd", powersgd_rank=64, powersgd_min_compression_rate=0)

    def check(repl):
        got, _ = keras_fit.replicated(repl, "momentum")
        want, _ = keras_fit.reference("momentum", 2)
        spread = _spread(repl, got)
        assert fidelity.max_difference(got, want) <= 1e-5, fidelity.max_difference(got, want)
        assert spread == 0.0, spread

    _with(config, check)
