"""The training loop's host round-trips: one reduce per loop of `train.steps_per_loop` steps, not per step.

In-process on the local backend (2 logical CPU devices), the real app on the demo data.
"""

from __future__ import annotations

import json

import pytest

import hvrep
from hvrep.data import write_demo
from hvrep.train import config as configs
from hvrep.train.main import run


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-data")
    write_demo(root)
    return root / "tfrecord"


def test_one_host_round_trip_per_loop_and_the_same_metrics(demo_data, tmp_path, monkeypatch):
    calls = []
    real_reduce = hvrep.Replicator.reduce

    def counting_reduce(self, value, op):
        calls.append(sorted(value) if isinstance(value, dict) else type(value).__name__)
        return real_reduce(self, value, op)

    monkeypatch.setattr(hvrep.Replicator, "reduce", counting_reduce)
    cfg = configs.apply_overrides(configs.preset("demo"), {
        "data.data_dir": str(demo_data), "output_dir": str(tmp_path / "run"), "train.epochs": "1",
        "train.eval_every": "1", "train.steps_per_loop": "5", "train.log_every": "10", "model.width": "4",
        "optim.warmup_epochs": "0.5"})
    summary = run(cfg)
    loops = [c for c in calls if c == ["stop", "totals"]]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = max(e["step"] for e in events if e["event"] == "epoch")
    # Loops end every 5 steps and at the log boundaries (10, 20) and the epoch's end.
    assert len(loops) == len({*range(5, steps + 1, 5), steps}), (len(loops), steps)
    assert len(loops) < steps / 4
    train = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in train] == list(range(10, steps + 1, 10))
    assert all(0 < e["loss"] < 10 and 0 <= e["train_top1"] <= 1 for e in train)
    assert summary["stopped"] == "completed" and summary["images_per_sec"] > 0
