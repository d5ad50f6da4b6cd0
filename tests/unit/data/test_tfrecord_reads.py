"""tf.data reads only the TFRecord records a replica uses, by their byte offsets, and yields today's samples.

The bytes read are the kernel's count for this process (``rchar`` of
/proc/self/io: every read and pread of every thread), so the test sees the
reads, not the code's intent. benchmarks/tfrecord_reads.py measures the same
at ImageNet's 1,024 shards.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from hvrep.data import tfdata
from hvrep.data.files import index_entries, list_shards, shard_name
from hvrep.data.plan import EpochPlan
from hvrep.data.prepare import _write_shard
from hvrep.errors import DataError

SHARDS, RECORDS, GROUP = 12, 30, 4  # 3 groups of 4 shards


def _rchar() -> int:
    line = next(ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar:"))
    return int(line.split()[1])


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tfrecords")
    (root / "idx").mkdir()
    rng = np.random.default_rng(0)
    for k in range(SHARDS):
        name = shard_name("train", k, SHARDS)
        # Records of different sizes: offsets are not a multiple of one size.
        _write_shard(root / name, root / "idx" / f"{name}.idx",
                     [rng.bytes(int(rng.integers(500, 3000))) for _ in range(RECORDS)])
    return root


def _read(reader, listing, plan, replica, replicas, batch=4):
    share = plan.share(replica, replicas, batch)
    ds, _ = reader(listing, plan, share, 0)
    it = iter(ds)
    before = _rchar()
    got = [(int(i), rec.numpy()) for rec, i in it]
    return share, got, _rchar() - before


@pytest.mark.parametrize("replicas", [3, 5, 7])  # 3 divides 12 shards (by file); 5 and 7 do not (strided)
def test_every_replica_gets_todays_samples_in_todays_order(shards, replicas):
    listing = list_shards(shards, "train")
    plan = EpochPlan(listing.counts, seed=11, group=GROUP)
    everything = list(tf.data.TFRecordDataset(list(listing.shards)).as_numpy_iterator())  # id order
    for r in range(replicas):
        share, got, _ = _read(tfdata._planned_records, listing, plan, r, replicas)
        _, before, _ = _read(tfdata._whole_group_records, listing, plan, r, replicas)  # the reader until now
        assert got == before
        assert [i for i, _ in got] == share.ids.tolist()
        assert all(rec == everything[i] for i, rec in got)


@pytest.mark.parametrize("replicas", [5, 7])
def test_a_replica_reads_only_the_records_it_uses_when_r_does_not_divide_the_shards(shards, replicas):
    listing = list_shards(shards, "train")
    plan = EpochPlan(listing.counts, seed=11, group=GROUP)
    assert plan.rule(replicas) == "strided"
    sizes = np.concatenate([index_entries(i)[:, 1] for i in listing.indexes])  # by sample id, framing included
    for r in (0, replicas - 1):
        share, _, read = _read(tfdata._planned_records, listing, plan, r, replicas)
        used = int(sizes[share.ids].sum())
        assert read <= 1.25 * used, f"replica {r} of {replicas} read {read:,} bytes for {used:,} used"
    # Reading whole groups (the fallback) reads every shard on every replica: about R times as much.
    share, _, read = _read(tfdata._whole_group_records, listing, plan, 0, replicas)
    assert read >= 0.9 * replicas * sizes[share.ids].sum()


def test_shards_without_an_index_are_read_whole_with_one_warning_and_the_same_samples(shards, tmp_path, caplog):
    shutil.copytree(shards, tmp_path / "t")
    (tmp_path / "t" / "idx" / f"{shard_name('train', 5, SHARDS)}.idx").unlink()
    with pytest.raises(DataError, match="index files are missing"):
        list_shards(tmp_path / "t", "train")  # DALI needs every index
    listing = list_shards(tmp_path / "t", "train", require_index=False)
    assert listing.indexes[5] == "" and listing.counts == (RECORDS,) * SHARDS
    plan = EpochPlan(listing.counts, seed=11, group=GROUP)
    with caplog.at_level(logging.WARNING, logger="hvrep"):
        share, got, _ = _read(tfdata._planned_records, listing, plan, 1, 5)
    warned = [r.getMessage() for r in caplog.records if "have no index" in r.getMessage()]
    assert len(warned) == 1 and "1 of 12" in warned[0] and "Fix:" in warned[0], warned
    indexed = list_shards(shards, "train")
    assert got == _read(tfdata._planned_records, indexed, EpochPlan(indexed.counts, 11, GROUP), 1, 5)[1]
    assert [i for i, _ in got] == share.ids.tolist()


def test_a_stale_index_is_caught_naming_the_shard(shards, tmp_path):
    shutil.copytree(shards, tmp_path / "t")
    idx = tmp_path / "t" / "idx"
    # Another shard's index with the same total length would pass the listing's end-of-file check; shift one
    # record boundary instead, keeping the end.
    name = shard_name("train", 2, SHARDS)
    entries = index_entries(idx / f"{name}.idx")
    entries[1] += [8, -8]
    entries[0, 1] += 8
    (idx / f"{name}.idx").write_text("".join(f"{o} {s}\n" for o, s in entries))
    listing = list_shards(tmp_path / "t", "train")
    plan = EpochPlan(listing.counts, seed=11, group=SHARDS)  # one group: every replica reads shard 2
    with pytest.raises(tf.errors.OpError, match=f"{name}: the record at byte"):
        _read(tfdata._planned_records, listing, plan, 0, 1)
