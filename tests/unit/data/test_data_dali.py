"""The DALI pipeline on the demo digits (real DALI, CPU): shapes, normalisation, sharding, labels, bad input.

Samples are told apart by their pixels: with ``image_size == resize_size == 32``
(the demo's size), crop area and ratio fixed at 1 and no flip, training and
evaluation both output each image unchanged, so a row's de-normalised pixels
identify the file it came from (the 1,797 digits are all different).
"""

from __future__ import annotations

import collections
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from hvrep.data import DataConfig, write_demo
from hvrep.data.config import PAD_LABEL
from hvrep.data.dali import dali_dataset, dali_errors
from hvrep.data.files import list_folder, list_shards
from hvrep.errors import ConfigError, DataError
from hvrep.replica.context import InputContext


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    write_demo(root)
    return root


def _config(root: Path, fmt: str, **kw) -> DataConfig:
    return DataConfig(str(root / fmt), format=fmt, **{"image_size": 24, "resize_size": 28, **kw})


def _identity(root: Path, fmt: str, **kw) -> DataConfig:
    return _config(root, fmt, image_size=32, resize_size=32, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0),
                   flip=False, **kw)


def _rows(ds: tf.data.Dataset, config: DataConfig) -> tuple[list[tuple[bytes, int]], int]:
    """(pixels, label) of every row (NHWC, float32) and the number of batches."""
    rows, batches = [], 0
    for x, y in ds:
        pixels = np.rint(x.numpy() * np.asarray(config.std) + np.asarray(config.mean)).clip(0, 255).astype(np.uint8)
        rows += [(p.tobytes(), int(label)) for p, label in zip(pixels, y.numpy(), strict=True)]
        batches += 1
    return rows, batches


@pytest.fixture(scope="module")
def truth(demo):
    """{split: {pixels: (file, label)}} from one unsharded evaluation pass over the folder."""
    out = {}
    for split in ("train", "val"):
        listing = list_folder(demo / "folder", split)
        config = _identity(demo, "folder")
        rows, _ = _rows(dali_dataset(config, split, per_replica_batch_size=100, training=False), config)
        real = [r for r in rows if r[1] != PAD_LABEL]
        assert [y for _, y in real] == list(listing.labels)  # listing order, class index of the sorted folders
        out[split] = {p: (f, y) for (p, y), f in zip(real, listing.files, strict=True)}
        assert len(out[split]) == len(listing.files)  # every image tells itself apart
    return out


@pytest.mark.parametrize(("fmt", "training", "layout", "dtype"), [
    ("folder", True, "NHWC", "float32"), ("folder", False, "NCHW", "float16"),
    ("tfrecord", True, "NCHW", "bfloat16"), ("tfrecord", False, "NHWC", "float32")])
def test_output_shapes_dtypes_and_layout(demo, fmt, training, layout, dtype):
    config = _config(demo, fmt, layout=layout, dtype=dtype)
    x, y = next(iter(dali_dataset(config, "train" if training else "val", per_replica_batch_size=8)))
    assert x.shape == ((8, 24, 24, 3) if layout == "NHWC" else (8, 3, 24, 24))
    assert x.dtype == tf.as_dtype(dtype) and y.shape == (8,) and y.dtype == tf.int32
    values = tf.cast(x, tf.float32).numpy()
    assert np.isfinite(values).all() and -3 < values.mean() < 3 and 0 <= y.numpy().min() and y.numpy().max() < 10


def _bilinear(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """Half-pixel-centre bilinear resize without antialiasing (what tf.image.resize does)."""
    def taps(n: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = np.clip((np.arange(n) + 0.5) * size / n - 0.5, 0, size - 1)
        lo = np.floor(c).astype(int)
        return lo, np.minimum(lo + 1, size - 1), c - lo

    y0, y1, wy = taps(h, a.shape[0])
    x0, x1, wx = taps(w, a.shape[1])
    a = a[y0] * (1 - wy)[:, None, None] + a[y1] * wy[:, None, None]
    return a[:, x0] * (1 - wx)[None, :, None] + a[:, x1] * wx[None, :, None]


def test_evaluation_image_is_resized_center_cropped_and_normalised(demo):
    from PIL import Image

    config = _config(demo, "folder")
    x, _ = next(iter(dali_dataset(config, "val", per_replica_batch_size=4)))
    image = np.asarray(Image.open(list_folder(demo / "folder", "val").files[0]).convert("RGB"), np.float64)
    crop = _bilinear(image, 28, 28)[2:26, 2:26]  # shorter side 32 -> 28, center 24 x 24
    expected = (crop - np.asarray(config.mean)) / np.asarray(config.std)
    np.testing.assert_allclose(x.numpy()[0], expected, atol=0.05)  # 0.05 sd ~ 3 grey levels


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_training_epoch_sees_distinct_samples_equally_on_every_replica(demo, truth, fmt, replicas):
    b = 16
    config = _identity(demo, fmt)
    seen, batches = [], []
    for r in range(replicas):
        rows, n = _rows(dali_dataset(config, "train", InputContext(r, replicas, b)), config)
        seen += rows
        batches.append(n)
    n_train = len(truth["train"])
    assert batches == [n_train // (replicas * b)] * replicas  # lockstep
    pixels = [p for p, _ in seen]
    assert len(pixels) == n_train // (replicas * b) * replicas * b
    assert len(set(pixels)) == len(pixels)  # no sample twice, across replicas too
    assert all(truth["train"][p][1] == y for p, y in seen)  # a known image, with its own label


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
@pytest.mark.parametrize("replicas", [3, 7])
def test_evaluation_counts_every_image_exactly_once(demo, truth, fmt, replicas):
    b = 16
    config = _identity(demo, fmt)
    seen, batches = [], []
    for r in range(replicas):
        rows, n = _rows(dali_dataset(config, "val", InputContext(r, replicas, b)), config)
        seen += rows
        batches.append(n)
    assert len(set(batches)) == 1  # every replica runs the same number of steps
    real = [(p, y) for p, y in seen if y != PAD_LABEL]
    assert sorted(real) == sorted((p, y) for p, (_, y) in truth["val"].items())  # each image once, right label
    expected = collections.Counter(list_folder(demo / "folder", "val").labels)
    assert collections.Counter(y for _, y in real) == expected
    assert len(seen) - len(real) == batches[0] * replicas * b - len(truth["val"])  # the rest is padding


def test_folder_and_tfrecord_give_the_same_labels(demo):
    counts = {}
    for fmt in ("folder", "tfrecord"):
        ds = dali_dataset(_config(demo, fmt), "train", per_replica_batch_size=64, training=False)
        labels = np.concatenate([y.numpy() for _, y in ds])
        counts[fmt] = collections.Counter(labels[labels != PAD_LABEL].tolist())
    assert counts["folder"] == counts["tfrecord"] == collections.Counter(list_folder(demo / "folder", "train").labels)


def test_seed_picks_the_epoch_and_a_replay_repeats_it(demo):
    def labels(seed):
        ds = dali_dataset(_config(demo, "folder", seed=seed), "train", per_replica_batch_size=32)
        return np.concatenate([y.numpy() for _, y in ds.take(3)])

    assert (labels(0) == labels(0)).all()
    assert (labels(0) != labels(1)).any()


def test_batch_size_errors_say_what_is_missing(demo):
    with pytest.raises(ConfigError, match="per-replica batch size is needed"):
        dali_dataset(_config(demo, "folder"), "val")
    with pytest.raises(ConfigError, match="cannot fill one global batch"):
        dali_dataset(_config(demo, "folder"), "val", InputContext(0, 2, 1000), training=True)


@pytest.fixture
def corrupt_folder(demo, tmp_path):
    shutil.copytree(demo / "folder", tmp_path / "folder")
    victim = sorted((tmp_path / "folder" / "val" / "digit_3").iterdir())[0]
    victim.write_bytes(b"this is not a jpeg" * 20)
    truncated = sorted((tmp_path / "folder" / "train" / "digit_2").iterdir())[0]
    truncated.write_bytes(truncated.read_bytes()[:300])
    return tmp_path, victim, truncated


def test_bad_jpeg_raises_a_data_error_naming_the_file(corrupt_folder):
    root, victim, truncated = corrupt_folder
    config = _config(root, "folder")
    # What DALI itself says: the operator, not the file.
    with pytest.raises(tf.errors.OpError, match="nvImageCodec failure") as raw:
        for _ in dali_dataset(config, "val", per_replica_batch_size=16):
            pass
    assert victim.name not in str(raw.value)
    for split, bad in (("val", victim), ("train", truncated)):
        with pytest.raises(DataError, match=rf"{bad.name}: .*nvImageCodec failure.*data.on_error=skip"), \
                dali_errors(config, split):
            for _ in dali_dataset(config, split, per_replica_batch_size=16):
                pass


def test_bad_jpeg_is_skipped_and_counted(corrupt_folder, caplog):
    root, victim, _ = corrupt_folder
    config = _config(root, "folder", on_error="skip")
    with caplog.at_level(logging.WARNING, logger="hvrep.data.dali"):
        val = dali_dataset(config, "val", per_replica_batch_size=16)
    assert "skipped 1 val images" in caplog.text and victim.name in caplog.text
    assert int(val.hvrep_skipped.numpy()) == 1
    labels = np.concatenate([y.numpy() for _, y in val])
    assert (labels != PAD_LABEL).sum() == len(list_folder(root / "folder", "val").files) - 1
    train = dali_dataset(config, "train", per_replica_batch_size=16)
    labels = np.concatenate([y.numpy() for _, y in train])
    assert len(labels) == (len(list_folder(root / "folder", "train").files) - 1) // 16 * 16 and labels.min() >= 0


def test_bad_record_in_a_shard_is_named_or_skipped(demo, tmp_path):
    shutil.copytree(demo / "tfrecord", tmp_path / "tfrecord")
    listing = list_shards(tmp_path / "tfrecord", "val")
    shards, indexes = listing.shards, listing.indexes
    offset, size = map(int, Path(indexes[0]).read_text().splitlines()[5].split())
    data = bytearray(Path(shards[0]).read_bytes())
    start = data.index(b"\xff\xd8\xff", offset, offset + size)
    data[start:start + 2] = b"\0\0"  # no start-of-image marker; the record keeps its length
    Path(shards[0]).write_bytes(bytes(data))
    config = _config(tmp_path, "tfrecord")
    with pytest.raises(DataError, match=r"validation-00000-of-00002 record 5 \(image/filename digit_\d+\.JPEG\)"), \
            dali_errors(config, "val"):
        for _ in dali_dataset(config, "val", per_replica_batch_size=16):
            pass
    skipping = dali_dataset(_config(tmp_path, "tfrecord", on_error="skip"), "val", per_replica_batch_size=16)
    labels = np.concatenate([y.numpy() for _, y in skipping])
    assert int(skipping.hvrep_skipped.numpy()) == 1 and (labels != PAD_LABEL).sum() == 359


def test_hvrep_indexes_equal_dalis_tfrecord2idx(demo, tmp_path):
    shards = sorted(p for p in (demo / "tfrecord").iterdir() if p.is_file() and "-of-" in p.name)
    tool = Path(sys.executable).parent / "tfrecord2idx"
    pairs = [(str(s), str(tmp_path / f"{s.name}.idx")) for s in shards]
    # One interpreter for every shard: the tool imports TensorFlow, which takes seconds.
    code = (f"import runpy, sys\nfor shard, out in {pairs!r}:\n    sys.argv = ['tfrecord2idx', shard, out]\n"
            f"    runpy.run_path({str(tool)!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    for shard, out in pairs:
        assert Path(out).read_bytes() == (demo / "tfrecord" / "idx" / f"{Path(shard).name}.idx").read_bytes()
