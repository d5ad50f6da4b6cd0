"""Local SGD on 2 in-graph replicas (2 logical CPU devices), against a single-process simulation."""

from __future__ import annotations

import numpy as np
import pytest

import hvrep
from hvrep.errors import ConfigError
from tests import localsgd_sim as sim


def _repl(**comm) -> hvrep.Replicator:
    return hvrep.Replicator("local", config=hvrep.CommConfig(**comm))


def _every_copy_equals(parts: list, want: list) -> float:
    return max(sim.max_difference([p[r] for p in parts], want) for r in range(len(parts[0])))


def test_h1_without_outer_optimizer_equals_synchronous_momentum_sgd():
    repl = _repl(local_steps=1)
    parts = sim.replicated(repl, bn=False, parts=True)
    repl.close()
    assert all(len(p) == 2 for p in parts)
    assert _every_copy_equals(parts, sim.synchronous(2)) <= 1e-5


def test_h4_equals_two_simulated_workers_averaged_every_4_steps_batch_norm_statistics_included():
    repl = _repl(local_steps=4)
    parts = sim.replicated(repl, bn=True, parts=True)
    repl.close()
    want = sim.simulate(2, 4, bn=True)
    assert _every_copy_equals(parts, want) <= 1e-5
    moving_mean = want[4]  # conv kernel, bias, gamma, beta, moving mean, ...: the statistics moved from 0
    assert moving_mean.shape == (4,) and np.abs(moving_mean).max() > 1e-2


def test_diloco_outer_nesterov_step_equals_the_simulation():
    repl = _repl(local_steps=4, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    parts = sim.replicated(repl, bn=True, parts=True)
    repl.close()
    assert _every_copy_equals(parts, sim.simulate(2, 4, bn=True, outer=(0.7, 0.9))) <= 1e-5


def test_outer_lr_1_and_momentum_0_is_plain_averaging():
    repl = _repl(local_steps=2, outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0)
    parts = sim.replicated(repl, bn=False, parts=True)
    repl.close()
    assert _every_copy_equals(parts, sim.simulate(2, 2, bn=False)) <= 1e-5


def test_local_sgd_without_the_model_is_refused_with_the_fix():
    repl = _repl(local_steps=4)
    with pytest.raises(ConfigError, match=r"model=None.*wrap_optimizer\(opt, model=model\)"):
        repl.wrap_optimizer(sim.make_optimizer())
    repl.close()


@pytest.mark.parametrize(("comm", "match"), [
    ({"local_steps": 0}, "local_steps must be None"),
    ({"local_steps": 2.0}, "local_steps must be None"),
    ({"outer_optimizer": "nesterov"}, "needs local SGD"),
    ({"local_steps": 4, "outer_optimizer": "adam"}, "outer_optimizer must be one of"),
    ({"local_steps": 4, "outer_lr": 1.0}, "apply only with outer_optimizer"),
    ({"local_steps": 4, "outer_optimizer": "nesterov", "outer_momentum": 1.0}, r"outer_momentum must be .* \[0, 1\)"),
    ({"local_steps": 4, "outer_optimizer": "nesterov", "outer_lr": 0}, "outer_lr must be a number > 0"),
    ({"local_steps": 4, "accumulation_steps": 2}, "cannot be combined"),
    ({"local_steps": 4, "compression": "fp16"}, "compression='fp16'"),
])
def test_invalid_settings_name_the_value_and_the_fix(comm, match):
    with pytest.raises(ConfigError, match=match) as e:
        hvrep.CommConfig(**comm)
    assert "Fix:" in str(e.value)


def test_keras_fit_with_distributed_optimizer_equals_the_simulation():
    repl = _repl(local_steps=4)
    parts = sim.fit(repl, bn=True, parts=True)
    repl.close()
    assert _every_copy_equals(parts, sim.simulate(2, 4, bn=True)) <= 1e-5


def test_keras_fit_ending_mid_round_ends_with_every_replica_on_one_model():
    # 3 steps with H = 4: the replicas' copies have diverged at fit's last step (each trains on other rows);
    # BroadcastGlobalVariablesCallback's on_train_end averages them (the multi-rank case checks the mean itself).
    repl = _repl(local_steps=4)
    parts = sim.fit(repl, bn=True, steps=3, parts=True)
    repl.close()
    assert all(len(p) == 2 for p in parts)
    assert max(float(np.max(np.abs(p[0] - p[1]))) for p in parts) == 0.0


def test_a_checkpoint_saved_mid_round_resumes_bit_identically(tmp_path):
    # The outer optimizer's anchors and momenta, the model and each replica's momentum all go through it.
    repl = _repl(local_steps=4, outer_optimizer="nesterov")
    assert sim.resume_is_exact(repl, str(tmp_path)) == 0.0
    repl.close()
