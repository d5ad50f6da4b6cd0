"""CheckpointManager: round trips, keep-last-k, chief-only writes, and atomicity under crashes and full disks."""

from __future__ import annotations

import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep.errors import CheckpointError, ConfigError
from hvrep.train.checkpoint import CheckpointManager, read_metadata


class State:
    """A small model, a momentum-SGD optimizer and the loop's counters."""

    def __init__(self, seed: int, build: bool = True) -> None:
        keras.utils.set_random_seed(seed)
        self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
        self.optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        if build:
            self.optimizer.build(self.model.trainable_variables)
        self.step = tf.Variable(0, dtype=tf.int64)
        self.epoch = tf.Variable(0, dtype=tf.int64)
        self.position = tf.Variable(0, dtype=tf.int64)

    def train(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        grads = [tf.constant(rng.normal(size=v.shape).astype(np.float32)) for v in self.model.trainable_variables]
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        self.step.assign_add(1)
        self.position.assign_add(1)

    def values(self) -> list[np.ndarray]:
        variables = [*self.model.weights, *self.optimizer.variables, self.step, self.epoch, self.position]
        return [np.array(v.numpy()) for v in variables]

    def manager(self, directory: os.PathLike, is_chief: bool = True, keep: int = 3) -> CheckpointManager:
        return CheckpointManager(directory, is_chief=is_chief, keep=keep, model=self.model,
                                 optimizer=self.optimizer, step=self.step, epoch=self.epoch, position=self.position)


def _assert_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def _names(paths: list) -> list[str]:
    return [p.name for p in paths]


def _hidden(directory: os.PathLike) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


@pytest.mark.parametrize("build", [True, False], ids=["built-then-restored", "restored-then-built"])
def test_round_trip_restores_weights_optimizer_slots_and_counters(tmp_path, build):
    saved = State(seed=1)
    saved.train()
    saved.epoch.assign(3)
    slots = saved.optimizer.variables[2:]
    assert slots and all(np.any(v.numpy() != 0) for v in slots)  # momentum is non-zero after one apply
    path = saved.manager(tmp_path).save(7, {"epoch": 3, "position": 1, "config": {"lr": 0.1}})
    assert path == tmp_path / "ckpt-00000007"

    fresh = State(seed=2, build=build)
    assert fresh.manager(tmp_path).restore() == path
    if not build:
        fresh.optimizer.build(fresh.model.trainable_variables)  # slots get their saved values on creation
    _assert_equal(fresh.values(), saved.values())
    meta = read_metadata(path)
    assert (meta["step"], meta["epoch"], meta["position"], meta["config"]) == (7, 3, 1, {"lr": 0.1})

    # The restored run continues exactly like the saving one.
    saved.train(seed=5)
    fresh.train(seed=5)
    _assert_equal(fresh.values(), saved.values())


def test_restore_with_nothing_saved_is_a_fresh_start(tmp_path):
    state = State(seed=1)
    before = state.values()
    manager = state.manager(tmp_path / "new")
    assert manager.restore() is None and manager.latest() is None and manager.all() == []
    _assert_equal(state.values(), before)


def test_keeps_the_last_k(tmp_path):
    state = State(seed=1)
    manager = state.manager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(step)
    assert _names(manager.all()) == ["ckpt-00000002", "ckpt-00000003"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000002", "ckpt-00000003"]


def test_non_chief_writes_nothing_but_restores_what_the_chief_wrote(tmp_path):
    directory = tmp_path / "shared"
    chief, worker = State(seed=1), State(seed=2)
    assert worker.manager(directory, is_chief=False).save(1) is None
    assert not directory.exists()

    chief.train()
    chief.manager(directory).save(1)
    assert worker.manager(directory, is_chief=False).restore() == directory / "ckpt-00000001"
    _assert_equal(worker.values(), chief.values())


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned(tmp_path):
    state = State(seed=1)
    manager = state.manager(tmp_path)
    first = manager.save(1)
    # A save killed before its rename: complete-looking files, but not under a final name.
    shutil.copytree(first, tmp_path / ".tmp-ckpt-2-99999")
    (tmp_path / ".deleting-ckpt-00000000-abcd").mkdir()
    assert manager.latest() == first and manager.all() == [first]
    with pytest.raises(CheckpointError, match="unfinished save"):
        manager.restore(tmp_path / ".tmp-ckpt-2-99999")

    manager.save(3)
    assert _hidden(tmp_path) == []
    assert _names(manager.all()) == ["ckpt-00000001", "ckpt-00000003"]


def test_saving_a_step_again_replaces_it_atomically(tmp_path):
    state = State(seed=1)
    manager = state.manager(tmp_path)
    manager.save(5, {"version": 1})
    state.train()
    second = state.values()
    path = manager.save(5, {"version": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005"]
    assert read_metadata(path)["version"] == 2

    # Killed between the two renames of another overwrite: the step's previous version was moved aside
    # and the new one not yet in place. The aside copy still counts, and the next save puts it back.
    os.replace(path, tmp_path / ".replaced-ckpt-5-99999")
    fresh = State(seed=2)
    assert fresh.manager(tmp_path).restore() == tmp_path / ".replaced-ckpt-5-99999"
    _assert_equal(fresh.values(), second)
    manager.save(6)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005", "ckpt-00000006"]
    assert read_metadata(tmp_path / "ckpt-00000005")["version"] == 2


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   tf.errors.ResourceExhaustedError(None, None, "No space left on device")],
                         ids=["OSError", "tf-error"])
@pytest.mark.parametrize("step", [2, 1], ids=["new-step", "same-step"])
def test_disk_full_keeps_previous_checkpoints_and_leaves_nothing_partial(tmp_path, monkeypatch, error, step):
    state = State(seed=1)
    state.train()
    manager = state.manager(tmp_path)
    manager.save(1)
    saved = state.values()
    write = manager._checkpoint.write

    def write_then_fail(prefix):
        write(prefix)  # the files are (partly) there when the disk fills up
        raise error

    monkeypatch.setattr(manager._checkpoint, "write", write_then_fail)
    state.train()
    with pytest.raises(CheckpointError, match="No space left") as info:
        manager.save(step)
    message = str(info.value)
    assert str(tmp_path) in message and f"step {step}" in message and "Free space there" in message
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001"]
    fresh = State(seed=2)
    fresh.manager(tmp_path).restore()
    _assert_equal(fresh.values(), saved)


def test_after_restoring_an_older_checkpoint_new_saves_are_the_newest(tmp_path):
    state = State(seed=1)
    manager = state.manager(tmp_path, keep=2)
    manager.save(10)
    manager.save(20)
    manager.restore(tmp_path / "ckpt-00000010")
    manager.save(11)
    assert manager.latest() == tmp_path / "ckpt-00000011"
    assert _names(manager.all()) == ["ckpt-00000020", "ckpt-00000011"]


def test_restore_of_a_missing_path_lists_the_available_ones(tmp_path):
    manager = State(seed=1).manager(tmp_path)
    manager.save(1)
    manager.save(2)
    missing = tmp_path / "ckpt-00000009"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        manager.restore(missing)
    assert str(missing) in str(info.value) and "ckpt-00000001, ckpt-00000002" in str(info.value)


def test_restore_into_a_different_model_names_the_folder(tmp_path):
    State(seed=1).manager(tmp_path).save(1)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5), keras.layers.Dense(2)])
    with pytest.raises(CheckpointError, match="ckpt-00000001"):
        CheckpointManager(tmp_path, is_chief=True, model=other).restore()


def test_restore_without_leaves_state_the_checkpoint_lacks_alone(tmp_path):
    State(seed=1).manager(tmp_path).save(1)
    state, extra = State(seed=2), tf.Variable(7.0)
    manager = CheckpointManager(tmp_path, is_chief=True, model=state.model, extra=extra)
    with pytest.raises(CheckpointError, match="ckpt-00000001"):
        manager.restore()  # `extra` is not in the checkpoint
    assert manager.restore(without=("extra",)).name == "ckpt-00000001" and float(extra.numpy()) == 7.0
    _assert_equal([v.numpy() for v in state.model.weights], State(seed=1).values()[:4])
    with pytest.raises(ConfigError, match=r"without names \['nope'\]"):
        manager.restore(without=("nope",))


def test_a_truncated_data_file_is_a_checkpoint_error_naming_the_folder(tmp_path):
    folder = State(seed=1).manager(tmp_path).save(1)
    (folder / "ckpt.data-00000-of-00001").write_bytes(b"\0" * 3)
    with pytest.warns(UserWarning, match="no older one is intact"), \
            pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged .*ckpt-00000001"):
        State(seed=2).manager(tmp_path).restore()


@pytest.mark.parametrize("damage", ["truncated", "bit flipped"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, damage):
    state = State(seed=1)
    manager = state.manager(tmp_path)
    manager.save(1)
    saved = state.values()
    state.train()
    newest = manager.save(2)
    data = newest / "ckpt.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    if damage == "truncated":
        del raw[len(raw) // 2:]
    else:
        raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    fresh = State(seed=2)
    with pytest.warns(UserWarning, match=r"skipped checkpoint .*ckpt-00000002 .*resuming from ckpt-00000001"):
        assert fresh.manager(tmp_path).restore().name == "ckpt-00000001"
    _assert_equal(fresh.values(), saved)


def test_bad_arguments_are_named(tmp_path):
    state = State(seed=1)
    with pytest.raises(ConfigError, match=r"keep must be an int >= 1.*got 0"):
        state.manager(tmp_path, keep=0)
    with pytest.raises(ConfigError, match="nothing to save"):
        CheckpointManager(tmp_path, is_chief=True)
    with pytest.raises(ConfigError, match="gs://bucket"):
        CheckpointManager("gs://bucket/run", is_chief=True, step=state.step)

    class Wrapper:
        inner = state.optimizer

    with pytest.raises(ConfigError, match=r"optimizer=optimizer\.inner"):
        CheckpointManager(tmp_path, is_chief=True, optimizer=Wrapper())
    manager = state.manager(tmp_path, is_chief=False)  # arguments are checked on every rank
    with pytest.raises(ConfigError, match="step must be an int >= 0, got -1"):
        manager.save(-1)
    with pytest.raises(ConfigError, match=r"\['step'\] are reserved"):
        manager.save(1, {"step": 1})
    with pytest.raises(ConfigError, match="JSON-serialisable"):
        manager.save(1, {"loss": tf.constant(1.0)})
