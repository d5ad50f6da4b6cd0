"""resume.restore in one process (the in-graph backend, 2 replicas): what it restores and what it refuses.

Ranks that see different checkpoints are in tests/multirank/cases_resume.py.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import hvrep
from hvrep.data import Segment
from hvrep.errors import CheckpointError
from hvrep.train import resume
from hvrep.train.checkpoint import CheckpointManager


@pytest.fixture(scope="module")
def repl() -> hvrep.Replicator:
    return hvrep.Replicator("local")


def test_gather_returns_every_replicas_values_in_order(repl):
    assert repl.num_replicas == 2
    assert resume.gather(repl, [3, 4]).tolist() == [[3, 4], [3, 4]]  # one process: the same values


def test_restores_the_newest_or_starts_fresh(repl, tmp_path):
    value = tf.Variable(0.0)
    manager = CheckpointManager(tmp_path, is_chief=True, value=value)
    assert resume.restore(repl, manager) is None
    for step in (4, 6):
        value.assign(float(step))
        manager.save(step, metadata={"position": 2})
    value.assign(0.0)
    point = resume.restore(repl, manager)
    assert point is not None and point.step == 6 and float(value.numpy()) == 6.0
    # A checkpoint from before segments were recorded: its position, at this run's size and batch.
    assert point.segments(2, 64) == [Segment(2, 64, 2)]


def test_a_truncated_newest_checkpoint_is_skipped_and_named(repl, tmp_path, caplog):
    value = tf.Variable(0.0)
    manager = CheckpointManager(tmp_path, is_chief=True, value=value)
    for step in (4, 6):
        value.assign(float(step))
        manager.save(step)
    data = tmp_path / "ckpt-00000006" / "ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:3])
    value.assign(0.0)
    with caplog.at_level("WARNING"):
        point = resume.restore(repl, manager)
    assert point is not None and point.step == 4 and float(value.numpy()) == 4.0
    assert "ckpt-00000006" in caplog.text and "Read less bytes" in caplog.text
    # Nothing intact: every rank refuses, naming each checkpoint and why.
    data = tmp_path / "ckpt-00000004" / "ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:3])
    with pytest.raises(CheckpointError, match=r"every checkpoint .* damaged \(ckpt-00000006: .*; ckpt-00000004: .*"
                                              r"Fix: put back"):
        resume.restore(repl, manager)


@pytest.mark.parametrize(("saved", "now", "without"), [
    ({"steps": 2, "micro_step": 4}, 1, ()),  # at an update boundary k may change
    ({"steps": 2, "micro_step": 4}, 4, ("accumulation",)),
    ({"steps": 1, "micro_step": 0}, 2, ("accumulation",)),  # nothing was accumulated
    ({"steps": 2, "micro_step": 3}, 2, ()),  # pending, same k: restored as saved
])
def test_accumulation_state_is_restored_only_where_it_means_the_same(saved, now, without, tmp_path):
    assert resume._accumulation_rule({"accumulation": saved}, now, tmp_path) == without


def test_pending_micro_batches_need_the_same_accumulation_steps(tmp_path):
    with pytest.raises(CheckpointError, match=r"micro-step 3 with comm.accumulation_steps=2.*Fix: resume with "
                                              r"comm.accumulation_steps=2"):
        resume._accumulation_rule({"accumulation": {"steps": 2, "micro_step": 3}}, 4, tmp_path / "ckpt-00000003")


def _model_and_sgd(repl, optimizer=None):
    import keras

    with repl.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        sgd = keras.optimizers.SGD(0.1, momentum=0.9)
        (optimizer(sgd) if optimizer else sgd).build(model.trainable_variables)
    return model, sgd


def test_a_fit_checkpoint_of_format_1_restores_the_optimizer_nested_in_its_distributed_optimizer(repl, tmp_path):
    import hvrep.keras

    # What the fit loop saved before format 2: the DistributedOptimizer, the optimizer inside it.
    wrapped = []
    model, sgd = _model_and_sgd(repl, lambda o: wrapped.append(hvrep.keras.DistributedOptimizer(o, repl)) or wrapped[0])
    for i, v in enumerate([*model.weights, *sgd.variables]):
        v.assign(tf.cast(tf.fill(v.shape, i + 3), v.dtype))
    saved = [v.numpy() for v in [*model.weights, *sgd.variables]]
    CheckpointManager(tmp_path, is_chief=True, model=model, optimizer=wrapped[0]).save(
        7, metadata={"loop": "fit", "epoch": 0, "position": 7, "world_size": 2, "global_batch": 64})

    model, sgd = _model_and_sgd(repl)  # today's layout in either loop: the optimizer itself
    point = resume.restore(repl, CheckpointManager(tmp_path, is_chief=True, model=model, optimizer=sgd))
    assert point is not None and point.step == 7
    restored = [v.numpy() for v in [*model.weights, *sgd.variables]]
    assert len(restored) == len(saved) and all((a == b).all() for a, b in zip(restored, saved, strict=True))
