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
from tests import powersgd_fp16 as f16
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


def _check_one_ranks_overflow_skipped_on_both(repl, run, want, tolerance: float = 1e-5) -> None:
    """Both ranks skipped the step only one overflowed (one update fewer, the scale halved once), their weights are
    the same and equal ``want`` (the run without that step) to ``tolerance``, relative to each weight's largest
    magnitude."""
    assert (run.iterations, run.scale) == (f16.STEPS - 1, f16.INITIAL_SCALE / 2), (run.iterations, run.scale)
    spread = _spread(repl, [run.iterations, run.scale, *[c for cs in run.weights for c in cs]])
    assert spread == 0.0, spread
    assert f16.max_relative_difference(run.weights, want) <= tolerance, f16.max_relative_difference(run.weights,
                                                                                                  want)


def _check_powersgd_state(repl, run, algorithm) -> None:
    """The overflow step left PowerSGD's state as it was; the Q's, step counter and world size are the same on
    both ranks and each rank's errors are Algorithm 1's for its worker (unscaled)."""
    state = run.powersgd
    if run.states:  # the custom loop records the state after every step
        for before, after in zip(run.states[f16.OVERFLOW_STEP - 1], run.states[f16.OVERFLOW_STEP], strict=True):
            np.testing.assert_array_equal(before, after)
    shared = [q.numpy() for q in state.qs] + [state.step.numpy(), state.world_size.numpy()]
    spread = _spread(repl, shared)
    assert spread == 0.0, spread
    assert int(state.step.numpy()) == f16.STEPS - 1 and int(state.world_size.numpy()) == 2
    compressed = [i for i, p in enumerate(algorithm.plans) if p is not None]
    for k, i in enumerate(compressed):
        np.testing.assert_allclose(state.qs[k].numpy(), algorithm.qs[i], atol=1e-5)
        np.testing.assert_allclose(state.errors[k].numpy(), algorithm.errors[repl.rank][i], atol=1e-5)
        assert np.isfinite(state.errors[k].numpy()).all()


def case_powersgd_fp16_an_overflow_on_one_rank_is_skipped_on_both_in_the_custom_loop():
    # Rank 1 alone overflows at step 1: both skip it, the state stays as it was and the same on both ranks. With
    # a start step of 3 the overflow comes in the exact phase (horovod's tf.cond takes the exact branch).
    for start_step in (0, 3):
        def check(repl, start_step=start_step):
            run = f16.custom_loop(repl, overflow=(1,))
            want, algorithm = f16.reference(2, 1, start_step=start_step)
            _check_one_ranks_overflow_skipped_on_both(repl, run, want)
            _check_powersgd_state(repl, run, algorithm)

        _with(f16.config(powersgd_start_step=start_step), check)


def case_powersgd_fp16_an_overflow_on_one_rank_is_skipped_on_both_in_keras_fit():
    def check(repl):
        run = f16.fit(repl, overflow=(0,))
        want, algorithm = f16.reference(2, 1)
        _check_one_ranks_overflow_skipped_on_both(repl, run, want)
        _check_powersgd_state(repl, run, algorithm)

    _with(f16.config(), check)


def case_fp16_accumulation_an_overflowing_micro_batch_skips_its_update_only():
    # k=2: rank 1's first micro-batch of update 1 overflows. That update is skipped on both ranks, the
    # accumulators start again from zero, and the run equals one without that update (PowerSGD or exact).
    for compression, powersgd_rank in (("powersgd", 1), ("none", None)):
        def check(repl, powersgd_rank=powersgd_rank):
            run = f16.custom_loop(repl, overflow=(1,), micro=2)
            want, algorithm = f16.reference(2, powersgd_rank)
            _check_one_ranks_overflow_skipped_on_both(repl, run, want)
            if powersgd_rank:
                _check_powersgd_state(repl, run, algorithm)

        _with(f16.config(compression, accumulation_steps=2), check)


def case_fp16_compression_an_overflow_on_one_rank_is_skipped_on_both():
    # The scaled gradients travel in fp16 (the scale keeps small ones above fp16's underflow); one rank's inf
    # reaches both in the sum. 11 significant bits on the wire: the fp16 tolerance, 2e-3 relative.
    _with(f16.config("fp16"), lambda repl: _check_one_ranks_overflow_skipped_on_both(
        repl, f16.custom_loop(repl, overflow=(0,)), f16.reference(2, None)[0], tolerance=2e-3))
