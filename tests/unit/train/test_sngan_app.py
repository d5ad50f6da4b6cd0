"""The SN-GAN app (examples/sngan) on hvrep.train.loop: a few real steps on 2 in-graph replicas, its outputs,
a resume, a stop on SIGTERM, and its quality measure's Fréchet distance against the closed form.

In-process on the local backend (2 logical CPU devices), the shipped digits through the real input pipeline.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from examples.sngan import train
from examples.sngan.quality import frechet_distance
from hvrep.errors import ConfigError
from hvrep.train.loop import LoopConfig, _next_boundary


def _lines(path):
    return [json.loads(s) for s in (path / "metrics.jsonl").read_text().splitlines()]


# Small networks and one D update per step: the test checks the loop and the app's outputs; the step itself is
# checked against one replica in tests/multirank/test_sngan.py.
SMALL = ["global_batch=8", "steps_per_loop=2", "eval_every=0", "checkpoint_every=2", "quality=false",
         "gan.n_dis=1", "gan.g_width=4", "gan.d_width=4"]


def test_two_replicas_train_stop_on_sigterm_after_saving_and_resume(tmp_path):
    out = tmp_path / "run"

    class SignalledApp(train._App):  # SIGTERM arrives while the second loop (steps 3-4) trains
        def train(self, steps):
            if self.step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train(steps)

    original, train._App = train._App, SignalledApp
    try:
        first = train.run(train.config([f"output_dir={out}", *SMALL, "steps=50"]))
    finally:
        train._App = original
    assert first["stopped"] == "signal" and first["step"] == 4 and first["replicas"] == 2, first
    lines = _lines(out)
    assert [r["step"] for r in lines if r["event"] == "train"] == [2, 4]
    assert all(np.isfinite(r["d_loss"]) and np.isfinite(r["g_loss"]) for r in lines if r["event"] == "train")
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000004"]
    assert json.loads((out / "checkpoints" / "ckpt-00000004" / "checkpoint.json").read_text())["world_size"] == 2

    second = train.run(train.config([f"output_dir={out}", *SMALL, "steps=5"]), resume=True)
    assert second["stopped"] == "completed" and second["step"] == 5, second
    config = [r for r in _lines(out) if r["event"] == "config"][-1]
    assert config["resumed_from"].endswith("ckpt-00000004"), config
    # Loops end at steps_per_loop boundaries and at max_steps: 4 -> 5 is one loop of one step.
    assert [r["step"] for r in _lines(out) if r["event"] == "train"][-1] == 5


def test_frechet_distance_matches_the_closed_form_for_gaussians():
    rng = np.random.default_rng(0)
    a = rng.normal(0.0, 1.0, size=(20000, 3))
    b = rng.normal(0.0, 2.0, size=(20000, 3)) + np.array([1.0, 0.0, 0.0])
    # ||mu_a - mu_b||^2 + Tr(I + 4I - 2 * 2I) = 1 + 3
    assert frechet_distance(a, b) == pytest.approx(4.0, abs=0.1)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)


def test_settings_are_checked_with_the_fix():
    with pytest.raises(ConfigError, match=r"unknown setting 'gan.ndis=3'.*n_dis"):
        train.config(["gan.ndis=3"])
    with pytest.raises(ConfigError, match=r"global_batch='x' is not of type int"):
        train.config(["global_batch=x"])
    with pytest.raises(ConfigError, match=r"n_dis must be in \[1, 63\], got 0"):
        train.config(["gan.n_dis=0"])
    with pytest.raises(ConfigError, match="steps_per_loop must be >= 1"):
        LoopConfig(max_steps=5, steps_per_loop=0)
    assert _next_boundary(0, LoopConfig(max_steps=100, steps_per_loop=25, eval_every=10)) == 10
    assert _next_boundary(10, LoopConfig(max_steps=12, steps_per_loop=25)) == 12
