"""The tf.data pipeline on real JPEGs: shapes, normalisation, exactly-once sharding, bad input."""

from __future__ import annotations

import collections
import shutil

import numpy as np
import pytest
import tensorflow as tf

from hvrep.data import DataConfig, make_dataset, prepare, synthetic_dataset
from hvrep.errors import ConfigError, DataError
from hvrep.replica.context import InputContext
from tests.data_fixtures import ids_of, write_id_folder

COUNTS = {"train": 203, "val": 97}  # neither divides by 2, 3 or the batch


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids")
    truth = write_id_folder(root / "folder", COUNTS)
    prepare(root / "folder", root / "tfrecord", train_shards=6, val_shards=2, progress=False)
    return root, truth


def _config(root, fmt, **kw):
    base = root / ("folder" if fmt == "folder" else "tfrecord")
    return DataConfig(str(base), format=fmt, image_size=16, resize_size=20, **kw)


def _epoch(config, split, ctx):
    rows, batches = [], 0
    for x, y in make_dataset(config, split, ctx):
        rows += ids_of(x.numpy(), y.numpy(), config.mean, config.std, config.layout)
        batches += 1
    return rows, batches


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_training_epoch_sees_distinct_samples_equally_on_every_replica(data, fmt, replicas):
    root, truth = data
    b = 8
    config = _config(root, fmt)
    seen, per_replica = [], []
    for r in range(replicas):
        rows, batches = _epoch(config, "train", InputContext(r, replicas, b))
        seen += rows
        per_replica.append(batches)
    assert len(set(per_replica)) == 1, per_replica  # lockstep
    ids = [i for i, _ in seen]
    assert len(ids) == len(set(ids)), collections.Counter(ids).most_common(3)  # no sample twice
    assert len(ids) == per_replica[0] * replicas * b
    assert len(ids) > COUNTS["train"] - 2 * replicas * b  # at most the remainder (+ shard imbalance) dropped
    assert all(truth["train"][i] == y for i, y in seen)  # labels follow their images


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
def test_evaluation_counts_every_image_exactly_once_with_three_replicas(data, fmt):
    root, truth = data
    config = _config(root, fmt)
    seen, batches = [], []
    for r in range(3):
        rows, n = _epoch(config, "val", InputContext(r, 3, 8))
        seen += rows
        batches.append(n)
    assert len(set(batches)) == 1
    assert sorted(seen) == sorted(truth["val"].items())


def test_evaluation_image_is_resized_center_cropped_and_normalised(data):
    root, truth = data
    config = _config(root, "folder")
    x, y = next(iter(make_dataset(config, "val", batch_size=4)))
    first_id = min(i for i, label in truth["val"].items() if label == 0)  # listing order: class, then name
    from tests.data_fixtures import id_colour

    expected = (np.asarray(id_colour(first_id), np.float32) - np.asarray(config.mean)) / np.asarray(config.std)
    assert x.shape == (4, 16, 16, 3) and y.dtype == tf.int32
    np.testing.assert_allclose(x.numpy()[0], np.broadcast_to(expected, (16, 16, 3)), atol=0.05)


@pytest.mark.parametrize(("layout", "dtype", "shape"), [("NHWC", "float16", (4, 16, 16, 3)),
                                                         ("NCHW", "bfloat16", (4, 3, 16, 16))])
def test_layout_and_dtype(data, layout, dtype, shape):
    root, _ = data
    config = _config(root, "tfrecord", layout=layout, dtype=dtype)
    x, y = next(iter(make_dataset(config, "train", batch_size=4)))
    assert x.shape == shape and x.dtype == tf.as_dtype(dtype) and y.shape == (4,)
    rows = ids_of(tf.cast(x, tf.float32).numpy(), y.numpy(), config.mean, config.std, layout)
    assert len(rows) == 4


def test_synthetic_input_has_the_pipeline_shape():
    config = DataConfig("unused", image_size=16, layout="NCHW", dtype="float16")
    x, y = next(iter(synthetic_dataset(config, batch_size=3, num_classes=10)))
    assert x.shape == (3, 3, 16, 16) and x.dtype == tf.float16 and int(tf.reduce_max(y)) < 10


@pytest.fixture
def corrupt_copy(data, tmp_path):
    root, _ = data
    shutil.copytree(root / "folder", tmp_path / "folder")
    victim = sorted((tmp_path / "folder" / "val" / "c1").iterdir())[0]
    victim.write_bytes(victim.read_bytes()[:200])  # truncated
    garbage = sorted((tmp_path / "folder" / "train" / "c2").iterdir())[0]
    garbage.write_bytes(b"this is not a jpeg" * 10)
    return tmp_path / "folder", victim, garbage


def test_bad_jpeg_raises_naming_the_file(corrupt_copy):
    folder, victim, garbage = corrupt_copy
    for split, bad in (("val", victim), ("train", garbage)):
        config = DataConfig(str(folder), image_size=16, resize_size=20)
        with pytest.raises(tf.errors.InvalidArgumentError) as e:
            for _ in make_dataset(config, split, batch_size=8):
                pass
        assert bad.name in str(e.value) and "corrupt or truncated JPEG" in str(e.value)


def test_bad_jpeg_is_skipped_and_counted(corrupt_copy):
    folder, _, _ = corrupt_copy
    config = DataConfig(str(folder), image_size=16, resize_size=20, on_error="skip")
    val = make_dataset(config, "val", batch_size=8)
    labels = np.concatenate([y.numpy() for _, y in val])
    assert int(val.hvrep_skipped.numpy()) == 1
    assert (labels >= 0).sum() == COUNTS["val"] - 1  # the bad one is a padding row
    train = make_dataset(config, "train", batch_size=8)
    assert sum(1 for _ in train) == COUNTS["train"] // 8  # still full batches
    assert int(train.hvrep_skipped.numpy()) == 1


def test_data_set_layout_errors_name_the_problem(data, tmp_path):
    root, _ = data
    shutil.copytree(root / "folder", tmp_path / "folder")
    (tmp_path / "folder" / "train" / "c9").mkdir()
    with pytest.raises(DataError, match=r"c9 holds no \.JPEG"):
        make_dataset(DataConfig(str(tmp_path / "folder")), "train", batch_size=4)
    shutil.copytree(root / "tfrecord", tmp_path / "tfrecord")
    (tmp_path / "tfrecord" / "train-00003-of-00006").unlink()
    with pytest.raises(DataError, match="train-00003-of-00006"):
        make_dataset(DataConfig(str(tmp_path / "tfrecord"), format="tfrecord"), "train", batch_size=4)


def test_truncated_shard_or_foreign_index_is_caught(data, tmp_path):
    root, _ = data
    shutil.copytree(root / "tfrecord", tmp_path / "t")
    shard = tmp_path / "t" / "validation-00001-of-00002"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"validation-00001-of-00002.*truncated"):
        make_dataset(DataConfig(str(tmp_path / "t"), format="tfrecord"), "val", batch_size=4)
    idx = tmp_path / "t" / "idx"
    shutil.copy(idx / "train-00000-of-00006.idx", idx / "train-00001-of-00006.idx")
    with pytest.raises(DataError, match="index belongs to another shard"):
        make_dataset(DataConfig(str(tmp_path / "t"), format="tfrecord"), "train", batch_size=4)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_shard_cut_short_mid_epoch_is_one_data_error_naming_it(data, tmp_path, on_error):
    # Listed whole when the epoch was built, cut short before its records are read (a file system losing the
    # file's tail mid-run): before, TensorFlow's UnknownError and a traceback, exit 1 in `hvrep train`.
    from hvrep.data import data_errors

    root, _ = data
    shutil.copytree(root / "tfrecord", tmp_path / "t")
    config = DataConfig(str(tmp_path / "t"), format="tfrecord", image_size=16, resize_size=20, on_error=on_error)
    ds = make_dataset(config, "train", batch_size=8)
    shards = sorted((tmp_path / "t").glob("train-*"))
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(DataError) as e, data_errors(config, "train"):
        for _ in ds:
            pass
    message = str(e.value)
    assert any(str(s) in message for s in shards) and "does not match its index entry" in message, message
    assert "hvrep data prepare" in message and "Traceback" not in message and len(message.splitlines()) == 1


def test_config_typos_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="layout must be one of"):
        DataConfig("x", layout="NWHC")
    with pytest.raises(ConfigError, match="image_size"):
        DataConfig("x", image_size=300, resize_size=256)


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_thread_budget_turns_autotuning_off_and_the_same_batches_come(data, split):
    # With `threads` (train.threads) the pipeline keeps to its budget: no autotuning model thread, whose
    # optimisation runs outside it and which deleting an iterator waited for (up to 1.3 s, make demo).
    root, _ = data
    config = _config(root, "tfrecord")
    ctx = InputContext(1, 2, 8)
    budget, free = make_dataset(config, split, ctx, threads=1), make_dataset(config, split, ctx)
    assert budget.options().threading.private_threadpool_size == 1
    assert budget.options().autotune.enabled is False
    assert free.options().autotune.enabled is not False
    for (x1, y1), (x2, y2) in zip(budget, free, strict=True):
        np.testing.assert_array_equal(y1.numpy(), y2.numpy())
        np.testing.assert_array_equal(x1.numpy(), x2.numpy())


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_building_an_epoch_runs_no_autograph_conversion(data, fmt, split, on_error, monkeypatch):
    # hvrep train builds each epoch's pipeline anew; AutoGraph re-parsed every map function's source each time
    # (8% of a one-core rank's throughput on the 2-rank demo). None of hvrep's branches on a tensor in Python.
    # (TensorFlow's own, inside TFRecordDataset's parallel reads, are TensorFlow's choice and not counted.)
    from tensorflow.python.autograph.impl import api

    converted = []
    real = api.converted_call

    def counting(f, *args, **kwargs):
        if getattr(f, "__module__", "").startswith("hvrep"):
            converted.append(getattr(f, "__qualname__", repr(f)))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(api, "converted_call", counting)
    root, _ = data
    ds = make_dataset(_config(root, fmt, on_error=on_error), split, InputContext(0, 2, 8))
    next(iter(ds))
    assert converted == [], sorted(set(converted))[:5]


def test_the_pipelines_name_their_batch_per_replica_and_keep_the_old_name_with_a_warning(data):
    root, _ = data
    config = _config(root, "folder")
    x, y = next(iter(make_dataset(config, "val", per_replica_batch_size=5)))
    assert x.shape[0] == y.shape[0] == 5
    with pytest.warns(DeprecationWarning, match=r"make_dataset\(batch_size=\.\.\.\) is deprecated: it counts the "
                                                r"batch per replica; pass per_replica_batch_size=5"):
        old_x, old_y = next(iter(make_dataset(config, "val", batch_size=5)))
    np.testing.assert_array_equal(old_x.numpy(), x.numpy())
    np.testing.assert_array_equal(old_y.numpy(), y.numpy())
    synthetic = DataConfig("unused", image_size=8)
    assert next(iter(synthetic_dataset(synthetic, per_replica_batch_size=3)))[0].shape[0] == 3
    with pytest.warns(DeprecationWarning, match=r"synthetic_dataset\(batch_size=\.\.\.\) is deprecated"):
        assert next(iter(synthetic_dataset(synthetic, batch_size=3)))[0].shape[0] == 3
    with pytest.raises(ConfigError, match=r"per_replica_batch_size=5 and batch_size=4 are the same argument"), \
            pytest.warns(DeprecationWarning):
        make_dataset(config, "val", per_replica_batch_size=5, batch_size=4)
    with pytest.raises(ConfigError, match=r"a per-replica batch size is needed: pass per_replica_batch_size="):
        make_dataset(config, "val")
