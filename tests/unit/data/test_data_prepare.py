"""`hvrep data prepare` and `hvrep data demo`: shards, indexes, resume, bad JPEGs, the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf

from hvrep.data import prepare
from hvrep.data.files import list_shards
from hvrep.errors import DataError
from tests.data_fixtures import write_id_folder

HVREP = str(Path(sys.executable).parent / "hvrep")


@pytest.fixture
def folder(tmp_path):
    truth = write_id_folder(tmp_path / "src", {"train": 30, "val": 11}, classes=3)
    return tmp_path / "src", truth


def _records(dst: Path, split: str) -> list[tuple[int, bytes]]:
    shards = list_shards(dst, split).shards
    out = []
    for rec in tf.data.TFRecordDataset(list(shards)):
        ex = tf.train.Example.FromString(rec.numpy())
        f = ex.features.feature
        out.append((f["image/class/label"].int64_list.value[0], f["image/filename"].bytes_list.value[0]))
    return out


def test_shards_hold_every_image_once_with_tf_style_labels(folder, tmp_path):
    src, truth = folder
    result = prepare(src, tmp_path / "out", train_shards=4, val_shards=2, progress=False)
    assert result.written == {"train": 30, "val": 11} and result.shards_written == 6
    for split in ("train", "val"):
        recs = _records(tmp_path / "out", split)
        names = sorted(name.decode() for _, name in recs)
        assert names == sorted(f"img_{i:05d}.JPEG" for i in truth[split])
        by_name = {name.decode(): label for label, name in recs}
        # 1-based, as TF's and MLPerf's ImageNet shards: class folder index + 1.
        assert all(by_name[f"img_{i:05d}.JPEG"] == label + 1 for i, label in truth[split].items())


def test_index_matches_the_record_offsets(folder, tmp_path):
    src, _ = folder
    prepare(src, tmp_path / "out", train_shards=2, val_shards=1, progress=False)
    listing = list_shards(tmp_path / "out", "train")
    for shard, index in zip(listing.shards, listing.indexes, strict=True):
        data = Path(shard).read_bytes()
        for line in Path(index).read_text().splitlines():
            offset, size = map(int, line.split())
            length = int.from_bytes(data[offset:offset + 8], "little")
            assert size == length + 16  # header (8 + 4) + payload + CRC (4)


def test_resume_rewrites_only_what_is_missing(folder, tmp_path):
    src, _ = folder
    dst = tmp_path / "out"
    prepare(src, dst, train_shards=3, val_shards=1, progress=False)
    victim = dst / "train-00001-of-00003"
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir() if p.is_file() and p != victim}
    victim.unlink()
    (dst / "train-00002-of-00003.tmp").write_bytes(b"half a shard from a killed run")
    again = prepare(src, dst, train_shards=3, val_shards=1, progress=False)
    assert again.shards_written == 1 and again.shards_reused == 3
    assert victim.is_file()
    for name, mtime in before.items():
        if name != "hvrep-manifest.json" and not name.endswith(".tmp"):
            assert (dst / name).stat().st_mtime_ns == mtime, name
    assert len(_records(dst, "train")) == 30


def test_other_settings_on_the_same_destination_are_refused(folder, tmp_path):
    src, _ = folder
    prepare(src, tmp_path / "out", train_shards=3, val_shards=1, progress=False)
    with pytest.raises(DataError, match="other settings"):
        prepare(src, tmp_path / "out", train_shards=5, val_shards=1, progress=False)


def test_bad_jpeg_raises_naming_it_or_is_skipped_and_listed(folder, tmp_path):
    src, _ = folder
    bad = sorted((src / "train" / "c1").iterdir())[2]
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])  # truncated
    with pytest.raises(DataError) as e:
        prepare(src, tmp_path / "a", train_shards=2, val_shards=1, progress=False)
    assert bad.name in str(e.value) and "--on-error skip" in str(e.value)
    result = prepare(src, tmp_path / "b", train_shards=2, val_shards=1, on_error="skip", progress=False)
    assert result.written["train"] == 29 and result.skipped["train"] == [str(bad)]
    manifest = json.loads((tmp_path / "b" / "hvrep-manifest.json").read_text())
    assert manifest["skipped"]["train"] == [str(bad)]


def test_cli_demo_writes_the_digits_as_imagenet_folder_and_tfrecords(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([HVREP, "data", "demo", str(tmp_path / "demo")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    from sklearn.datasets import load_digits

    n = len(load_digits().images)  # 1,797 images ship with scikit-learn
    folder = tmp_path / "demo" / "folder"
    classes = sorted(p.name for p in (folder / "train").iterdir())
    assert classes == [f"digit_{d}" for d in range(10)]
    n_train = sum(1 for _ in (folder / "train").rglob("*.JPEG"))
    n_val = sum(1 for _ in (folder / "val").rglob("*.JPEG"))
    assert n_train + n_val == n and n_val == len(range(0, n, 5))
    assert f"({n_train} train, {n_val} val images)" in res.stdout
    # The prepare CLI on the same folder, to another destination, with a progress bar on stderr.
    res = subprocess.run([HVREP, "data", "prepare", str(folder), str(tmp_path / "tf"), "--train-shards", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "train shards" in res.stderr and "3 shards written" in res.stdout  # 2 train + 1 val
    assert len(list_shards(tmp_path / "tf", "train").shards) == 2


def test_writers_racing_for_the_demo_data_all_succeed_and_leave_one_complete_copy(tmp_path):
    # Jobs (or test workers) reaching for the demo data in a fresh cache at the same moment: each file is written
    # under a name of its own and moved into place, so none finds another's half-written or vanished file.
    import threading

    from hvrep.data import write_demo

    start, errors = threading.Barrier(8), []

    def writer() -> None:
        start.wait()
        try:
            write_demo(tmp_path / "demo")
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [], errors
    from sklearn.datasets import load_digits

    n = len(load_digits().images)
    assert sum(1 for _ in (tmp_path / "demo" / "folder").rglob("*.JPEG")) == n
    leftovers = [p.name for p in (tmp_path / "demo").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers
    records = sum(1 for split in ("train", "val")
                  for _ in tf.data.TFRecordDataset(list(list_shards(tmp_path / "demo" / "tfrecord", split).shards)))
    assert records == n


def test_cli_reports_a_bad_source_as_an_error_not_a_traceback(tmp_path):
    (tmp_path / "src" / "train").mkdir(parents=True)
    res = subprocess.run([HVREP, "data", "prepare", str(tmp_path / "src"), str(tmp_path / "dst")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "holds no class folders" in res.stderr


def test_prepare_copies_jpeg_bytes_unchanged(folder, tmp_path):
    src, _ = folder
    prepare(src, tmp_path / "out", train_shards=1, val_shards=1, progress=False)
    originals = {p.name: p.read_bytes() for p in (src / "val").rglob("*.JPEG")}
    shards = list_shards(tmp_path / "out", "val").shards
    for rec in tf.data.TFRecordDataset(list(shards)):
        f = tf.train.Example.FromString(rec.numpy()).features.feature
        name = f["image/filename"].bytes_list.value[0].decode()
        assert f["image/encoded"].bytes_list.value[0] == originals[name]
    shutil.rmtree(tmp_path / "out")
