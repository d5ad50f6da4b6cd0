"""The training loop's host round-trips: one reduce per loop of `train.steps_per_loop` steps, not per step.

In-process on the local backend (2 logical CPU devices), the real app on the demo data.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import hvrep
import hvrep.data
import hvrep.data.tfdata
import hvrep.train.steps
from hvrep.errors import DataError
from hvrep.train import config as configs
from hvrep.train.controller import Controller
from hvrep.train.main import run


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


def _demo_cfg(demo_data, out, **extra):
    return configs.apply_overrides(configs.preset("demo"), {
        "data.data_dir": str(demo_data), "output_dir": str(out), "train.epochs": "3", "train.eval_every": "1",
        "model.width": "4", "optim.warmup_epochs": "0.5", **extra})


def _per_epoch_pipelines(monkeypatch):
    """Each epoch builds its own pipeline, as it does for DALI, a caller's train_dataset or shards without an
    index (the demo's shards have one, so its runs build one pipeline for every epoch)."""
    monkeypatch.setattr(Controller, "_whole_run_batches", lambda self, epoch, at: None)


def test_the_next_epochs_input_starts_while_this_epoch_is_evaluated(demo_data, tmp_path, monkeypatch):
    _per_epoch_pipelines(monkeypatch)
    # Each evaluation waits (up to 20 s) for the next epoch's training pipeline to yield its first batch: the
    # controller must start it before evaluating, not after (otherwise every epoch begins by waiting on it).
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    first_batch = {}  # epoch -> threading.Event set when its first training batch was produced
    real_dataset, real_evaluate = hvrep.data.tfdata_dataset, hvrep.train.steps.Runner.evaluate

    def dataset(config, split, *args, **kwargs):
        ds = real_dataset(config, split, *args, **kwargs)
        if split != "train":
            return ds
        event = first_batch.setdefault(config.seed - cfg.data.seed - cfg.train.seed * 1000, threading.Event())

        def mark(x, y):
            produced = tf.py_function(lambda: event.set() or True, [], tf.bool)
            with tf.control_dependencies([produced]):
                return tf.identity(x), y

        return ds.map(mark)

    waited = []

    def evaluate(self, *args, **kwargs):
        epoch = len(waited) + 1  # the epoch about to start
        waited.append(first_batch.setdefault(epoch, threading.Event()).wait(20) if epoch < 3 else None)
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(hvrep.data, "tfdata_dataset", dataset)
    monkeypatch.setattr(hvrep.train.steps.Runner, "evaluate", evaluate)
    assert run(cfg)["stopped"] == "completed"
    assert waited == [True, True, None]


def _tracked(deleted_on: list) -> type:
    """An iterator wrapper that records the thread it is deleted on."""

    class Tracked:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.it)

        def __del__(self):
            deleted_on.append(threading.current_thread().name)

    return Tracked


def test_a_finished_epochs_iterator_is_deleted_off_the_main_thread(demo_data, tmp_path, monkeypatch):
    _per_epoch_pipelines(monkeypatch)
    # Deleting a tf.data iterator waits for its autotuning thread (up to 1.3 s in make demo): on the main
    # thread that wait delayed the next epoch's first step, and every other rank with it.
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    deleted_on = []
    Tracked = _tracked(deleted_on)

    real_batches = Controller._batches

    def batches(self, train_input):
        it, first = real_batches(self, train_input)
        return Tracked(it), first

    monkeypatch.setattr(Controller, "_batches", batches)
    assert run(cfg)["stopped"] == "completed"
    assert len(deleted_on) == 3 and all(name.startswith("hvrep-release") for name in deleted_on), deleted_on


def test_an_input_error_of_a_later_epoch_is_raised_where_that_epoch_starts(demo_data, tmp_path, monkeypatch):
    _per_epoch_pipelines(monkeypatch)
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    real_dataset = hvrep.data.tfdata_dataset

    def dataset(config, split, *args, **kwargs):
        if split == "train" and config.seed == cfg.data.seed + cfg.train.seed * 1000 + 1:
            raise DataError("shard 3 of the second epoch is missing (test)")
        return real_dataset(config, split, *args, **kwargs)

    monkeypatch.setattr(hvrep.data, "tfdata_dataset", dataset)
    with pytest.raises(DataError, match="second epoch is missing"):
        run(cfg)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The first epoch finished, was evaluated and saved before the error surfaced; nothing after it ran.
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1]
    assert "top1" in next(e for e in events if e["event"] == "epoch")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("ckpt-"))


def test_each_epoch_records_how_long_it_waited_for_its_first_batch(demo_data, tmp_path, monkeypatch):
    # The wait is part of the epoch's time (its images/s), and at scale, where an epoch is a few dozen steps,
    # it is what a short epoch loses at its start: the epoch event says how long it was. The second epoch's
    # input takes 1 s longer to start (its plan, computed as its turn comes); with no evaluation between epochs
    # only the first epoch's end (a metric line and a checkpoint) overlaps it.
    cfg = _demo_cfg(demo_data, tmp_path / "run", **{"train.eval_every": "1000"})
    _slow_plan(monkeypatch, _seed_of(cfg, 1), 1.0)
    assert run(cfg)["stopped"] == "completed"
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    waits = {e["epoch"]: e["input_wait_sec"] for e in events if e["event"] == "epoch"}
    assert sorted(waits) == [1, 2, 3]
    assert waits[2] >= 0.5, waits
    assert waits[3] < waits[2] - 0.5, waits  # the first epoch's wait is for building the pipeline


def _seed_of(cfg, epoch: int) -> int:
    return cfg.data.seed + cfg.train.seed * 1000 + epoch


def _slow_plan(monkeypatch, seed: int, seconds: float = 0.0, error: Exception | None = None) -> None:
    """The run's one pipeline computes the plan of the epoch with ``seed`` ``seconds`` late, or raises."""
    real = hvrep.data.tfdata._record_arrays

    def arrays(listing, plan, share):
        if plan.seed == seed:
            if error is not None:
                raise error
            time.sleep(seconds)
        return real(listing, plan, share)

    monkeypatch.setattr(hvrep.data.tfdata, "_record_arrays", arrays)


def test_one_pipeline_serves_every_epoch_and_trains_as_a_pipeline_per_epoch_does(demo_data, tmp_path, monkeypatch):
    # The demo's shards have an index: the run builds one pipeline for all its epochs (the controller builds
    # and starts it once), and its weights after 3 epochs are those of the run that builds one per epoch.
    built = []
    real = hvrep.data.tfdata_epochs

    def epochs(*args, **kwargs):
        built.append(args[1:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(hvrep.data, "tfdata_epochs", epochs)
    cfg = _demo_cfg(demo_data, tmp_path / "one")
    assert run(cfg)["stopped"] == "completed"
    assert built == [(0, 3), (0, 3)]  # once per replica (2 logical devices), at the first epoch
    _per_epoch_pipelines(monkeypatch)
    assert run(_demo_cfg(demo_data, tmp_path / "each"))["stopped"] == "completed"
    one, each = (_weights(tmp_path / name / "checkpoints") for name in ("one", "each"))
    assert one.keys() == each.keys() and len(one) > 4
    for name in one:
        np.testing.assert_array_equal(one[name], each[name], err_msg=name)


def _weights(checkpoints) -> dict:
    newest = max(p for p in checkpoints.iterdir() if p.name.startswith("ckpt-"))
    reader = tf.train.load_checkpoint(str(newest / "ckpt"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.startswith("model/")}


def test_one_pipeline_reads_the_next_epochs_first_batch_while_this_epoch_is_evaluated(demo_data, tmp_path,
                                                                                      monkeypatch):
    # Every epoch's batches counted as its pipeline makes them (below the prefetch): at each evaluation
    # the pipeline has gone on past the batches trained, into the next epoch.
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    made = collections.Counter()  # batches made, over both replicas' pipelines
    real_batches, real_train, real_evaluate = (hvrep.data.tfdata._train_batches, hvrep.train.steps.Runner.train,
                                               hvrep.train.steps.Runner.evaluate)

    def batches(*args, **kwargs):
        def mark(x, y):
            counted = tf.py_function(lambda: made.update(["batches"]) or True, [], tf.bool)
            with tf.control_dependencies([counted]):
                return tf.identity(x), y

        return real_batches(*args, **kwargs).map(mark)

    def train(self, x, y):
        made.update(["trained"])
        return real_train(self, x, y)

    ahead = []

    def evaluate(self, *args, **kwargs):
        deadline = time.monotonic() + 20
        while made["batches"] <= 2 * made["trained"] and time.monotonic() < deadline:
            time.sleep(0.01)
        ahead.append(made["batches"] - 2 * made["trained"])
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(hvrep.data.tfdata, "_train_batches", batches)
    monkeypatch.setattr(hvrep.train.steps.Runner, "train", train)
    monkeypatch.setattr(hvrep.train.steps.Runner, "evaluate", evaluate)
    assert run(cfg)["stopped"] == "completed"
    # Ahead after epochs 1 and 2; after the last there is no next epoch.
    assert ahead[0] > 0 and ahead[1] > 0 and ahead[2] == 0, ahead


def test_one_pipeline_raises_a_later_epochs_input_error_where_that_epoch_starts(demo_data, tmp_path,
                                                                                  monkeypatch):
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    _slow_plan(monkeypatch, _seed_of(cfg, 1), error=DataError("shard 3 of the second epoch is missing (test)"))
    with pytest.raises(DataError, match="second epoch is missing"):
        run(cfg)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The first epoch finished, was evaluated and saved before the error surfaced; nothing after it ran.
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1]
    assert "top1" in next(e for e in events if e["event"] == "epoch")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("ckpt-")]


def test_one_pipelines_iterator_is_deleted_off_the_main_thread(demo_data, tmp_path, monkeypatch):
    cfg = _demo_cfg(demo_data, tmp_path / "run")
    deleted_on = []
    Tracked = _tracked(deleted_on)

    real = Controller._whole_run_batches
    monkeypatch.setattr(Controller, "_whole_run_batches", lambda self, epoch, at: Tracked(real(self, epoch, at)))
    assert run(cfg)["stopped"] == "completed"
    assert len(deleted_on) == 1 and deleted_on[0].startswith("hvrep-release"), deleted_on
