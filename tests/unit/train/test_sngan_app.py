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


def test_a_few_steps_on_two_replicas_write_metrics_and_checkpoints_and_resume(tmp_path):
    out = tmp_path / "run"
    base = [f"output_dir={out}", "global_batch=8", "steps_per_loop=2", "eval_every=0", "checkpoint_every=2",
            "quality=false"]
    first = train.run(train.config([*base, "steps=3"]))
    assert first["stopped"] == "completed" and first["step"] == 3 and first["replicas"] == 2, first
    lines = _lines(out)
    steps = [r["step"] for r in lines if r["event"] == "train"]
    assert steps == [2, 3], steps  # loops end at steps_per_loop and at max_steps
    assert all(np.isfinite(r["d_loss"]) and np.isfinite(r["g_loss"]) for r in lines if r["event"] == "train")
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == ["ckpt-00000002", "ckpt-00000003"]
    assert json.loads((out / "checkpoints" / "ckpt-00000003" / "checkpoint.json").read_text())["world_size"] == 2

    second = train.run(train.config([*base, "steps=4"]), resume=True)
    assert second["step"] == 4, second
    config = [r for r in _lines(out) if r["event"] == "config"][-1]
    assert config["resumed_from"].endswith("ckpt-00000003"), config
    assert [r["step"] for r in _lines(out) if r["event"] == "train"][-1] == 4


def test_sigterm_stops_every_replica_after_saving(tmp_path):
    out = tmp_path / "run"

    class Once(train._App):  # the signal arrives while the first loop trains
        def train(self, steps):
            if self.step == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().train(steps)

    original, train._App = train._App, Once
    try:
        result = train.run(train.config([f"output_dir={out}", "global_batch=8", "steps=50", "steps_per_loop=1",
                                         "eval_every=0", "checkpoint_every=0", "quality=false"]))
    finally:
        train._App = original
    assert result["stopped"] == "signal" and result["step"] == 1, result
    assert (out / "checkpoints" / "ckpt-00000001").is_dir()


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
    with pytest.raises(ConfigError, match="n_dis must be >= 1, got 0"):
        train.config(["gan.n_dis=0"])
    with pytest.raises(ConfigError, match="steps_per_loop must be >= 1"):
        LoopConfig(max_steps=5, steps_per_loop=0)
    assert _next_boundary(0, LoopConfig(max_steps=100, steps_per_loop=25, eval_every=10)) == 10
    assert _next_boundary(10, LoopConfig(max_steps=12, steps_per_loop=25)) == 12
