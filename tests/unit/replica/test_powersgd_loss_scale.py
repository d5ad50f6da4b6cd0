"""Gradient compression under fp16 loss scaling: one overflow step is skipped on every in-graph replica, the scale
halves once, and training goes on equal to a reference that never took that step (issue 46, defect 1).

tests/powersgd_fp16.py holds the model, the forced overflow and the references; the 2-rank twins (one rank
overflows) are in tests/multirank/cases_powersgd.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import hvrep
from tests import powersgd_fp16 as f16

STEPS, AT = f16.STEPS, f16.OVERFLOW_STEP


@pytest.fixture
def make_repl():
    made = []

    def make(config, **kw):
        made.append(hvrep.Replicator("local", config=config, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _check_skipped_once(run) -> None:
    assert run.iterations == STEPS - 1, run.iterations  # on main: 1, every step after the overflow skipped
    assert run.scale == f16.INITIAL_SCALE / 2, run.scale  # halved once (main: halved at every step)


def _check_powersgd_state(repl, run, algorithm) -> None:
    state = run.powersgd
    # The overflow step left the state exactly as the step before it did: errors, Q's, step counter, world size.
    for before, after in zip(run.states[AT - 1], run.states[AT], strict=True):
        np.testing.assert_array_equal(before, after)
    assert f16.local_values(repl, state.step) == [STEPS - 1] * (repl.num_replicas // repl.num_processes)
    # Each replica's error feedback is Algorithm 1's for its worker, in unscaled units; the Q's are every
    # replica's alike.
    for k, i in enumerate(i for i, p in enumerate(algorithm.plans) if p is not None):
        copies = f16.local_values(repl, state.errors[k])
        for replica, copy in enumerate(copies):
            assert np.isfinite(copy).all()
            np.testing.assert_allclose(copy, algorithm.errors[replica][i], atol=1e-5)
        qs = f16.local_values(repl, state.qs[k])
        for q in qs:
            np.testing.assert_array_equal(q, qs[0])
            np.testing.assert_allclose(q, algorithm.qs[i], atol=1e-5)


@pytest.mark.parametrize("replicas,overflow", [(1, (0,)), (2, (1,)), (2, (0, 1))],
                         ids=["one-replica-on-2-devices", "2-replicas-one-overflows", "2-replicas-both-overflow"])
def test_wrap_optimizer_skips_the_overflow_step_and_powersgd_goes_on_as_if_it_never_came(make_repl, replicas,
                                                                                         overflow):
    repl = make_repl(f16.config(), devices_per_replica=2 // replicas)
    assert repl.num_replicas == replicas
    run = f16.custom_loop(repl, overflow)
    want, algorithm = f16.reference(replicas, 1)
    _check_skipped_once(run)
    _check_powersgd_state(repl, run, algorithm)
    assert f16.max_difference(run.weights, want) <= 1e-5, f16.max_difference(run.weights, want)


def test_an_overflow_before_the_start_step_is_skipped_and_not_counted(make_repl):
    # Exact reductions until 3 finite steps were taken: the skipped one is not one of them.
    repl = make_repl(f16.config(powersgd_start_step=3))
    run = f16.custom_loop(repl, overflow=(0,))
    want, algorithm = f16.reference(2, 1, start_step=3)
    _check_skipped_once(run)
    _check_powersgd_state(repl, run, algorithm)
    assert f16.max_difference(run.weights, want) <= 1e-5, f16.max_difference(run.weights, want)


def test_keras_fit_skips_the_overflow_step_on_both_replicas_and_goes_on_as_if_it_never_came(make_repl):
    repl = make_repl(f16.config())
    run = f16.fit(repl, overflow=(0,))
    want, _ = f16.reference(2, 1)
    _check_skipped_once(run)
    assert f16.local_values(repl, run.powersgd.step) == [STEPS - 1] * 2
    assert all(np.isfinite(c).all() for e in run.powersgd.errors for c in f16.local_values(repl, e))
    assert f16.max_difference(run.weights, want) <= 1e-5, f16.max_difference(run.weights, want)


# The wire rounds each loss-scaled gradient to fp16's 11 significant bits (relative 2^-11 = 4.9e-4) or bf16's 8
# (2^-8 = 3.9e-3) once per step: the tolerances for those precisions.
@pytest.mark.parametrize("compression,tolerance", [("fp16", 2e-3), ("bf16", 1e-2)])
def test_fp16_and_bf16_compression_skip_one_replicas_overflow_on_both(make_repl, compression, tolerance):
    repl = make_repl(f16.config(compression))
    run = f16.custom_loop(repl, overflow=(1,))
    want, _ = f16.reference(2, None)
    _check_skipped_once(run)
    assert f16.max_relative_difference(run.weights, want) <= tolerance, f16.max_relative_difference(run.weights,
                                                                                                  want)
