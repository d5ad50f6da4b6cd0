"""The tf.data pipeline: parallel JPEG decode, the shared augmentation, prefetch, autotune.

Training: random-resized-crop (``tf.image.stateless_sample_distorted_bounding_box``
with ``config.crop_scale``/``crop_ratio``, decoded with ``decode_and_crop_jpeg``
so only the crop is decoded), resize to ``image_size``, random horizontal
flip, normalise. Evaluation: resize the shorter side to ``resize_size``,
center-crop ``image_size``, normalise. The DALI pipeline applies the same.

Sharding (see :func:`tfdata_dataset`): every replica yields the same number
of batches, so collectives stay in lockstep. Training on a folder (or on
fewer TFRecord shards than replicas, or a count that does not divide): the
sample list is shuffled with the same seed on every replica (a new order each
epoch), then replica r keeps elements r, r+R, ...: within an epoch the
replicas see distinct samples, ``floor(N / (R*b)) * R * b`` of them.
Training on TFRecord shards whose count divides by R: replica r reads only
shard files r, r+R, ... (ImageNet: 1,024 shards), shuffled by file and with a
record buffer; every replica takes ``min_r floor(records_r / b)`` batches. Evaluation: no
shuffle; each replica's part is padded to a whole number of batches with
rows labelled ``PAD_LABEL`` (-1) that carry zero images and must not count,
so every validation image is counted exactly once.

Bad JPEGs: a file without JPEG start/end markers (garbage, truncated) fails
with an error that names it (``on_error="raise"``) or is dropped and counted
in ``dataset.hvrep_skipped`` (``"skip"``; evaluation replaces it with a
padding row so the count per replica does not change).
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from hvrep.data.config import PAD_LABEL, DataConfig, replica_batch
from hvrep.data.files import ShardListing, list_folder, list_shards
from hvrep.errors import ConfigError
from hvrep.replica.context import InputContext

AUTOTUNE = tf.data.AUTOTUNE


def _jpeg_ok(data: tf.Tensor) -> tf.Tensor:
    """Start-of-image and end-of-image markers present: catches garbage and truncated files."""
    n = tf.strings.length(data)
    head = tf.strings.substr(data, 0, 2)
    tail = tf.strings.substr(data, tf.maximum(n - 2, 0), 2)
    return tf.logical_and(tf.equal(head, b"\xff\xd8"), tf.equal(tail, b"\xff\xd9"))


def _parse_record(record: tf.Tensor, label_offset: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    parsed = tf.io.parse_single_example(record, {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "image/filename": tf.io.FixedLenFeature([], tf.string, default_value=""),
    })
    label = tf.cast(parsed["image/class/label"], tf.int32) - label_offset
    return parsed["image/encoded"], label, parsed["image/filename"]


def _normalise(images: tf.Tensor, config: DataConfig) -> tf.Tensor:
    # One multiply-add over the whole batch (after batching, not per image):
    # per-element float ops in the map were the pipeline's largest CPU cost.
    scale = tf.constant([1.0 / s for s in config.std], tf.float32)
    shift = tf.constant([-m / s for m, s in zip(config.mean, config.std, strict=True)], tf.float32)
    return tf.cast(images, tf.float32) * scale + shift


def _train_image(data: tf.Tensor, seed: tf.Tensor, config: DataConfig) -> tf.Tensor:
    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.zeros([1, 0, 4]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=config.crop_ratio, area_range=config.crop_scale, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = tf.io.decode_and_crop_jpeg(data, window, channels=3)
    image = tf.image.resize(image, [config.image_size, config.image_size], method="bilinear")
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
    images = tf.cast(images, config.dtype)
    return tf.transpose(images, [0, 3, 1, 2]) if config.layout == "NCHW" else images


def _finish(images: tf.Tensor, config: DataConfig) -> tf.Tensor:
    return _layout(_normalise(images, config), config)


def _source(config: DataConfig, split: str, shards: ShardListing | None) -> tuple[tf.data.Dataset, int]:
    """(data bytes, label, file name) elements in a fixed order, and their count."""
    if shards is None:
        listing = list_folder(config.data_dir, split)
        files = tf.constant(listing.files)
        ds = tf.data.Dataset.from_tensor_slices((files, tf.constant(listing.labels, tf.int32)))
        ds = ds.map(lambda f, y: (tf.io.read_file(f), y, f), num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds, len(listing.files)
    ds = tf.data.TFRecordDataset(list(shards.shards), num_parallel_reads=min(len(shards.shards), 8))
    ds = ds.map(lambda r: _parse_record(r, config.label_offset), num_parallel_calls=AUTOTUNE, deterministic=True)
    return ds, sum(shards.counts)


def tfdata_dataset(config: DataConfig, split: str, ctx: InputContext | None = None, batch_size: int | None = None,
                   training: bool | None = None) -> tf.data.Dataset:
    """One replica's batches of ``(images, labels)`` for one epoch.

    Args:
      config: the pipeline settings (``config.backend`` is not consulted here).
      split: "train" or "val".
      ctx: this replica's place (``replica_id``, ``num_replicas``,
        ``per_replica_batch_size``); None: one replica.
      batch_size: per-replica batch when ``ctx`` has none.
      training: augment and shuffle (default: ``split == "train"``).

    Returns:
      A dataset of ``images`` (batch, H, W, 3) or (batch, 3, H, W) in
      ``config.dtype`` and ``labels`` (batch,) int32; padding rows (evaluation)
      have label -1. ``dataset.hvrep_skipped`` counts dropped bad files.
    """
    ctx, b = replica_batch(ctx, batch_size)
    training = split == "train" if training is None else training
    r, n_rep = ctx.replica_id, ctx.num_replicas
    shards = list_shards(config.data_dir, split) if config.format == "tfrecord" else None
    # Replica r reads only shard files r, r+R, ... when they divide evenly.
    file_sharded = (training and shards is not None and len(shards.shards) >= n_rep
                    and len(shards.shards) % n_rep == 0)
    source, n = (None, sum(shards.counts)) if file_sharded else _source(config, split, shards)
    skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_skipped")
    raise_on_bad = config.on_error == "raise"

    def checked(data: tf.Tensor, label: tf.Tensor, name: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        if raise_on_bad:
            with tf.control_dependencies([tf.debugging.Assert(
                    _jpeg_ok(data), ["hvrep: corrupt or truncated JPEG (no start/end marker):", name,
                                     "Fix: replace or delete it, or set on_error='skip'."], summarize=1)]):
                data = tf.identity(data)
        return data, label, name

    def keep(data: tf.Tensor, label: tf.Tensor, name: tf.Tensor) -> tf.Tensor:
        ok = _jpeg_ok(data)
        # Counted when the element is dropped; tf.data runs this eagerly-captured variable's op.
        with tf.control_dependencies([skipped.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
            return tf.identity(ok)

    size = config.image_size
    if training:
        if file_sharded:
            # At ImageNet scale every replica must not read every shard: each reads
            # its own 1/R of the shard files (records counted from their DALI
            # indexes), shuffled with a buffer; steps follow the smallest share.
            files = list(shards.shards[r::n_rep])
            counts = [sum(shards.counts[k::n_rep]) for k in range(n_rep)]
            steps = min(c // b for c in counts)
            ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=config.seed)
            ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), 8), num_parallel_calls=AUTOTUNE,
                               deterministic=True)
            ds = ds.map(lambda rec: _parse_record(rec, config.label_offset), num_parallel_calls=AUTOTUNE)
            ds = ds.shuffle(min(config.shuffle_buffer, max(counts)), seed=config.seed + r)
        else:
            steps = n // (n_rep * b)
            ds = source.shuffle(n, seed=config.seed, reshuffle_each_iteration=True).shard(n_rep, r)
        if steps == 0:
            raise ConfigError(f"{n} {split} images cannot fill one global batch of {n_rep} x {b}.")
        ds = ds.map(checked) if raise_on_bad else ds.filter(keep)
        # repeat + take: a skipped file is replaced by one from the next epoch, so
        # every replica still yields exactly `steps` batches.
        ds = ds.repeat().take(steps * b).enumerate()
        seed_base = tf.constant([config.seed, r], tf.int64)

        def train_map(i: tf.Tensor, elem: Any) -> tuple[tf.Tensor, tf.Tensor]:
            data, label, _ = elem
            seed = tf.stack([seed_base[0] * 1_000_003 + seed_base[1], i])
            return _train_image(data, seed, config), label

        # Deterministic order (still parallel): a resumed run must see the same batches.
        ds = ds.map(train_map, num_parallel_calls=AUTOTUNE, deterministic=True)
        ds = ds.batch(b, drop_remainder=True)
    else:
        mine = len(range(r, n, n_rep))
        padded = math.ceil(math.ceil(n / n_rep) / b) * b  # the same on every replica
        ds = source.shard(n_rep, r)
        if raise_on_bad:
            ds = ds.map(checked)

        def eval_map(data: tf.Tensor, label: tf.Tensor, _name: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            if raise_on_bad:
                return _eval_image(data, config), label
            ok = _jpeg_ok(data)
            with tf.control_dependencies([skipped.assign_add(tf.cast(tf.logical_not(ok), tf.int64))]):
                # A bad file becomes a padding row: same count per replica, never counted.
                image = tf.cond(ok, lambda: _eval_image(data, config), lambda: tf.zeros([size, size, 3]))
                return image, tf.where(ok, label, PAD_LABEL)

        ds = ds.map(eval_map, num_parallel_calls=AUTOTUNE, deterministic=True)
        pad = tf.data.Dataset.from_tensors((tf.zeros([size, size, 3]), tf.constant(PAD_LABEL, tf.int32)))
        ds = ds.concatenate(pad.repeat(padded - mine)).batch(b, drop_remainder=True)
    ds = ds.map(lambda x, y: (_finish(x, config), y), num_parallel_calls=AUTOTUNE).prefetch(AUTOTUNE)
    ds.hvrep_skipped = skipped
    return ds


def synthetic_dataset(config: DataConfig, ctx: InputContext | None = None, batch_size: int | None = None,
                      num_classes: int = 1000) -> tf.data.Dataset:
    """An endless dataset of one random batch (no files, no decode): for throughput benchmarks."""
    ctx, b = replica_batch(ctx, batch_size)
    gen = tf.random.Generator.from_seed(config.seed + ctx.replica_id)
    images = gen.normal([b, config.image_size, config.image_size, 3])
    labels = gen.uniform([b], 0, num_classes, dtype=tf.int32)
    return tf.data.Dataset.from_tensors((_layout(images, config), labels)).repeat()
