"""Resuming on every rank (see runner.py): the chief's checkpoint or one clear error on every rank, and
gradient accumulation carried across a checkpoint. Fails by raising.

The ranks run on one host; each case gives every rank a checkpoint folder of its own to stand for the view
a rank has of a shared folder (an NFS client's cache, a node-local disk).
"""

import shutil
import tempfile
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvrep
from hvrep.errors import CheckpointError
from hvrep.train import resume
from hvrep.train.checkpoint import CheckpointManager
from hvrep.train.steps import Runner

_repl = None


def repl() -> hvrep.Replicator:
    global _repl
    if _repl is None:
        _repl = hvrep.Replicator("horovod")
    return _repl


def _rank() -> int:
    return hvrep.resolve_placement().rank


def _shared_folder() -> Path:
    """A new folder the chief makes; every rank gets its path."""
    path = tempfile.mkdtemp(prefix="hvrep-resume-") if _rank() == 0 else ""
    codes = resume.gather(repl(), list(path.ljust(200).encode()))[0]
    return Path(bytes(codes.astype(np.uint8).tolist()).decode().strip())


def _views(chief_saves: list[int], others: str) -> tuple[Path, CheckpointManager, tf.Variable]:
    """Rank 0's folder holds ``chief_saves``; rank 1's is a copy changed by ``others``. Returns this rank's."""
    root = _shared_folder()
    value = tf.Variable(-1.0)
    if _rank() == 0:
        chief = CheckpointManager(root / "rank0", is_chief=True, keep=5, value=value)
        for step in chief_saves:
            value.assign(float(step))
            chief.save(step)
        shutil.copytree(root / "rank0", root / "rank1")
        theirs = CheckpointManager(root / "rank1", is_chief=True, keep=5, value=value)
        newest = theirs.latest()
        if others == "lacks the newest":
            shutil.rmtree(newest)
        elif others == "has a newer one":
            value.assign(99.0)
            theirs.save(99)
        elif others == "has a damaged newest":
            (newest / "ckpt.data-00000-of-00001").write_bytes(b"\0" * 3)
        value.assign(-1.0)
    resume.gather(repl(), [0])  # the folders are ready
    return root, CheckpointManager(root / f"rank{_rank()}", is_chief=_rank() == 0, keep=5, value=value), value


def _remove(root: Path, r: hvrep.Replicator | None = None) -> None:
    resume.gather(r or repl(), [0])  # every rank is done with the folders
    if _rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def _restore_fails(manager: CheckpointManager) -> str:
    try:
        resume.restore(repl(), manager)
    except CheckpointError as e:
        return str(e)
    raise AssertionError("ranks that disagree were restored")


def case_a_rank_that_cannot_see_the_chiefs_newest_checkpoint_stops_every_rank_naming_both():
    root, manager, value = _views([4, 6], "lacks the newest")
    message = _restore_fails(manager)  # on every rank, with nothing restored
    assert "rank 0 (chief) found ckpt-00000006 (step 6" in message, message
    assert "rank 1 found ckpt-00000004 (step 4" in message, message
    assert "rank(s) 1 cannot read the chief's ckpt-00000006" in message and "Fix:" in message, message
    assert float(value.numpy()) == -1.0
    _remove(root)


def case_a_rank_that_sees_a_newer_checkpoint_follows_the_chief():
    root, manager, value = _views([4, 6], "has a newer one")
    point = resume.restore(repl(), manager)
    assert point is not None and point.step == 6 and point.folder.name == "ckpt-00000006", point
    assert float(value.numpy()) == 6.0
    _remove(root)


def case_a_restore_that_fails_on_one_rank_stops_every_rank():
    root, manager, _ = _views([4, 6], "has a damaged newest")
    message = _restore_fails(manager)
    expected = "Could not restore" if _rank() == 1 else "rank(s) 1 could not restore ckpt-00000006"
    assert expected in message, message
    _remove(root)


def case_gradient_accumulation_continues_exactly_from_a_checkpoint_saved_between_updates():
    # k = 2: micro-steps 1..5, a checkpoint after micro-step 3 (one micro-batch pending). Training on
    # after saving, and training from that checkpoint in fresh objects, must give the same weights.
    r = hvrep.Replicator("horovod", config=hvrep.CommConfig(accumulation_steps=2))
    rng = np.random.default_rng(_rank())
    xs = rng.normal(size=(5, 4, 6)).astype(np.float32)
    ys = rng.integers(0, 3, size=(5, 4)).astype(np.int32)
    root = _shared_folder()

    def build(seed: int) -> tuple[keras.Model, keras.optimizers.Optimizer, Runner, CheckpointManager]:
        keras.utils.set_random_seed(seed)
        with r.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
            opt = keras.optimizers.SGD(0.5, momentum=0.9)
            opt.build(model.trainable_variables)
        runner = Runner(r, model, opt, num_classes=3, label_smoothing=0.0, fp16=False, jit_compile=False)
        assert runner.accumulation is not None
        manager = CheckpointManager(root, is_chief=r.is_chief, model=model, optimizer=opt,
                                    accumulation=runner.accumulation)
        return model, opt, runner, manager

    model, opt, runner, manager = build(0)
    for i in range(5):
        runner.train(tf.constant(xs[i]), tf.constant(ys[i]))
        if i == 2:
            runner.prepare_checkpoint()
            manager.save(3, metadata={"accumulation": runner.accumulation_record()})
    straight = [v.numpy() for v in model.weights]
    assert int(opt.iterations.numpy()) == 2 and int(runner.accumulation.micro_step.numpy()) == 5

    resume.gather(r, [0])  # the chief's save is complete
    model2, opt2, runner2, manager2 = build(1)
    point = resume.restore(r, manager2, accumulation_steps=2)
    assert point is not None and point.metadata["accumulation"] == {"steps": 2, "micro_step": 3}, point
    assert int(runner2.accumulation.micro_step.numpy()) == 3
    for i in (3, 4):
        runner2.train(tf.constant(xs[i]), tf.constant(ys[i]))
    for a, b in zip(straight, [v.numpy() for v in model2.weights], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(opt2.iterations.numpy()) == 2
    # With other accumulation steps the pending micro-batch cannot go on: every rank says so.
    try:
        resume.restore(r, manager2, accumulation_steps=4)
    except CheckpointError as e:
        assert "comm.accumulation_steps=2" in str(e) and "pending" in str(e), e
    else:
        raise AssertionError("a pending accumulation was restored into another accumulation_steps")
    _remove(root, r)
