"""Local SGD on the horovod backend, 2 ranks, against a single-process simulation (see runner.py). Fails by raising.

Every case runs the same collectives on every rank before it asserts. Each builds its own Replicator
(``CommConfig.local_steps`` is the Replicator's) and closes it, leaving the shared one of the other case
modules untouched.
"""

import tempfile

import numpy as np

import hvrep
from tests import localsgd_sim as sim


def _same_everywhere(repl, got: list) -> float:
    """Max difference between this rank's weights and every other rank's (the same number on every rank)."""
    flat = np.concatenate([np.ravel(w) for w in got]).astype(np.float64)
    return float(np.max(np.abs(repl.reduce(flat, "max") - repl.reduce(flat, "min"))))


def _check(comm: dict, want: list, run=lambda r: sim.replicated(r, bn=True)):
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(**comm))
    try:
        got = run(repl)
        spread = _same_everywhere(repl, got)
    finally:
        repl.close()
    assert sim.max_difference(got, want) <= 1e-5, sim.max_difference(got, want)
    assert spread == 0.0, spread


def case_h1_without_outer_optimizer_equals_synchronous_momentum_sgd():
    _check({"local_steps": 1}, sim.synchronous(2), lambda r: sim.replicated(r, bn=False))


def case_h4_equals_two_simulated_workers_batch_norm_statistics_included():
    _check({"local_steps": 4}, sim.simulate(2, 4, bn=True))


def case_diloco_outer_nesterov_step_equals_the_simulation():
    _check({"local_steps": 4, "outer_optimizer": "nesterov"}, sim.simulate(2, 4, bn=True, outer=(0.7, 0.9)))


def case_keras_fit_with_distributed_optimizer_equals_the_simulation():
    _check({"local_steps": 4}, sim.simulate(2, 4, bn=True), lambda r: sim.fit(r, bn=True))


def case_a_checkpoint_saved_mid_round_resumes_bit_identically():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=4, outer_optimizer="nesterov"))
    try:
        with tempfile.TemporaryDirectory() as own:
            folder = repl.broadcast_object(own)  # the chief's folder: one machine, every rank reads it
            diff = sim.resume_is_exact(repl, folder)
            repl.reduce(np.zeros(1), "sum")  # the chief's folder outlives every rank's read
    finally:
        repl.close()
    assert diff == 0.0, diff
