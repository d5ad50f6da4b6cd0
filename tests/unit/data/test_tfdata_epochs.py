"""hvrep.data.tfdata_epochs: one pipeline for a run's epochs gives each epoch exactly the batches of the pipeline
built for it alone (``tfdata_dataset``), bit for bit: folders and TFRecords, a resumed first epoch, a replica of
several, bad JPEGs skipped; and where it does not apply it says so."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from hvrep.data import DataConfig, EpochPosition, prepare, tfdata_dataset, tfdata_epochs, tfdata_epochs_apply
from hvrep.errors import ConfigError
from hvrep.replica.context import InputContext
from tests.data_fixtures import write_id_folder

COUNTS = {"train": 203, "val": 97}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids")
    write_id_folder(root / "folder", COUNTS)
    prepare(root / "folder", root / "tfrecord", train_shards=6, val_shards=2, progress=False)
    return root


def _config(root, fmt, **kw):
    return DataConfig(str(root / fmt), format=fmt, image_size=16, resize_size=20, seed=7, **kw)


def _per_epoch(config_of, first, stop, ctx, position):
    out = []
    for e in range(first, stop):
        ds = tfdata_dataset(config_of(e), "train", ctx, position=position if e == first else None, threads=1)
        out.append(list(ds.as_numpy_iterator()))
    return out


def _assert_same(one, per_epoch):
    flat = [batch for epoch in per_epoch for batch in epoch]
    assert len(one) == len(flat) and len(flat) > 0
    for k, ((x, y), (x2, y2)) in enumerate(zip(one, flat, strict=True)):
        np.testing.assert_array_equal(x, x2, err_msg=f"batch {k}")
        np.testing.assert_array_equal(y, y2, err_msg=f"batch {k}")


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
@pytest.mark.parametrize("replica,replicas,steps", [(0, 1, 0), (1, 2, 3), (2, 3, 1)])
def test_each_epoch_is_the_pipeline_built_for_it_alone(data, fmt, replica, replicas, steps):
    config = _config(data, fmt)

    def config_of(e):
        return dataclasses.replace(config, seed=config.seed + 1000 + e)

    ctx = InputContext(replica, replicas, 8)
    position = EpochPosition(steps=steps)
    ds = tfdata_epochs(config_of, 2, 5, ctx, position=position, threads=1)
    per_epoch = _per_epoch(config_of, 2, 5, ctx, position)
    _assert_same(list(ds.as_numpy_iterator()), per_epoch)
    # The epochs differ (their own order and crops), and a resumed first epoch is shorter by its steps.
    assert not np.array_equal(per_epoch[1][0][0], per_epoch[2][0][0])
    assert len(per_epoch[0]) == len(per_epoch[1]) - steps


def test_an_epoch_resumed_at_its_end_is_left_out(data):
    config = _config(data, "tfrecord")
    ctx = InputContext(0, 2, 8)
    full = len(list(tfdata_dataset(config, "train", ctx, threads=1).as_numpy_iterator()))
    ds = tfdata_epochs(lambda e: dataclasses.replace(config, seed=e), 0, 2, ctx, position=EpochPosition(steps=full))
    _assert_same(list(ds.as_numpy_iterator()), _per_epoch(lambda e: dataclasses.replace(config, seed=e), 1, 2,
                                                          ctx, None))


def test_bad_jpegs_are_skipped_in_every_epoch_as_alone(data, tmp_path):
    shutil.copytree(data / "folder", tmp_path / "folder")
    garbage = sorted((tmp_path / "folder" / "train" / "c2").iterdir())[0]
    garbage.write_bytes(b"this is not a jpeg" * 10)
    config = _config(tmp_path, "folder", on_error="skip")

    def config_of(e):
        return dataclasses.replace(config, seed=e)

    ctx = InputContext(0, 1, 8)
    ds = tfdata_epochs(config_of, 0, 3, ctx)
    _assert_same(list(ds.as_numpy_iterator()), _per_epoch(config_of, 0, 3, ctx, None))
    # Counted as each epoch alone counts it (an epoch of 25 batches of 8 leaves 3 of the 203 out).
    alone = [tfdata_dataset(config_of(e), "train", ctx) for e in range(3)]
    for epoch in alone:
        sum(1 for _ in epoch)
    counts = [int(epoch.hvrep_skipped.numpy()) for epoch in alone]
    assert int(ds.hvrep_skipped.numpy()) == sum(counts) > 0, counts


def test_it_refuses_a_batch_the_split_cannot_fill_and_declines_shards_without_an_index(data, tmp_path):
    config = _config(data, "tfrecord")
    with pytest.raises(ConfigError, match="cannot fill one global batch"):
        tfdata_epochs(lambda e: config, 0, 2, InputContext(0, 2, 200))
    assert tfdata_epochs_apply(config) and tfdata_epochs_apply(_config(data, "folder"))
    shutil.copytree(data / "tfrecord", tmp_path / "tfrecord")
    shutil.rmtree(tmp_path / "tfrecord" / "idx")
    unindexed = _config(tmp_path, "tfrecord")
    assert not tfdata_epochs_apply(unindexed)
    assert tfdata_epochs(lambda e: unindexed, 0, 2, InputContext(0, 1, 8)) is None
