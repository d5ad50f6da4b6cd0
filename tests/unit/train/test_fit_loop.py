"""`hvrep train train.loop=fit`: the demo run trained by Keras' model.fit through hvrep.keras (the real CLI)."""

from __future__ import annotations

import pytest

from hvrep.errors import ConfigError
from hvrep.train import config as configs
from tests.unit.train.test_train_cli import _events, _train, demo_data  # noqa: F401 (a fixture)


def test_loop_is_validated_and_custom_stays_the_default():
    assert configs.build("demo").train.loop == "custom"
    assert configs.build("demo", ["train.loop=fit"]).train.loop == "fit"
    with pytest.raises(ConfigError, match=r"train\.loop must be one of \('custom', 'fit'\), got 'keras'"):
        configs.build("demo", ["train.loop=keras"])


def test_two_ranks_train_through_fit_and_report_like_the_custom_loop(demo_data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    res = _train(["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}", "train.loop=fit",
                  "train.max_steps=6", "train.steps_per_loop=2"], ranks=2)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    config = next(e for e in events if e["event"] == "config")
    assert config["fast_path"]["loop"] == "fit" and config["replicas"] == 2
    epoch = next(e for e in events if e["event"] == "epoch")
    final = next(e for e in events if e["event"] == "final")
    assert final["stopped"] == "max_steps" and final["step"] == 6, final
    assert 0.0 <= epoch["top1"] <= 1.0 and epoch["loss"] > 0, epoch
    assert (out / "checkpoints").is_dir() and final["checkpoint"]
    assert "with model.fit" in res.stdout


def test_fit_refuses_resume_with_the_fix(demo_data, tmp_path):  # noqa: F811
    res = _train(["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={tmp_path}", "train.loop=fit",
                  "--resume"])
    assert res.returncode == 2
    assert "train.loop=custom" in res.stderr
