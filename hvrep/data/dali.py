"""The DALI pipeline: the same augmentation, sharding and padding rules as ``hvrep.data.tfdata``.

Training: ``decoders.image_random_crop`` (Inception-style, ``config.crop_scale``/
``crop_ratio``; only the crop is decoded), resize to ``image_size``, random
horizontal flip (``random.coin_flip`` into ``crop_mirror_normalize``),
normalise. Evaluation: resize the shorter side to ``resize_size``, center-crop
``image_size``, normalise. Resizes are bilinear without antialiasing, as
``tf.image.resize`` does, so both backends feed the model the same pixels.

Training follows the epoch plan (``hvrep.data.plan``), as the tf.data
pipeline does: each replica's reader gets exactly its sample ids in the
plan's order (a file list; for TFRecords, per run of records from one shard,
an index of just those records, which DALI's reader seeks to) and shuffles
and splits nothing itself. Both pipelines therefore train on the same
samples in the same batches, and resuming mid-epoch (``position``) drops the
trained batches' ids before the reader sees them. DALI draws crops and
flips from the pipeline's random stream (seeded by ``config.seed`` and the
replica), so a resumed run reads the same samples as the interrupted one but
augments them differently.

Evaluation: DALI's readers split the sample list into ``num_replicas``
contiguous parts and replica ``ctx.replica_id`` reads part ``replica_id``.
The sample list is padded with ``P = ceil(N / (R*b)) * R*b - N`` padding
samples (a tiny black JPEG, label ``PAD_LABEL``) appended after the real
ones. The padded count divides by ``R*b``, so every contiguous part holds
exactly ``N_padded / R`` samples, a whole number of batches: every replica
yields the same number of batches (collectives stay in lockstep) and every
real image is in exactly one part. DALI's ``pad_last_batch`` is not used: it
repeats the last real sample with its real label, which would count twice.

Each iteration of the returned dataset is one epoch and restarts the DALI
pipeline from its seeds: iterating it again gives the same order and the same
augmentation. For a new epoch pass a new seed, e.g.
``dataclasses.replace(config, seed=config.seed + epoch)`` (the same on every
replica).

Bad JPEGs: DALI's decoders cannot drop a sample (a batch in flight cannot ask
its reader for a replacement) and their error does not name the file
("nvImageCodec failure: '#4'"). ``on_error="skip"`` therefore checks every
image once before the pipeline is built (:func:`hvrep.data.prepare.check_jpeg`,
a 1/8-scale decode; at ImageNet scale this reads the whole split once per
process, cached for the process) and leaves the bad ones out (of the epoch
plan in training; of the file list or TFRecord index in evaluation); their
number is logged and in ``dataset.hvrep_skipped``. ``on_error="raise"`` does not pay that cost up front: iterate inside
:func:`dali_errors` to turn DALI's decode failure into a
:class:`~hvrep.errors.DataError` naming the file.

``bfloat16``: DALI has no bfloat16 output, so DALI produces float32 and a
``tf.data`` map casts it (on the CPU; with a GPU-placed pipeline prefer
``dtype="float32"`` and casting in the model).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import itertools
import logging
import math
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from hvrep.data.config import PAD_LABEL, DataConfig, renamed_batch, replica_batch
from hvrep.data.files import FolderListing, ShardListing, list_folder, list_shards
from hvrep.data.plan import EpochPlan, EpochPosition, ReplicaShare, plan_for
from hvrep.data.prepare import check_jpeg
from hvrep.errors import ConfigError, DataError, SetupError
from hvrep.replica.context import InputContext
from hvrep.replica.devices import NO_GPU, ReplicaGpu, process_gpu

log = logging.getLogger(__name__)

_CHUNK = 4096  # files checked per thread-pool round: bounds the futures held at ImageNet scale


@dataclass(frozen=True)
class _Bad:
    """An image that cannot be decoded: ``where`` names it for people, ``key`` for filtering."""

    where: str
    reason: str
    key: str | tuple[int, int]  # a folder file's path, or (shard number, record number)


def _dali() -> tuple[Any, Any, Any, Any]:
    try:
        import nvidia.dali.plugin.tf as dali_tf
        from nvidia.dali import fn, types
        from nvidia.dali import tfrecord as tfrec
    except ImportError as e:
        raise SetupError(f"DALI or its TensorFlow plugin cannot be imported ({e}). Fix: run `make setup` "
                         "(installs nvidia-dali-cuda120 and builds its TensorFlow plugin).") from e
    return fn, types, tfrec, dali_tf


# Scratch files (file lists, filtered indexes, the padding sample) live until the
# process exits: DALIDataset re-reads them each time it starts its pipeline.
_scratch_lock = threading.Lock()
_scratch_dir: Path | None = None
_scratch_names = itertools.count()


def _scratch_path(stem: str) -> Path:
    """A new name in the process's scratch folder."""
    global _scratch_dir
    with _scratch_lock:
        if _scratch_dir is None:
            _scratch_dir = Path(tempfile.mkdtemp(prefix="hvrep-dali-"))
            atexit.register(shutil.rmtree, _scratch_dir, True)
        return _scratch_dir / f"{next(_scratch_names):06d}-{stem}"


def _scratch(stem: str, data: bytes | str) -> str:
    path = _scratch_path(stem)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return str(path)


def _scratch_folder() -> Path:
    """A new folder for one training dataset's lists (removed with the dataset: a run writes one per epoch)."""
    folder = _scratch_path("lists")
    folder.mkdir()
    return folder


@functools.cache
def _pad_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="JPEG")
    return buf.getvalue()


def _pad_record(label_offset: int, count: int) -> tuple[str, str]:
    """A one-record TFRecord file holding the padding sample, and an index listing it ``count`` times."""
    example = tf.train.Example(features=tf.train.Features(feature={
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[_pad_jpeg()])),
        # The reader subtracts label_offset, which leaves PAD_LABEL.
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[PAD_LABEL + label_offset])),
    })).SerializeToString()
    path = _scratch("pad.tfrecord", b"")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(example)
    return path, _scratch("pad.tfrecord.idx", f"0 {len(example) + 16}\n" * count)


def _index_entries(index: str) -> list[str]:
    return Path(index).read_text().splitlines()


def _records(shard: str, index: str) -> Iterator[tuple[int, bytes]]:
    """(record number, serialized Example) of each record, from the DALI index's offsets."""
    with open(shard, "rb") as f:
        for i, line in enumerate(_index_entries(index)):
            offset, size = map(int, line.split())
            f.seek(offset)
            yield i, f.read(size)[12:-4]  # drop the length (8), its CRC (4) and the data CRC (4)


def _check_file(path: str) -> str | None:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"cannot be read ({e})"
    return check_jpeg(path, data)


def _check_shard(shard_no: int, shard: str, index: str, stop: threading.Event) -> list[_Bad]:
    bad = []
    for i, record in _records(shard, index):
        if stop.is_set():
            break
        feature = tf.train.Example.FromString(record).features.feature
        encoded = feature["image/encoded"].bytes_list.value
        name = feature["image/filename"].bytes_list.value
        problem = check_jpeg(shard, encoded[0]) if encoded else "has no image/encoded feature"
        if problem:
            label = f" (image/filename {name[0].decode(errors='replace')})" if name else ""
            bad.append(_Bad(f"{shard} record {i}{label}", problem, (shard_no, i)))
    return bad


def _scan(fmt: str, data_dir: str, split: str, threads: int, limit: int | None = None) -> list[_Bad]:
    """The images of a split that cannot be decoded, in reading order; stops after ``limit`` of them."""
    bad: list[_Bad] = []
    # PIL releases the GIL while it reads and decodes, so threads scale here.
    with ThreadPoolExecutor(max(4, threads)) as pool:
        if fmt == "folder":
            files = list_folder(data_dir, split).files
            for start in range(0, len(files), _CHUNK):
                chunk = files[start:start + _CHUNK]
                bad += [_Bad(f, p, f) for f, p in zip(chunk, pool.map(_check_file, chunk), strict=True) if p]
                if limit is not None and len(bad) >= limit:
                    break
        else:
            stop = threading.Event()
            listing = list_shards(data_dir, split)
            futures = [pool.submit(_check_shard, k, s, i, stop)
                       for k, (s, i) in enumerate(zip(listing.shards, listing.indexes, strict=True))]
            for future in futures:
                bad += future.result()
                if limit is not None and len(bad) >= limit:
                    stop.set()
                    break
    return bad[:limit]


@functools.lru_cache(maxsize=16)
def _skip_list(fmt: str, data_dir: str, split: str, threads: int) -> tuple[_Bad, ...]:
    """The full scan for ``on_error="skip"``, once per process and data set (every replica needs it)."""
    start = time.perf_counter()
    bad = tuple(_scan(fmt, data_dir, split, threads))
    log.info("checked the %s images of %s in %.1f s", split, data_dir, time.perf_counter() - start)
    return bad


def _device(config: DataConfig, ctx: InputContext) -> tuple[str, ReplicaGpu]:
    """("mixed", the replica's GPU) or ("cpu", NO_GPU).

    The GPU is the context's: DALI's ``device_id`` is ``ctx.cuda_device`` (CUDA's
    number) and ``DALIDataset`` is placed on ``ctx.tf_device`` (TensorFlow's). They
    differ on Horovod ranks: after ``bind_gpu`` every rank is TensorFlow's
    ``/gpu:0``, but rank 5 of an 8-GPU node is CUDA device 5. A context no
    Replicator made gets the GPU TensorFlow shows this process first. Only these
    numbers are tested; no GPU decode ran here.
    """
    if config.dali_device == "cpu":
        return "cpu", NO_GPU
    gpu = ReplicaGpu(ctx.cuda_device, ctx.tf_device) if ctx.cuda_device is not None else process_gpu()
    if gpu.cuda_device is None:
        if config.dali_device == "mixed":
            raise ConfigError("dali_device='mixed' needs a GPU visible to TensorFlow and none is. "
                              "Fix: dali_device='auto' or 'cpu'.")
        return "cpu", NO_GPU
    return "mixed", gpu


_Source = tuple[int, Callable[[Callable[..., Any]], tuple[Any, Any]]]
_Reader = Callable[[Callable[..., Any]], tuple[Any, Any]]


def _folder_source(config: DataConfig, split: str, pad: Callable[[int], int], bad: set[Any]) -> _Source:
    """Evaluation: the number of real samples, and a function that makes the reader (called inside the pipeline)."""
    listing = list_folder(config.data_dir, split)
    items = [(f, y) for f, y in zip(listing.files, listing.labels, strict=True) if f not in bad]
    n, padding = len(items), pad(len(items))
    if padding:
        items += [(_scratch("pad.jpeg", _pad_jpeg()), PAD_LABEL)] * padding
    return n, _file_list_reader(_scratch("files.txt", _file_list(items)))


def _file_list(items: Iterable[tuple[str, int]]) -> str:
    # A file list rather than files=/labels= keeps the serialized pipeline small at
    # ImageNet scale. DALI's list format rejects negative labels: they are stored +1.
    return "".join(f"{f} {y + 1}\n" for f, y in items)


def _file_list_reader(file_list: str) -> _Reader:
    def make(reader: Callable[..., Any]) -> tuple[Any, Any]:
        jpegs, labels = reader(file_list=file_list)
        return jpegs, labels - 1

    return make


def _tfrecord_reader(config: DataConfig, shards: list[str], indexes: list[str], tfrec: Any) -> _Reader:
    features = {"image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
                "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1)}

    def make(reader: Callable[..., Any]) -> tuple[Any, Any]:
        record = reader(path=shards, index_path=indexes, features=features)
        return record["image/encoded"], record["image/class/label"] - config.label_offset

    return make


def _tfrecord_source(config: DataConfig, split: str, pad: Callable[[int], int], bad: set[Any], tfrec: Any) -> _Source:
    """Evaluation: as :func:`_folder_source`, from the shards."""
    listing = list_shards(config.data_dir, split)
    shards, indexes = list(listing.shards), list(listing.indexes)
    n = 0
    for k, index in enumerate(indexes):
        entries = _index_entries(index)
        kept = [e for i, e in enumerate(entries) if (k, i) not in bad]
        if len(kept) < len(entries):  # skipped records: the reader follows a filtered index
            indexes[k] = _scratch(Path(index).name, "".join(e + "\n" for e in kept))
        n += len(kept)
    padding = pad(n)
    if padding:
        path, index = _pad_record(config.label_offset, padding)
        shards, indexes = [*shards, path], [*indexes, index]
    return n, _tfrecord_reader(config, shards, indexes, tfrec)


def _planned_folder(listing: FolderListing, share: ReplicaShare, scratch: Path) -> _Reader:
    """Training: a reader of exactly the share's files, in order."""
    items = ((listing.files[i], listing.labels[i]) for i in share.ids.tolist())
    file_list = scratch / "files.txt"
    file_list.write_text(_file_list(items))
    return _file_list_reader(str(file_list))


def _planned_tfrecord(config: DataConfig, listing: ShardListing, plan: EpochPlan, share: ReplicaShare,
                      scratch: Path, tfrec: Any) -> _Reader:
    """Training: a reader of exactly the share's records, in order.

    DALI's TFRecord reader reads each ``path`` entry's index in order and seeks
    to every record, so each run of consecutive records from one shard gets an
    index of its own (the plan sorts every batch by group and shard, so a batch
    makes at most one run per shard of its group).
    """
    block = plan.block_of(share.ids)
    cuts = np.flatnonzero(np.diff(block)) + 1
    entries: dict[int, list[str]] = {}
    shards, indexes = [], []
    for n, (ids, k) in enumerate(zip(np.split(share.ids, cuts), block[np.r_[0, cuts]].tolist(), strict=True)):
        if k not in entries:
            entries[k] = _index_entries(listing.indexes[k])
        lines = entries[k]
        index = scratch / f"{n:07d}.idx"
        index.write_text("".join(lines[i] + "\n" for i in (ids - plan.starts[k]).tolist()))
        shards.append(listing.shards[k])
        indexes.append(str(index))
    return _tfrecord_reader(config, shards, indexes, tfrec)


def _bad_ids(listing: FolderListing | ShardListing, bad: Iterable[_Bad]) -> list[int]:
    """The sample ids (plan numbering) of the bad images."""
    if isinstance(listing, FolderListing):
        where = {f: i for i, f in enumerate(listing.files)}
        return [where[x.key] for x in bad if x.key in where]
    starts = np.concatenate([[0], np.cumsum(listing.counts)])
    return [int(starts[x.key[0]]) + x.key[1] for x in bad]


def _train_plan(config: DataConfig, split: str) -> tuple[FolderListing | ShardListing, EpochPlan, tuple[_Bad, ...]]:
    bad = _skip_list(config.format, config.data_dir, split, config.num_threads) if config.on_error == "skip" else ()
    listing = list_folder(config.data_dir, split) if config.format == "folder" else list_shards(config.data_dir, split)
    return listing, plan_for(config, listing, exclude=_bad_ids(listing, bad)), bad


def dali_plan(config: DataConfig, split: str = "train") -> EpochPlan:
    """The plan :func:`dali_dataset` follows when training on ``split`` (bad images left out with on_error="skip")."""
    return _train_plan(config, split)[1]


def _log_bad(config: DataConfig, split: str, bad: tuple[_Bad, ...]) -> None:
    if bad:
        log.warning("skipped %d %s images of %s that cannot be decoded (on_error='skip'): %s", len(bad), split,
                    config.data_dir, "; ".join(f"{x.where}: {x.reason}" for x in bad[:5])
                    + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))


def dali_dataset(config: DataConfig, split: str, ctx: InputContext | None = None,
                 per_replica_batch_size: int | None = None, training: bool | None = None,
                 position: EpochPosition | None = None, *, batch_size: int | None = None) -> tf.data.Dataset:
    """One replica's batches of ``(images, labels)`` for one epoch, from a DALI pipeline.

    Args:
      config: the pipeline settings (``config.backend`` is not consulted here).
      split: "train" or "val".
      ctx: this replica's place (``replica_id``, ``num_replicas``,
        ``per_replica_batch_size``); None: one replica.
      per_replica_batch_size: the batch when ``ctx`` has none.
      training: augment and shuffle (default: ``split == "train"``).
      position: training only: where the epoch resumes (see
        ``hvrep.data.plan``); the batches before it are not read.
      batch_size: the old name of ``per_replica_batch_size`` (deprecated).

    Returns:
      A ``DALIDataset`` (then ``take``, and a cast for bfloat16) of ``images``
      (batch, H, W, 3) or (batch, 3, H, W) in ``config.dtype`` and ``labels``
      (batch,) int32. Evaluation rows with label ``PAD_LABEL`` (-1) are padding
      and must not count. ``dataset.hvrep_skipped`` counts the images left out
      by ``on_error="skip"``.

    Raises:
      hvrep.errors.ConfigError: no batch size, a batch too large for the data,
        ``dali_device="mixed"`` without a GPU.
      hvrep.errors.DataError: a missing or malformed data set (named).
      hvrep.errors.SetupError: DALI or its TensorFlow plugin is missing.
    """
    fn, types, tfrec, dali_tf = _dali()
    ctx, b = replica_batch(ctx, renamed_batch(per_replica_batch_size, batch_size, "dali_dataset"))
    training = split == "train" if training is None else training
    n_rep, global_b = ctx.num_replicas, ctx.num_replicas * b
    device, gpu = _device(config, ctx)
    size = config.image_size
    shape = (b, size, size, 3) if config.layout == "NHWC" else (b, 3, size, size)
    out_tf_dtype = tf.float16 if config.dtype == "float16" else tf.float32

    scratch = None
    if training:
        listing, plan, bad = _train_plan(config, split)
        _log_bad(config, split, bad)
        position = position or EpochPosition()
        share = plan.share(ctx.replica_id, n_rep, b, position)
        steps = share.steps
        if position.is_start and steps == 0:
            raise ConfigError(f"{plan.num_samples - len(bad)} {split} images cannot fill one global batch of "
                              f"{n_rep} x {b}.")
        if steps == 0:  # resumed at the end of the epoch: DALI cannot read an empty list
            empty = (tf.zeros((0, *shape), out_tf_dtype), tf.zeros((0, b), tf.int32))
            return _finished(tf.data.Dataset.from_tensor_slices(empty), config, len(bad))
        # The replica's own list in the plan's order: DALI shuffles nothing and splits nothing.
        scratch = _scratch_folder()
        if isinstance(listing, FolderListing):
            make_reader = _planned_folder(listing, share, scratch)
        else:
            make_reader = _planned_tfrecord(config, listing, plan, share, scratch, tfrec)
        reader_args: dict[str, Any] = {"shard_id": 0, "num_shards": 1, "name": "Reader"}
    else:
        bad = _skip_list(config.format, config.data_dir, split, config.num_threads) if config.on_error == "skip" \
            else ()
        _log_bad(config, split, bad)

        def pad(n: int) -> int:
            return math.ceil(n / global_b) * global_b - n

        keys = {x.key for x in bad}
        if config.format == "folder":
            n, make_reader = _folder_source(config, split, pad, keys)
        else:
            n, make_reader = _tfrecord_source(config, split, pad, keys, tfrec)
        steps = math.ceil(n / global_b)
        reader_args = {"shard_id": ctx.replica_id, "num_shards": n_rep, "name": "Reader"}
    reader = functools.partial(fn.readers.file if config.format == "folder" else fn.readers.tfrecord, **reader_args)

    out_dtype = types.FLOAT16 if config.dtype == "float16" else types.FLOAT
    # Augmentation differs per replica (identical crops on every replica would correlate them).
    pipe_seed = (config.seed * 1_000_003 + ctx.replica_id) % (2**31 - 1)
    from nvidia.dali import Pipeline

    pipe = Pipeline(batch_size=b, num_threads=config.num_threads, device_id=gpu.cuda_device, seed=pipe_seed)
    with pipe:
        jpegs, labels = make_reader(reader)
        if training:
            images = fn.decoders.image_random_crop(
                jpegs, device=device, output_type=types.RGB, random_area=list(config.crop_scale),
                random_aspect_ratio=list(config.crop_ratio), num_attempts=10)
            images = fn.resize(images, resize_x=size, resize_y=size, antialias=False)
            mirror = fn.random.coin_flip(probability=0.5) if config.flip else 0
            crop = None
        else:
            images = fn.decoders.image(jpegs, device=device, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=config.resize_size, antialias=False)
            mirror, crop = 0, (size, size)
        images = fn.crop_mirror_normalize(
            images, crop=crop, mirror=mirror, mean=list(config.mean), std=list(config.std), dtype=out_dtype,
            output_layout="HWC" if config.layout == "NHWC" else "CHW")
        labels = fn.reshape(fn.cast(labels, dtype=types.INT32), shape=[])
        pipe.set_outputs(images, labels.gpu() if device == "mixed" else labels)

    with tf.device(gpu.tf_device or "/cpu:0"):
        ds = dali_tf.DALIDataset(
            pipeline=pipe, batch_size=b, num_threads=config.num_threads, device_id=gpu.cuda_device,
            output_shapes=(shape, (b,)), output_dtypes=(out_tf_dtype, tf.int32))
    ds = _finished(ds.take(steps), config, len(bad))  # DALIDataset never ends: one epoch is `steps` batches
    if scratch is not None:
        # The reader reads its lists when an iterator starts the pipeline; they go with the dataset.
        weakref.finalize(ds, shutil.rmtree, scratch, True)
    return ds


def _finished(ds: tf.data.Dataset, config: DataConfig, skipped: int) -> tf.data.Dataset:
    if config.dtype == "bfloat16":
        ds = ds.map(lambda x, y: (tf.cast(x, tf.bfloat16), y))
    ds.hvrep_skipped = tf.constant(skipped, tf.int64)
    return ds


_DECODE_FAILURE = re.compile(r"decoders\.image|nvImageCodec")


@contextlib.contextmanager
def dali_errors(config: DataConfig, split: str) -> Iterator[None]:
    """Turns a DALI decode failure while iterating a :func:`dali_dataset` into a DataError naming the file.

    DALI's message says only which operator failed ("nvImageCodec failure:
    '#4'"), so on that failure the split's images are checked (a 1/8-scale
    decode each, stopping at the fifth bad one) to name the culprits. Other
    errors pass through unchanged.

    Raises:
      hvrep.errors.DataError: the pipeline failed to decode an image.
    """
    try:
        yield
    except (tf.errors.OpError, RuntimeError) as e:
        message = str(e)
        if not _DECODE_FAILURE.search(message):
            raise
        found = re.search(r"encountered:\s*\n\s*(.+)", message)
        dali_says = found.group(1).strip() if found else message.splitlines()[0]
        bad = _scan(config.format, config.data_dir, split, config.num_threads, limit=5)
        if not bad:
            raise DataError(
                f"DALI failed to decode an image of {config.data_dir} ({split}): {dali_says}, yet every image "
                "passes hvrep's check (a PIL decode). Fix: re-encode the split's images, or try "
                "dali_device='cpu'."
            ) from e
        listed = "; ".join(f"{x.where}: {x.reason}" for x in bad)
        raise DataError(
            f"{listed}. DALI stopped with {dali_says!r}. Fix: replace or delete "
            f"{'the file' if config.format == 'folder' else 'the record (rerun `hvrep data prepare`)'}, or set "
            "data.on_error=skip to leave bad images out (they are counted and logged)."
        ) from e
