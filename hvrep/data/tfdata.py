"""The tf.data pipeline: parallel JPEG decode, the shared augmentation, prefetch, autotune.

Training: random-resized-crop (``tf.image.stateless_sample_distorted_bounding_box``
with ``config.crop_scale``/``crop_ratio``, decoded with ``decode_and_crop_jpeg``
so only the crop is decoded), resize to ``image_size``, random horizontal
flip, normalise. Evaluation: resize the shorter side to ``resize_size``,
center-crop ``image_size``, normalise. The DALI pipeline applies the same.

Training follows the epoch plan (``hvrep.data.plan``): replica r reads
exactly its sample ids, in order, and every replica yields the same number
of batches, so collectives stay in lockstep. A folder: only the replica's
files are opened. TFRecords: one group of shards at a time, the replica's
planned records only, each read by its byte offset from the shard's DALI
index (the next group is read while this one is consumed); by the plan's "by
file" rule (shard count divisible by R) a replica reads only its own shards,
by the strided rule its 1/R of every group. Shards without an index are read
whole, group by group, with a warning. Resuming mid-epoch
(``position``) drops the trained batches' ids before anything is read; the
crop and flip of a sample are seeded by the epoch's seed and the sample id,
so a resumed run (at any world size) augments a sample as the interrupted run
would have. Evaluation: no shuffle; each replica's part is padded to a whole
number of batches with rows labelled ``PAD_LABEL`` (-1) that carry zero images
and must not count, so every validation image is counted exactly once.

Bad JPEGs: a file without JPEG start/end markers (garbage, truncated) fails
with an error that names it (``on_error="raise"``) or is dropped and counted
in ``dataset.hvrep_skipped`` (``"skip"``; evaluation replaces it with a
padding row so the count per replica does not change).

Cost (``benchmarks/input_pipeline.py``, stage cases): a training sample is
one map — read or parse, check, crop window, decode the crop, resize, flip,
normalise and cast — and the batch only collects finished images. Of ~800 us
of CPU per image (438x380 JPEGs; a full decode alone is ~630), decoding the
crop is ~460, the resize ~150, read + window ~75, flip, normalise and the
batch copy ~40 each. The pixels are pinned bit for bit by
``tests/unit/data/test_data_pixels.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from hvrep.data.config import PAD_LABEL, DataConfig, renamed_batch, replica_batch
from hvrep.data.files import FolderListing, ShardListing, index_entries, list_folder, list_shards, read_records
from hvrep.data.plan import EpochPlan, EpochPosition, ReplicaShare, plan_for
from hvrep.errors import ConfigError, DataError
from hvrep.replica.context import InputContext

AUTOTUNE = tf.data.AUTOTUNE
_log = logging.getLogger("hvrep")
# A training source's element -> (JPEG bytes, label, file name, sample id).
_Load = Callable[..., tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]]


def _as_written(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a ``map``, ``filter`` or ``flat_map`` of the pipeline, traced as written, without AutoGraph.

    Each epoch builds its pipeline anew (its own order and seed), so tf.data traces every function again, and
    AutoGraph re-parsed each one's source every time. None of these functions branches or loops on a tensor in
    Python (only on settings), which is all AutoGraph would convert. A rank that has one core pays for that
    work out of its training steps: on the 2-rank demo under ``horovodrun --gloo`` (epochs of about a second)
    the conversion cost 8% of the throughput (docs/performance.md, "CPU budget per rank").
    """
    return tf.autograph.experimental.do_not_convert(fn)


def _jpeg_ok(data: tf.Tensor) -> tf.Tensor:
    """Start-of-image and end-of-image markers present: catches garbage and truncated files."""
    n = tf.strings.length(data)
    head = tf.strings.substr(data, 0, 2)
    tail = tf.strings.substr(data, tf.maximum(n - 2, 0), 2)
    return tf.logical_and(tf.equal(head, b"\xff\xd8"), tf.equal(tail, b"\xff\xd9"))


# What the check of a training or evaluation image says when it fails (tf.debugging.Assert's message, which
# names the file or record); tfdata_errors turns it into one DataError.
_BAD_JPEG = "hvrep: corrupt or truncated JPEG (no start/end marker):"
_BAD_JPEG_RE = re.compile(re.escape(_BAD_JPEG) + r"\]?\s*\[?([^\]\n]*)")
# A DataError raised inside the pipeline (read_records in a tf.numpy_function: a shard cut short or rewritten
# after the run listed it) reaches the caller as a TensorFlow error with the DataError's text in its message.
_DATA_ERROR_RE = re.compile(r"DataError: ([^\n]+)")


@contextlib.contextmanager
def tfdata_errors(config: DataConfig, split: str) -> Iterator[None]:
    """Turns the pipeline's failed JPEG check, wherever TensorFlow raises it, into one ``DataError``.

    Raises:
      hvrep.errors.DataError: an image of ``split`` is corrupt (with ``data.on_error=raise``), or a TFRecord
        shard no longer matches its index (cut short or rewritten after the run listed it; any ``on_error``).
    """
    try:
        yield
    except tf.errors.OpError as e:
        found = _BAD_JPEG_RE.search(str(e))
        if found is None:
            inside = _DATA_ERROR_RE.search(str(e))
            if inside is None:
                raise
            raise DataError(f"{inside.group(1).strip()} (data.data_dir={config.data_dir}, {split})") from e
        where = found.group(1).strip()
        what = "the file" if config.format == "folder" else "the record's source image and rerun `hvrep data prepare`"
        raise DataError(
            f"{where} in data.data_dir={config.data_dir} ({split}) is a corrupt or truncated JPEG (no start/end "
            f"marker). Fix: replace or delete {what}, or set data.on_error=skip to leave bad images out (they are "
            "counted and named in the log and metrics.jsonl)."
        ) from e


def _parse_record(record: tf.Tensor, label_offset: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    parsed = tf.io.parse_single_example(record, {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/filename": tf.io.FixedLenFeature([], tf.string, default_value=""),
    })
    label = tf.cast(parsed["image/class/label"], tf.int32) - label_offset
    return parsed["image/encoded"], label, parsed["image/filename"]


def _normalise(image: tf.Tensor, config: DataConfig) -> tf.Tensor:
    """``image * (1 / std) + (-mean / std)`` in float32, for one (image_size, image_size, 3) image.

    Per image, right after its resize (the pixels are still in cache), and with
    the per-channel constants tiled to a whole row (W x 3 values) over rows of
    the image: Eigen broadcasts a 3-vector along a 3-wide innermost axis
    element by element (eager, a batch of 64: 532 us per 224x224 image vs 146
    us in the row form; the same products and sums, bit for bit). Done per
    batch with the 3-vector, as before, the training pipeline cost 1236 us of
    CPU per image; now 799, normalising 51 of it (benchmarks/input_pipeline.py:
    its variant "normalise per batch, 3-vector constants" vs stage 7; per batch
    with row-wide constants: 847).
    """
    size = config.image_size
    scale = tf.constant([1.0 / s for s in config.std] * size, tf.float32)
    shift = tf.constant([-m / s for m, s in zip(config.mean, config.std, strict=True)] * size, tf.float32)
    rows = tf.reshape(tf.cast(image, tf.float32), [size, size * 3])
    return tf.reshape(rows * scale + shift, [size, size, 3])


def _crop_window(data: tf.Tensor, seed: tf.Tensor, config: DataConfig) -> tf.Tensor:
    """[top, left, height, width] of the random-resized-crop, from the JPEG header alone."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.io.extract_jpeg_shape(data), bounding_boxes=tf.zeros([1, 0, 4]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=config.crop_ratio, area_range=config.crop_scale, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    return tf.stack([begin[0], begin[1], size[0], size[1]])


def _train_image(data: tf.Tensor, seed: tf.Tensor, config: DataConfig) -> tf.Tensor:
    image = tf.io.decode_and_crop_jpeg(data, _crop_window(data, seed, config), channels=3)
    # ResizeBilinear is faster on float32 input than on uint8, the cast included: the training map costs
    # 799 vs 940 us of CPU per image (benchmarks/input_pipeline.py, stage 7 vs its uint8 variant); the
    # result is bit for bit the same.
    image = tf.image.resize(tf.cast(image, tf.float32), [config.image_size, config.image_size], method="bilinear")
    if config.flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed + 1)
    return image


def _eval_image(data: tf.Tensor, config: DataConfig) -> tf.Tensor:
    image = tf.io.decode_jpeg(data, channels=3)
    h, w = tf.shape(image)[0], tf.shape(image)[1]
    scale = config.resize_size / tf.cast(tf.minimum(h, w), tf.float32)
    new_h = tf.cast(tf.round(tf.cast(h, tf.float32) * scale), tf.int32)
    new_w = tf.cast(tf.round(tf.cast(w, tf.float32) * scale), tf.int32)
    image = tf.image.resize(image, [new_h, new_w], method="bilinear")
    top = (new_h - config.image_size) // 2
    left = (new_w - config.image_size) // 2
    return image[top:top + config.image_size, left:left + config.image_size]


def _layout(images: tf.Tensor, config: DataConfig) -> tf.Tensor:
    """Cast to ``config.dtype``; (..., H, W, C) -> (..., C, H, W) for NCHW."""
    images = tf.cast(images, config.dtype)
    if config.layout == "NHWC":
        return images
    rank = images.shape.rank
    return tf.transpose(images, [*range(rank - 3), rank - 1, rank - 3, rank - 2])


def _finish(image: tf.Tensor, config: DataConfig) -> tf.Tensor:
    """One (H, W, 3) image as the model gets it: normalised, in ``config.dtype`` and ``config.layout``."""
    return _layout(_normalise(image, config), config)


def _image_shape(config: DataConfig) -> list[int]:
    size = config.image_size
    return [size, size, 3] if config.layout == "NHWC" else [3, size, size]


def _source(config: DataConfig, split: str, shards: ShardListing | None) -> tuple[tf.data.Dataset, int]:
    """(data bytes, label, file name) elements in listing order, and their count (evaluation)."""
    if shards is None:
        listing = list_folder(config.data_dir, split)
        files = tf.constant(listing.files)
        ds = tf.data.Dataset.from_tensor_slices((files, tf.constant(listing.labels, tf.int32)))
        ds = ds.map(_as_written(lambda f, y: (tf.io.read_file(f), y, f)), num_parallel_calls=AUTOTUNE,
                    deterministic=True)
        return ds, len(listing.files)
    ds = tf.data.TFRecordDataset(list(shards.shards), num_parallel_reads=min(len(shards.shards), 8))
    ds = ds.map(_as_written(lambda r: _parse_record(r, config.label_offset)), num_parallel_calls=AUTOTUNE,
                deterministic=True)
    return ds, sum(shards.counts)


def _listing(config: DataConfig, split: str) -> FolderListing | ShardListing:
    if config.format == "folder":
        return list_folder(config.data_dir, split)
    return list_shards(config.data_dir, split, require_index=False)  # without an index: read whole, with a warning


def tfdata_plan(config: DataConfig, split: str = "train") -> EpochPlan:
    """The plan :func:`tfdata_dataset` follows when training on ``split``."""
    return plan_for(config, _listing(config, split))


def bad_jpegs(config: DataConfig, split: str) -> list[str]:
    """The files (or records' file names) of ``split`` that ``data.on_error=skip`` leaves out, in listing order.

    The same check as the pipeline's (start and end markers): one read of the split, done once by the chief of
    a run so that the log and metrics.jsonl can name what was skipped.
    """
    shards = list_shards(config.data_dir, split) if config.format == "tfrecord" else None
    source, _ = _source(config, split, shards)
    bad = source.filter(lambda data, _label, _name: tf.logical_not(_jpeg_ok(data))).map(lambda _d, _l, name: name)
    return [name.decode(errors="replace") for name in bad.as_numpy_iterator()]


def _planned_files(listing: FolderListing, share: ReplicaShare) -> tuple[tf.data.Dataset, _Load]:
    """(file name, label, id) of the share's files, in order, and the function that reads one; no other file
    is opened."""
    return _files_source(*_file_arrays(listing, share))


# The dtypes of _file_arrays' arrays (for tf.numpy_function).
_FILE_ARRAYS = (tf.string, tf.int32, tf.int64)


def _file_arrays(listing: FolderListing, share: ReplicaShare) -> tuple[np.ndarray, ...]:
    """The share's (file names, labels, ids), in order."""
    files = np.asarray(listing.files, dtype=object)[share.ids].astype(bytes)
    return files, np.asarray(listing.labels, np.int32)[share.ids], share.ids.astype(np.int64)


def _files_source(files: Any, labels: Any, ids: Any) -> tuple[tf.data.Dataset, _Load]:
    ds = tf.data.Dataset.from_tensor_slices((files, labels, ids))
    return ds, lambda f, y, i: (tf.io.read_file(f), y, f, i)


def _planned_records(listing: ShardListing, plan: EpochPlan, share: ReplicaShare,
                     label_offset: int) -> tuple[tf.data.Dataset, _Load]:
    """(serialized record, id) of the share's records, in order, and the function that parses one.

    Records are read one group of shards at a time (the next group is read
    while this one is consumed); groups with no planned record are not read
    at all. Each planned record is read by its byte offset from the shard's
    DALI index, and nothing else: under the strided rule (a shard count that
    R does not divide: ImageNet's 1,024 shards on 24 ranks) a replica reads
    its 1/R of each group, not the whole group (``benchmarks/tfrecord_reads.py``).
    A listing with shards that have no index reads its groups whole and
    keeps the planned records, as before indexes were used, with a warning.
    """
    missing = [s for s, i in zip(listing.shards, listing.indexes, strict=True) if not i]
    if missing:
        _log.warning(
            "hvrep: %d of %d TFRecord shards have no index (e.g. %s has no idx/%s.idx): tf.data reads each group "
            "of shards whole and keeps the records this replica uses (under the strided rule, R replicas read R "
            "times the data). Fix: rerun `hvrep data prepare SRC DST`, which writes the index with each shard it "
            "writes (delete the unindexed shards first).", len(missing), len(listing.shards), missing[0],
            missing[0].rsplit("/", 1)[-1])
        return _whole_group_records(listing, plan, share, label_offset)
    return _records_source(*_record_arrays(listing, plan, share), label_offset=label_offset)


# The dtypes of _record_arrays' arrays (for tf.numpy_function).
_RECORD_ARRAYS = (tf.string, tf.int64, tf.int64, tf.int64, tf.int64, tf.int64, tf.int64)


def _record_arrays(listing: ShardListing, plan: EpochPlan, share: ReplicaShare) -> tuple[np.ndarray, ...]:
    """The share's loads, one per group of shards, as flat arrays and row lengths: (the groups' shard paths,
    how many paths each group has, then per record: its shard among the group's, byte offset, size, id, and
    how many records each group has). Every shard listed has an index."""
    block = plan.block_of(share.ids)
    local = share.ids - plan.starts[block]  # each id's record number in its shard
    cuts = np.flatnonzero(np.diff(share.groups)) + 1
    entries: dict[int, np.ndarray] = {}
    paths, which, offsets, sizes = [], [], [], []
    for shards_of, records in zip(np.split(block, cuts), np.split(local, cuts), strict=True):
        shards, where = np.unique(shards_of, return_inverse=True)
        at = np.empty((len(records), 2), np.int64)
        for k in shards:
            if k not in entries:  # as the listing read them, or from the index file
                known = listing.entries[k] if listing.entries else None
                entries[k] = known if known is not None else index_entries(listing.indexes[k])
            mine = shards_of == k
            at[mine] = entries[k][records[mine]]
        paths.append(np.asarray([listing.shards[k] for k in shards], dtype=object).astype(bytes))
        which.append(where.astype(np.int64))
        offsets.append(at[:, 0])
        sizes.append(at[:, 1])
    ids = np.split(share.ids.astype(np.int64), cuts)

    def lengths(parts: list[np.ndarray]) -> np.ndarray:
        return np.asarray([len(p) for p in parts], np.int64)

    return (np.concatenate(paths), lengths(paths), np.concatenate(which), np.concatenate(offsets),
            np.concatenate(sizes), np.concatenate(ids), lengths(ids))


def _records_source(paths: Any, path_lengths: Any, which: Any, offsets: Any, sizes: Any, ids: Any,
                    record_lengths: Any, *, label_offset: int) -> tuple[tf.data.Dataset, _Load]:
    """:func:`_record_arrays`' loads as a dataset of (serialized record, id), and the function that parses one;
    the arrays may be numpy arrays or tensors (one pipeline for every epoch computes them as it goes)."""

    def ragged(values: Any, row_lengths: Any) -> tf.RaggedTensor:
        return tf.RaggedTensor.from_row_lengths(values, row_lengths)

    loads = tf.data.Dataset.from_tensor_slices((ragged(paths, path_lengths), ragged(which, record_lengths),
                                                ragged(offsets, record_lengths), ragged(sizes, record_lengths),
                                                ragged(ids, record_lengths)))

    def read(paths: np.ndarray, which: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        return read_records([p.decode() for p in paths], which, offsets, sizes)

    def load(paths: tf.Tensor, which: tf.Tensor, offsets: tf.Tensor, sizes: tf.Tensor,
             ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        # One call reads the group's planned records (os.pread releases the GIL while it waits for the disk).
        records = tf.numpy_function(read, [paths, which, offsets, sizes], tf.string)
        return tf.ensure_shape(records, [None]), ids

    def emit(records: tf.Tensor, ids: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((records, ids))

    return (loads.map(_as_written(load)).prefetch(1).flat_map(_as_written(emit)),
            lambda rec, i: (*_parse_record(rec, label_offset), i))


def _whole_group_records(listing: ShardListing, plan: EpochPlan, share: ReplicaShare,
                         label_offset: int) -> tuple[tf.data.Dataset, _Load]:
    """:func:`_planned_records` for shards without an index: a group's shards are read once, sequentially, into
    memory (about ``shuffle_buffer`` records) and only the planned records are parsed."""
    counts = np.asarray(listing.counts, np.int64)
    block = plan.block_of(share.ids)
    cuts = np.flatnonzero(np.diff(share.groups)) + 1
    files, takes, totals = [], [], []
    for ids, shards_of in zip(np.split(share.ids, cuts), np.split(block, cuts), strict=True):
        shards = np.unique(shards_of)
        base = np.concatenate([[0], np.cumsum(counts[shards])])
        # Position of each record among the records of this load's shards, read in shard order.
        takes.append(base[np.searchsorted(shards, shards_of)] + ids - plan.starts[shards_of])
        files.append(np.asarray([listing.shards[k] for k in shards], dtype=object).astype(bytes))
        totals.append(base[-1])

    def ragged(parts: list[np.ndarray]) -> tf.RaggedTensor:
        return tf.RaggedTensor.from_row_lengths(np.concatenate(parts), [len(p) for p in parts])

    loads = tf.data.Dataset.from_tensor_slices((ragged(files), ragged(takes), np.asarray(totals, np.int64),
                                                ragged(np.split(share.ids, cuts))))

    def load(paths: tf.Tensor, take: tf.Tensor, total: tf.Tensor, ids: tf.Tensor) -> tuple[tf.Tensor, ...]:
        # The shards are read in parallel; a block as long as the whole load keeps them in shard order.
        records = tf.data.Dataset.from_tensor_slices(paths).interleave(
            tf.data.TFRecordDataset, cycle_length=tf.size(paths, tf.int64), block_length=total,
            num_parallel_calls=AUTOTUNE, deterministic=True).batch(total).get_single_element()
        return records, take, ids

    def emit(records: tf.Tensor, take: tf.Tensor, ids: tf.Tensor) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices((take, ids)).map(_as_written(lambda t, i: (tf.gather(records, t), i)))

    return (loads.map(_as_written(load)).prefetch(1).flat_map(_as_written(emit)),
            lambda rec, i: (*_parse_record(rec, label_offset), i))


def tfdata_dataset(config: DataConfig, split: str, ctx: InputContext | None = None,
                   per_replica_batch_size: int | None = None, training: bool | None = None,
                   position: EpochPosition | None = None, threads: int | None = None, *,
                   batch_size: int | None = None) -> tf.data.Dataset:
    """One replica's batches of ``(images, labels)`` for one epoch.

    Args:
      config: the pipeline settings (``config.backend`` is not consulted here).
      split: "train" or "val".
      ctx: this replica's place (``replica_id``, ``num_replicas``,
        ``per_replica_batch_size``); None: one replica.
      per_replica_batch_size: the batch when ``ctx`` has none.
      training: augment and shuffle (default: ``split == "train"``).
      position: training only: where the epoch resumes (see
        ``hvrep.data.plan``); the batches before it are not read.
      threads: the size of the pipeline's own thread pool; None: tf.data's
        shared pool, sized for every core.
      batch_size: the old name of ``per_replica_batch_size`` (deprecated).

    Returns:
      A dataset of ``images`` (batch, H, W, 3) or (batch, 3, H, W) in
      ``config.dtype`` and ``labels`` (batch,) int32; padding rows (evaluation)
      have label -1. ``dataset.hvrep_skipped`` counts dropped bad files.
    """
    ctx, b = replica_batch(ctx, renamed_batch(per_replica_batch_size, batch_size, "tfdata_dataset"))
    training = split == "train" if training is None else training
    r, n_rep = ctx.replica_id, ctx.num_replicas
    skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_skipped")
    raise_on_bad = config.on_error == "raise"
    checked, _ = _bad_jpeg_checks(raise_on_bad, skipped)
    size = config.image_size
    if training:
        listing = _listing(config, split)
        plan = plan_for(config, listing)
        position = position or EpochPosition()
        share = plan.share(r, n_rep, b, position)
        if position.is_start and share.steps == 0:
            raise ConfigError(f"{plan.num_samples} {split} images cannot fill one global batch of {n_rep} x {b}.")
        if share.steps == 0:  # resumed at the end of the epoch
            empty = (tf.zeros([0, b, *_image_shape(config)], config.dtype), tf.zeros([0, b], tf.int32))
            return _finished(tf.data.Dataset.from_tensor_slices(empty), skipped, threads)
        if isinstance(listing, FolderListing):
            ds, load = _planned_files(listing, share)
        else:
            ds, load = _planned_records(listing, plan, share, config.label_offset)
        ds = _train_batches(ds, load, tf.constant(config.seed, tf.int64), share.steps, b, config, skipped)
    else:
        shards = list_shards(config.data_dir, split, require_index=False) if config.format == "tfrecord" else None
        source, n = _source(config, split, shards)
        mine = len(range(r, n, n_rep))
        padded = math.ceil(math.ceil(n / n_rep) / b) * b  # the same on every replica
        ds = source.shard(n_rep, r)
        if raise_on_bad:
            ds = ds.map(_as_written(checked))

        def eval_map(data: tf.Tensor, label: tf.Tensor, _name: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            if raise_on_bad:
                return _finish(_eval_image(data, config), config), label
            ok = _jpeg_ok(data)
            with tf.control_dependencies([skipped.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
                # A bad file becomes a padding row: same count per replica, never counted.
                image = tf.cond(ok, lambda: _eval_image(data, config), lambda: tf.zeros([size, size, 3]))
                return _finish(image, config), tf.where(ok, label, PAD_LABEL)

        ds = ds.map(_as_written(eval_map), num_parallel_calls=AUTOTUNE, deterministic=True)
        pad = tf.data.Dataset.from_tensors((_finish(tf.zeros([size, size, 3]), config),
                                            tf.constant(PAD_LABEL, tf.int32)))
        ds = ds.concatenate(pad.repeat(padded - mine)).batch(b, drop_remainder=True)
    return _finished(ds, skipped, threads)


def tfdata_epochs_apply(config: DataConfig) -> bool:
    """Whether :func:`tfdata_epochs` serves ``config``'s training split (not: TFRecord shards without an index)."""
    return _indexed(_listing(config, "train"))


def _indexed(listing: FolderListing | ShardListing) -> bool:
    """Every sample can be read on its own: a folder, or shards that all have an index."""
    return not isinstance(listing, ShardListing) or all(listing.indexes)


def tfdata_epochs(config_of: Callable[[int], DataConfig], first: int, stop: int, ctx: InputContext | None = None,
                  per_replica_batch_size: int | None = None, position: EpochPosition | None = None,
                  threads: int | None = None) -> tf.data.Dataset | None:
    """One replica's training batches of epochs ``first`` to ``stop - 1``, one after the other, as one dataset.

    Epoch e holds exactly the batches of ``tfdata_dataset(config_of(e), "train", ctx, position=..., threads=...)``
    (``position`` for epoch ``first``, the start for the others), bit for bit. What differs is the cost of an
    epoch's start: that builds a pipeline per epoch (its graph, its functions traced, its iterator: 66 ms on a
    core for the demo, ``benchmarks/epoch_start.py``), after the previous epoch's last step; this is built and
    started once, each epoch's plan is computed on tf.data's thread as its turn comes, and the prefetch runs on
    into the next epoch while this one ends, is evaluated and saved.

    ``config_of(e)`` must differ between epochs only in ``seed``. Returns None where this does not apply:
    TFRecord shards without an index (each epoch is then built on its own).

    Raises:
      ConfigError: the split cannot fill one batch on every replica (checked here, before anything runs).
    """
    ctx, b = replica_batch(ctx, per_replica_batch_size)
    r, n_rep = ctx.replica_id, ctx.num_replicas
    config = config_of(first)
    listing = _listing(config, "train")
    if not _indexed(listing):
        return None
    position = position or EpochPosition()
    plan = plan_for(config, listing)
    share = plan.share(r, n_rep, b, position)
    if position.is_start and share.steps == 0:
        raise ConfigError(f"{plan.num_samples} train images cannot fill one global batch of {n_rep} x {b}.")
    skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_skipped")
    folders = isinstance(listing, FolderListing)
    dtypes = [*(_FILE_ARRAYS if folders else _RECORD_ARRAYS), tf.int64, tf.int64]

    def arrays(epoch: np.int64) -> list[np.ndarray]:
        # An epoch's share (the first's from `position`), then its seed and steps.
        e = int(epoch)
        epoch_config = config_of(e)
        epoch_plan = plan if e == first else plan_for(epoch_config, listing)
        epoch_share = share if e == first else epoch_plan.share(r, n_rep, b)
        made = (_file_arrays(listing, epoch_share) if folders
                else _record_arrays(listing, epoch_plan, epoch_share))
        return [*made, np.int64(epoch_config.seed), np.int64(epoch_share.steps)]

    def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
        *made, seed, steps = tf.numpy_function(arrays, [epoch], dtypes)
        made = [tf.ensure_shape(a, [None]) for a in made]
        seed, steps = tf.ensure_shape(seed, []), tf.ensure_shape(steps, [])
        if folders:
            ds, load = _files_source(*made)
        else:
            ds, load = _records_source(*made, label_offset=config.label_offset)
        return _train_batches(ds, load, seed, steps, b, config, skipped)

    # An epoch resumed at its end has no steps left: it is left out.
    ds = tf.data.Dataset.range(first if share.steps else first + 1, stop)
    return _finished(ds.flat_map(_as_written(epoch_batches)), skipped, threads)


def _bad_jpeg_checks(raise_on_bad: bool, skipped: tf.Variable) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(checked, keep): the element with an assertion that its JPEG is whole (``on_error="raise"``), and the
    filter that drops one that is not, counting it in ``skipped`` (``"skip"``)."""

    def checked(data: tf.Tensor, label: tf.Tensor, name: tf.Tensor, *rest: tf.Tensor) -> tuple[tf.Tensor, ...]:
        if raise_on_bad:
            with tf.control_dependencies([tf.debugging.Assert(
                    _jpeg_ok(data), [_BAD_JPEG, name], summarize=1)]):
                data = tf.identity(data)
        return (data, label, name, *rest)

    def keep(data: tf.Tensor, label: tf.Tensor, name: tf.Tensor, *rest: tf.Tensor) -> tf.Tensor:
        ok = _jpeg_ok(data)
        # Counted when the element is dropped; tf.data runs this eagerly-captured variable's op.
        with tf.control_dependencies([skipped.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
            return tf.identity(ok)

    return checked, keep


def _train_batches(ds: tf.data.Dataset, load: _Load, seed: tf.Tensor, steps: Any, b: int, config: DataConfig,
                   skipped: tf.Variable) -> tf.data.Dataset:
    """A training source's ``steps`` batches of ``b``: each sample read, checked, augmented (seeded by ``seed``,
    the epoch's, and its id) and finished, in order."""
    raise_on_bad = config.on_error == "raise"
    checked, keep = _bad_jpeg_checks(raise_on_bad, skipped)

    def augment(data: tf.Tensor, label: tf.Tensor, _name: tf.Tensor, i: tf.Tensor) -> tuple[tf.Tensor, ...]:
        # Seeded by the sample: the same crop whatever the world size or the resume point.
        image = _train_image(data, tf.stack([seed, i]), config)
        return _finish(image, config), label

    if raise_on_bad:
        # One map does everything for a sample (read or parse, check, crop, decode, resize, flip,
        # normalise): a map stage of its own for the read cost 859 vs 815 us of CPU per image
        # (benchmarks/input_pipeline.py, variant "read in a map of its own" vs stage 7).
        ds = ds.take(steps * b)

        def train_map(*element: tf.Tensor) -> tuple[tf.Tensor, ...]:
            return augment(*checked(*load(*element)))
    else:
        # A skipped bad file is replaced by one from the start of this replica's share (read
        # again), so every replica still yields exactly `steps` batches.
        ds = ds.map(_as_written(load), num_parallel_calls=AUTOTUNE, deterministic=True)
        ds = ds.filter(_as_written(keep)).repeat()
        ds = ds.take(steps * b)
        train_map = augment

    # Deterministic order (still parallel): a resumed run must see the same batches.
    ds = ds.map(_as_written(train_map), num_parallel_calls=AUTOTUNE, deterministic=True)
    return ds.batch(b, drop_remainder=True)


def _finished(ds: tf.data.Dataset, skipped: tf.Variable, threads: int | None) -> tf.data.Dataset:
    # Images are normalised and cast per image, in the map that made them (see _normalise): nothing
    # is left to do per batch but prefetch.
    ds = ds.prefetch(AUTOTUNE)
    if threads is not None:
        # A fixed budget: autotuning's model thread, whose optimisation runs outside the budget and which
        # deleting the iterator waits for (up to 1.3 s in make demo), is off; the maps still use the whole
        # pool (demo training split, threads=2: as fast as with autotuning).
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        options.autotune.enabled = False
        ds = ds.with_options(options)
    ds.hvrep_skipped = skipped
    return ds


def synthetic_dataset(config: DataConfig, ctx: InputContext | None = None, per_replica_batch_size: int | None = None,
                      num_classes: int = 1000, *, batch_size: int | None = None) -> tf.data.Dataset:
    """An endless dataset of one random batch per replica (no files, no decode): for throughput benchmarks.

    ``batch_size=`` is the old name of ``per_replica_batch_size`` (deprecated, the same meaning).
    """
    ctx, b = replica_batch(ctx, renamed_batch(per_replica_batch_size, batch_size, "synthetic_dataset"))
    gen = tf.random.Generator.from_seed(config.seed + ctx.replica_id)
    images = gen.normal([b, config.image_size, config.image_size, 3])
    labels = gen.uniform([b], 0, num_classes, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((_layout(images, config), labels)).repeat()
