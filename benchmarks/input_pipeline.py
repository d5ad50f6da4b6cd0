"""Images/s per CPU core of the training input pipeline, tf.data vs DALI-CPU, next to the JPEG decode limit.

The project's goal: a training pipeline (random-resized-crop to 224, random
flip, normalise, NHWC float32, batched) reaches at least 80% of the rate at
which the same cores can merely decode the same JPEGs. This script measures
both in one run, on the same files, and reports the ratio; it does not
assert it.

The images: 8x8 digits or solid colours decode in microseconds and measure
nothing, so the data set is cut from the two real photographs that ship with
scikit-learn (``china.jpg`` and ``flower.jpg``, 640x427): random crops
resized to ImageNet-like sizes (long side mostly 500, short side 0.66-0.80 of
it, a quarter portrait, fixed seed), re-encoded as JPEG quality 90 into
``train/<photo>/*.JPEG`` and ``val/<photo>/*.JPEG`` (the photo is the class),
then converted with ``hvrep.data.prepare`` to TFRecord shards with DALI
indexes. Both are cached under ``--data-dir`` (a folder per image count and
seed), so reruns skip this.

Cases, each run over the whole train split per round:

- decode only, the file bytes already in memory: ``tf.io.decode_jpeg`` and
  PIL, each on 1 thread and on N threads (N = usable CPUs, a thread pool;
  both release the GIL while decoding: PIL in its decoder, TensorFlow around
  every eager op in ``pywrap_tfe_src.cc``), and ``tf.data`` mapping
  ``decode_jpeg`` with AUTOTUNE;
- the training pipeline through ``hvrep.data.make_dataset`` for backend
  tfdata (AUTOTUNE) and dali (CPU, ``num_threads`` = N), each on the JPEG
  folder and on the TFRecord shards; one epoch = ``floor(images / batch)``
  batches. Each dataset is built once; every epoch makes a new iterator, so
  iterator start-up (DALI builds its pipeline there) is inside the time and
  reported separately as ``first_batch_s``.

- stages (``--no-stages`` leaves them out): the same work built up one
  step at a time, to see where the time goes. tf.data, on the JPEG folder:
  1 read the file; 2 + the crop window from the JPEG header; 3 +
  ``decode_and_crop_jpeg``; 4 + cast and bilinear resize to 224; 5 + random
  flip; 6 + normalise/cast; 7 + batching the images themselves (stages 1-6
  reduce each image to one value, so their batches copy nothing) — the
  steps and helpers of ``hvrep.data.tfdata``. ``stage tfdata tfrecord 1``:
  the TFRecord source (the plan's shard group read into memory, each record
  taken and parsed), to compare with folder stage 1. DALI, on the folder, run
  with ``Pipeline.run`` (no TensorFlow): 1 reader; 2 +
  ``decoders.image_random_crop``; 3 + resize; 4 + ``crop_mirror_normalize``
  (the whole DALI pipeline; ``pipeline dali folder`` adds the TF plugin and
  the epoch plan's file list);
- variants of the last stage, measured to choose: normalising per batch
  (with 3-value constants, as the pipeline did before, and with row-wide
  ones), resizing the uint8 crop without the cast, reading the file in a
  map of its own (as before), ``INTEGER_FAST`` DCT;
  DALI with 1 thread, ``prefetch_queue_depth=1``, ``use_fast_idct``.

Every case is warmed up with one untimed pass, then the cases are timed
round-robin, one pass of each per round, so that load from other processes
drifts over all cases alike and ratios compare passes made side by side.
Every case on N threads is compared with the *decode limit*: the all-core
decode-only case with the highest median rate in this run.

Besides wall-clock images/s, each pass records the process's CPU seconds and
the CPU seconds the rest of the machine used meanwhile (``/proc/stat``): on a
shared machine images per CPU-second is the steadier measure of cost, and
``others_cores`` says how much of the machine was not ours. Every case is
also compared per CPU-second with the *CPU decode limit*: the all-core
decode-only case with the highest median images per CPU-second (the goal's
"per core" when the cores are not all ours).

Usage:
    python benchmarks/input_pipeline.py [--images N] [--batch B] [--repeats R] [--out FILE] [--quick]
                                        [--data-dir DIR] [--no-stages] [--only TEXT ...]

One JSON line per case is appended to ``--out``, all lines of a run sharing
one ``run_id``; a readable table goes to stdout. Fields: ``case``, ``kind``
(decode, pipeline, stage, variant), ``threads``, the case's details
(``backend``, ``format``, ``batch``; stages: ``stage``, ``adds``; variants:
``variant_of``), ``config``, ``env``, ``warmup`` and ``passes`` (each
``wall_s``, ``cpu_s``, ``images``, ``images_per_s``, ``images_per_cpu_s``,
``others_cores``), and ``summary``: ``images_per_s_*`` (median, p10, p90,
min, max; ``_per_core_`` the same over ``threads``),
``images_per_cpu_s_median``, ``cpu_us_per_image_median``,
``vs_decode_limit`` (images/s) and ``per_cpu_s_vs_decode_limit`` (images
per CPU-second), each ``{of_medians, per_round_p10, per_round_p90}``;
pipelines: ``meets_goal`` and ``meets_goal_per_cpu_s``; stages after the
first: ``stage_adds_cpu_us_per_image`` (this stage's CPU time per image
minus the previous stage's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata as md
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from hvrep.data import DataConfig, make_dataset, prepare
from hvrep.data.files import list_folder

# Benchmarks run as scripts (also under `python -m mpi4py`): their folder holds the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, fmt_ratio, ratio
from _common import environment as common_environment
from _common import run_id as new_run_id

GOAL = 0.8  # pipeline images/s over decode-only images/s, same cores, same files
JPEG_QUALITY = 90
IMAGE_SIZE = 224
# Bump when the way images are made changes, so an old cache is not reused.
DATA_VERSION = 1
DATA_MARKER = "hvrep-bench-images.json"
RECORDS_PER_SHARD = 128  # ImageNet's shards hold ~1,250; enough shards here to read in parallel
QUICK_IMAGES, QUICK_BATCH, QUICK_REPEATS = 32, 8, 1


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---------------------------------------------------------------------------- the data set


def _target_size(rng: np.random.Generator) -> tuple[int, int]:
    """An ImageNet-like (width, height).

    ImageNet's train images average about 400x350 and most are 500 pixels on
    the long side (500x375, 500x333): long side 500 with p=0.7, else uniform
    in [300, 500); short side 0.66-0.80 of it; a quarter portrait.
    """
    long = 500 if rng.random() < 0.7 else int(rng.integers(300, 500))
    short = round(long * rng.uniform(0.66, 0.80))
    return (short, long) if rng.random() < 0.25 else (long, short)


def _photo_crop(photo: Any, rng: np.random.Generator, size: tuple[int, int]) -> Any:
    """A random window of ``photo`` with ``size``'s aspect ratio, resized to ``size``.

    The window is at least ``size`` itself where the photo allows (a portrait
    500 pixels high does not fit in 427 and is enlarged a little): enlarging
    would smooth the image and make a JPEG that is smaller and faster to
    decode than a camera's. Even so these two photos (a sky, a blurred
    background) re-encode at quality 90 to about 2.2 bits per pixel (45 KiB
    at ~440x380), ImageNet's JPEGs to 4-6 (110 KiB on average): less entropy
    decoding per image, so absolute rates run higher than on ImageNet; the
    decode-only and pipeline cases read the same files.
    """
    from PIL import Image

    w, h = size
    pw, ph = photo.size
    fit = min(pw / w, ph / h)  # largest window of this aspect ratio: (w * fit, h * fit)
    scale = rng.uniform(min(1.0, fit), fit)
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    left, top = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    return photo.crop((left, top, left + cw, top + ch)).resize((w, h), Image.Resampling.BICUBIC)


def _make_images(root: Path, counts: dict[str, int], seed: int) -> dict[str, Any]:
    """Writes ``root/{train,val}/{china,flower}/*.JPEG``; returns their statistics."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    sample = load_sample_images()
    photos = {Path(f).stem: Image.fromarray(a) for f, a in zip(sample.filenames, sample.images, strict=True)}
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    sizes, nbytes = [], []
    for split, n in counts.items():
        for i in range(n):
            name = names[i % len(names)]
            size = _target_size(rng)
            image = _photo_crop(photos[name], rng, size)
            out = root / split / name / f"{split}_{i:06d}.JPEG"
            out.parent.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=JPEG_QUALITY)
            out.write_bytes(buf.getvalue())
            if split == "train":
                sizes.append(size)
                nbytes.append(len(buf.getvalue()))
    wh = np.asarray(sizes, np.float64)
    return {
        "source": "sklearn.datasets.load_sample_images(): " + ", ".join(f"{k}.jpg {v.size[0]}x{v.size[1]}"
                                                                          for k, v in photos.items()),
        "classes": names,
        "counts": counts,
        "jpeg_quality": JPEG_QUALITY,
        "seed": seed,
        "data_version": DATA_VERSION,
        "train_mean_width": float(wh[:, 0].mean()),
        "train_mean_height": float(wh[:, 1].mean()),
        "train_mean_megapixels": float((wh[:, 0] * wh[:, 1]).mean() / 1e6),
        "train_portrait_fraction": float((wh[:, 1] > wh[:, 0]).mean()),
        "train_mean_kib": float(np.mean(nbytes) / 1024),
        "train_total_mib": float(np.sum(nbytes) / 2**20),
    }


def _data_set(base: Path, images: int, seed: int) -> tuple[Path, Path, dict[str, Any]]:
    """The cached (JPEG folder, TFRecord folder, statistics) for ``images`` train images; made if missing."""
    counts = {"train": images, "val": max(4, images // 8)}
    root = base / f"sklearn-photos-v{DATA_VERSION}-train{counts['train']}-val{counts['val']}-seed{seed}"
    folder, records = root / "folder", root / "tfrecord"
    marker = root / DATA_MARKER
    if marker.is_file():
        stats = json.loads(marker.read_text())
    else:
        # Half-written by an interrupted run: start over (the marker is written last).
        shutil.rmtree(root, ignore_errors=True)
        started = time.perf_counter()
        stats = _make_images(folder, counts, seed)
        stats["train_shards"] = max(1, images // RECORDS_PER_SHARD)
        prepare(folder, records, train_shards=stats["train_shards"], val_shards=1, seed=seed, progress=False)
        stats["made_in_s"] = time.perf_counter() - started
        marker.write_text(json.dumps(stats, indent=1))
    return folder, records, stats


# ---------------------------------------------------------------------------- cases


@dataclass
class _Case:
    """One thing timed: a pass over the train split that returns (images, seconds to the first batch or None)."""

    name: str
    kind: str  # "decode" or "pipeline"
    threads: int  # CPU threads it may use; images/s per core divides by this
    details: dict[str, Any]
    run: Callable[[], tuple[int, float | None]] | None = None
    error: str | None = None
    output: dict[str, Any] | None = None
    warmup: dict[str, Any] | None = None
    passes: list[dict[str, float]] = field(default_factory=list)


def _proc_stat_busy_s() -> float | None:
    """CPU seconds all processes have used since boot (``/proc/stat``), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq: busy is all but idle and iowait. Steal (the
    # hypervisor's other guests) and guest (already inside user) are left out.
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")


def _timed(case: _Case) -> dict[str, float]:
    assert case.run is not None
    busy0, cpu0, t0 = _proc_stat_busy_s(), time.process_time(), time.perf_counter()
    images, first = case.run()
    wall, cpu, busy1 = time.perf_counter() - t0, time.process_time() - cpu0, _proc_stat_busy_s()
    if images <= 0:
        raise RuntimeError(f"a pass of {case.name} produced no images.")
    out = {"wall_s": wall, "cpu_s": cpu, "images": images, "images_per_s": images / wall,
           "images_per_cpu_s": images / cpu if cpu > 0 else math.nan}
    if first is not None:
        out["first_batch_s"] = first
        if wall > first and images > case.details["batch"]:
            # Without iterator start-up and the first batch: the rate an epoch of ImageNet's size would see.
            out["images_per_s_after_first_batch"] = (images - case.details["batch"]) / (wall - first)
    if busy0 is not None and busy1 is not None:
        # /proc/stat ticks at 10 ms: over a pass of a second or more this is good to a few percent.
        out["others_cores"] = max(0.0, (busy1 - busy0 - cpu) / wall)
    return out


def _decode_cases(blobs: Sequence[bytes], cores: int) -> list[_Case]:
    from PIL import Image

    tensors = [tf.constant(b) for b in blobs]  # converted once: only the decode is timed

    def tf_decode(t: tf.Tensor) -> None:
        # Eager ops on the CPU run synchronously: the pixels exist when this returns.
        tf.io.decode_jpeg(t, channels=3)

    def pil_decode(b: bytes) -> None:
        with Image.open(io.BytesIO(b)) as im:
            im.load()  # libjpeg-turbo with the GIL released; a JPEG photo decodes to RGB directly

    def serial(fn: Callable[[Any], None], items: Sequence[Any]) -> Callable[[], tuple[int, None]]:
        def run() -> tuple[int, None]:
            for x in items:
                fn(x)
            return len(items), None

        return run

    def threaded(fn: Callable[[Any], None], items: Sequence[Any], pool: ThreadPoolExecutor
                 ) -> Callable[[], tuple[int, None]]:
        def run() -> tuple[int, None]:
            for _ in pool.map(fn, items):
                pass
            return len(items), None

        return run

    # The pools live as long as the process: made once, outside the timing.
    pools = [ThreadPoolExecutor(cores, thread_name_prefix=f"decode-{k}") for k in ("tf", "pil")]
    strings = tf.constant(list(blobs))
    # tf.shape of the decoded image needs the decode (its shape is unknown until then) but copies no pixels.
    decode_ds = (tf.data.Dataset.from_tensor_slices(strings)
                 .map(lambda b: tf.shape(tf.io.decode_jpeg(b, channels=3)), num_parallel_calls=tf.data.AUTOTUNE,
                      deterministic=False)
                 .batch(64).prefetch(tf.data.AUTOTUNE))

    def tfdata_run() -> tuple[int, None]:
        n = 0
        for shapes in decode_ds:
            n += int(shapes.shape[0])
        return n, None

    src = {"source": "train split JPEG bytes in memory", "channels": 3}
    return [
        _Case("decode tf.io.decode_jpeg 1 thread", "decode", 1, {"decoder": "tf.io.decode_jpeg", **src},
              serial(tf_decode, tensors)),
        _Case(f"decode tf.io.decode_jpeg {cores} threads", "decode", cores,
              {"decoder": "tf.io.decode_jpeg", "parallelism": "ThreadPoolExecutor", **src},
              threaded(tf_decode, tensors, pools[0])),
        _Case("decode tf.data decode_jpeg AUTOTUNE", "decode", cores,
              {"decoder": "tf.io.decode_jpeg", "parallelism": "tf.data map AUTOTUNE", **src}, tfdata_run),
        _Case("decode PIL 1 thread", "decode", 1, {"decoder": "PIL.Image.load", **src}, serial(pil_decode, blobs)),
        _Case(f"decode PIL {cores} threads", "decode", cores,
              {"decoder": "PIL.Image.load", "parallelism": "ThreadPoolExecutor", **src},
              threaded(pil_decode, blobs, pools[1])),
    ]


def _pipeline_case(backend: str, fmt: str, data_dir: Path, batch: int, cores: int, images: int, seed: int
                   ) -> _Case:
    extra = {"num_threads": cores, "dali_device": "cpu"} if backend == "dali" else {"num_threads": cores}
    config = DataConfig(str(data_dir), format=fmt, backend=backend, image_size=IMAGE_SIZE, seed=seed, **extra)
    name = f"pipeline {backend} {fmt}"
    case = _Case(name, "pipeline", cores, {"backend": backend, "format": fmt, "batch": batch,
                                           "data_config": dataclasses.asdict(config)})
    # At most one epoch; a pipeline that pads its last batch may give ceil(n/b).
    # One batch more than that means it does not stop, and is an error, not a hang.
    limit = math.ceil(images / batch)
    try:
        dataset = make_dataset(config, "train", per_replica_batch_size=batch, training=True)
    except Exception as e:  # DALI may be missing or broken; the other cases still run
        case.error = f"building the dataset: {type(e).__name__}: {e}".strip()[:2000]
        return case
    dataset = dataset.take(limit + 1)

    def run() -> tuple[int, float | None]:
        n, batches, first = 0, 0, None
        start = time.perf_counter()
        # A new iterator per pass; the batches are materialised host tensors when they arrive.
        for images_t, labels in dataset:
            if first is None:
                first = time.perf_counter() - start
                case.output = {"images_shape": images_t.shape.as_list(), "images_dtype": images_t.dtype.name,
                               "labels_shape": labels.shape.as_list(), "labels_dtype": labels.dtype.name}
            n += int(images_t.shape[0])
            batches += 1
        if batches > limit:
            raise RuntimeError(f"{name} yielded more than {limit} batches of {batch} from {images} images: "
                               "it does not stop after one epoch.")
        return n, first

    case.run = run
    return case


def _batches(dataset: tf.data.Dataset) -> Callable[[], tuple[int, None]]:
    """A pass: a new iterator over ``dataset``, counting the rows of its batches."""
    def run() -> tuple[int, None]:
        n = 0
        for x in dataset:
            n += int(tf.shape(tf.nest.flatten(x)[0])[0])
        return n, None

    return run


def _one_value(x: tf.Tensor) -> tf.Tensor:
    # A stage's output reduced to one value that needs the whole tensor computed (tf.shape of a
    # statically shaped tensor would be constant-folded and its producer pruned): what a stage
    # costs excludes copying its pixels into a batch.
    return tf.cast(tf.reshape(x, [-1])[0], tf.float32)


TFDATA_STAGES = (
    "read the file (tf.io.read_file)",
    "+ crop window from the JPEG header (extract_jpeg_shape, stateless_sample_distorted_bounding_box)",
    "+ decode_and_crop_jpeg",
    "+ cast to float32, bilinear resize to 224",
    "+ random flip (stateless, seeded by the sample)",
    "+ normalise (per image, row-wide constants) and cast/layout",
    "+ batch the images themselves (until here one value per image), prefetch",
)


def _tfdata_stage_cases(folder: Path, batch: int, cores: int, seed: int) -> list[_Case]:
    """The training map of ``hvrep.data.tfdata`` built up one step at a time, on the train files.

    Every stage is a tf.data pipeline over the same files (listing order, sample id = position), one
    parallel map (AUTOTUNE, deterministic, as the pipeline's), then ``batch`` and ``prefetch``; until
    the last stage each image is reduced to one value, so the batch copies nothing. The steps are
    the pipeline's own helpers (``_crop_window``, ``_finish``) and ops; ``tests/unit/data/
    test_data_pixels.py`` pins the pipeline to the same steps.
    """
    from hvrep.data.tfdata import _crop_window, _finish

    config = DataConfig(str(folder), image_size=IMAGE_SIZE, seed=seed)
    files = list_folder(folder, "train").files
    source = tf.data.Dataset.from_tensor_slices((tf.constant(files), tf.range(len(files), dtype=tf.int64)))

    def upto(stage: int, dct_method: str = "", finish: bool = True, cast_first: bool = True, read: bool = True
             ) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
        def element(path: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
            sample_seed = tf.stack([tf.constant(seed, tf.int64), i])
            data = tf.io.read_file(path) if read else path
            if stage == 1:
                return tf.cast(tf.strings.length(data), tf.float32)
            window = _crop_window(data, sample_seed, config)
            if stage == 2:
                return tf.cast(window[0], tf.float32)
            image = tf.io.decode_and_crop_jpeg(data, window, channels=3, dct_method=dct_method)
            if stage == 3:
                return _one_value(image)
            image = tf.image.resize(tf.cast(image, tf.float32) if cast_first else image, [IMAGE_SIZE, IMAGE_SIZE],
                                    method="bilinear")
            if stage == 4:
                return _one_value(image)
            image = tf.image.stateless_random_flip_left_right(image, seed=sample_seed + 1)
            if stage == 5:
                return _one_value(image)
            if finish:
                image = _finish(image, config)
            return _one_value(image) if stage == 6 else image

        return element

    def pipeline(fn: Callable[..., tf.Tensor]) -> tf.data.Dataset:
        return (source.map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

    cases = []
    for k, adds in enumerate(TFDATA_STAGES, 1):
        cases.append(_Case(f"stage tfdata folder {k}", "stage", cores,
                           {"backend": "tfdata", "format": "folder", "stage": k, "adds": adds, "batch": batch},
                           _batches(pipeline(upto(k)))))

    # Variants of the last stage, measured to choose (and to keep the figures quoted in tfdata.py honest).
    scale = tf.constant([1.0 / s for s in config.std], tf.float32)
    shift = tf.constant([-m / s for m, s in zip(config.mean, config.std, strict=True)], tf.float32)
    before = (source.map(upto(7, finish=False), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
              .batch(batch, drop_remainder=True)
              .map(lambda x: x * scale + shift, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    wide_scale, wide_shift = tf.tile(scale, [IMAGE_SIZE]), tf.tile(shift, [IMAGE_SIZE])

    def wide(x: tf.Tensor) -> tf.Tensor:
        return tf.reshape(tf.reshape(x, [-1, IMAGE_SIZE * 3]) * wide_scale + wide_shift, tf.shape(x))

    after_batch = (source.map(upto(7, finish=False), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                   .batch(batch, drop_remainder=True)
                   .map(wide, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    # upto(7) again, with tf.io.read_file in a parallel map of its own ahead of the rest.
    read_first = source.map(lambda path, i: (tf.io.read_file(path), i), num_parallel_calls=tf.data.AUTOTUNE,
                            deterministic=True)
    separate_read = (read_first.map(upto(7, read=False), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                     .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    variants = {
        "normalise per batch, 3-vector constants (the pipeline before)": before,
        "normalise per batch, row-wide constants": after_batch,
        "resize the uint8 crop (no cast first)": pipeline(upto(7, cast_first=False)),
        "read in a map of its own (as before), then the rest": separate_read,
        "decode_and_crop_jpeg dct_method=INTEGER_FAST": pipeline(upto(7, dct_method="INTEGER_FAST")),
    }
    for name, ds in variants.items():
        cases.append(_Case(f"variant tfdata: {name}", "variant", cores,
                           {"backend": "tfdata", "format": "folder", "variant_of": "stage tfdata folder 7",
                            "batch": batch}, _batches(ds)))
    return cases


def _tfrecord_source_case(records_dir: Path, batch: int, cores: int, seed: int) -> _Case:
    """Stage 1 of the TFRecord path: the planned records read, taken and parsed (one value per image)."""
    from hvrep.data.files import list_shards
    from hvrep.data.plan import EpochPosition
    from hvrep.data.tfdata import _planned_records, tfdata_plan

    config = DataConfig(str(records_dir), format="tfrecord", image_size=IMAGE_SIZE, seed=seed)
    plan = tfdata_plan(config)
    share = plan.share(0, 1, batch, EpochPosition())
    ds, load = _planned_records(list_shards(records_dir, "train"), plan, share, config.label_offset)
    ds = (ds.take(share.steps * batch)
          .map(lambda *e: tf.cast(tf.strings.length(load(*e)[0]), tf.float32), num_parallel_calls=tf.data.AUTOTUNE,
               deterministic=True)
          .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    adds = ("read the plan's shard group into memory (TFRecordDataset, interleaved), take each planned "
            "record, parse it (tf.io.parse_single_example)")
    return _Case("stage tfdata tfrecord 1", "stage", cores,
                 {"backend": "tfdata", "format": "tfrecord", "stage": 1, "adds": adds, "batch": batch}, _batches(ds))


DALI_STAGES = (
    "read the files (readers.file)",
    "+ decoders.image_random_crop (CPU)",
    "+ resize to 224 (bilinear, no antialias)",
    "+ crop_mirror_normalize (random mirror, normalise, float32 HWC): the whole DALI pipeline",
    "+ DALIDataset (the TF plugin), one iterator kept across passes (no pipeline start-up per epoch)",
)


def _dali_stage_cases(folder: Path, batch: int, cores: int, seed: int, images: int) -> list[_Case]:
    """``hvrep.data.dali``'s training pipeline built up one operator at a time, run with ``Pipeline.run``.

    Stages 1-4 use no TensorFlow; stage 5 wraps stage 4 in ``DALIDataset`` and keeps one iterator
    across passes. The difference between stage 5 and the ``pipeline dali folder`` case (a new
    iterator per epoch, as ``make_dataset`` gives) is DALI's start-up per epoch: the pipeline is
    built again, and ``prefetch_queue_depth`` batches made ahead at the end are thrown away.
    """
    try:
        import nvidia.dali.plugin.tf as dali_tf
        from nvidia.dali import Pipeline, fn, types
    except ImportError as e:
        return [_Case(f"stage dali folder {k}", "stage", cores, {"backend": "dali", "stage": k}, error=str(e))
                for k in range(1, len(DALI_STAGES) + 1)]
    config = DataConfig(str(folder), image_size=IMAGE_SIZE, seed=seed)
    steps = images // batch
    cases = []
    full = 4  # the whole DALI pipeline, without TensorFlow
    # (name, kind, stage, what it adds or changes, Pipeline arguments, decoder arguments)
    plans = [(f"stage dali folder {k}", "stage", k, adds, {}, {}) for k, adds in enumerate(DALI_STAGES, 1)] + [
        ("variant dali: num_threads=1", "variant", full, "", {"num_threads": 1}, {}),
        ("variant dali: prefetch_queue_depth=1", "variant", full, "", {"prefetch_queue_depth": 1}, {}),
        ("variant dali: decoder use_fast_idct=True", "variant", full, "", {}, {"use_fast_idct": True}),
    ]
    for name, kind, k, adds, pipe_args, decoder_args in plans:
        pipe = Pipeline(batch_size=batch, device_id=None, seed=seed + 1, **{"num_threads": cores, **pipe_args})
        with pipe:
            out, labels = fn.readers.file(file_root=str(folder / "train"), name="Reader")
            if k >= 2:
                out = fn.decoders.image_random_crop(
                    out, device="cpu", output_type=types.RGB, random_area=list(config.crop_scale),
                    random_aspect_ratio=list(config.crop_ratio), num_attempts=10, **decoder_args)
            if k >= 3:
                out = fn.resize(out, resize_x=IMAGE_SIZE, resize_y=IMAGE_SIZE, antialias=False)
            if k >= 4:
                out = fn.crop_mirror_normalize(out, mirror=fn.random.coin_flip(probability=0.5),
                                               mean=list(config.mean), std=list(config.std), dtype=types.FLOAT,
                                               output_layout="HWC")
            if k >= 5:
                pipe.set_outputs(out, fn.reshape(fn.cast(labels, dtype=types.INT32), shape=[]))
            else:
                pipe.set_outputs(out)
        details = {"backend": "dali", "format": "folder", "batch": batch, "num_threads": cores, **pipe_args,
                   **decoder_args, **({"stage": k, "adds": adds} if kind == "stage" else
                                      {"variant_of": f"stage dali folder {full}"})}
        try:
            if k >= 5:
                with tf.device("/cpu:0"):
                    batches = iter(dali_tf.DALIDataset(
                        pipeline=pipe, batch_size=batch, num_threads=cores, device_id=None,
                        output_shapes=((batch, IMAGE_SIZE, IMAGE_SIZE, 3), (batch,)),
                        output_dtypes=(tf.float32, tf.int32)))
                step: Callable[[], Any] = functools.partial(next, batches)
            else:
                pipe.build()
                step = pipe.run
        except Exception as e:  # a broken DALI is reported, the other cases still run
            cases.append(_Case(name, kind, cores, details, error=f"building: {type(e).__name__}: {e}"[:2000]))
            continue

        def run(step: Callable[[], Any] = step) -> tuple[int, None]:
            # The reader runs on across passes (it wraps around the files): steps x batch images a pass.
            for _ in range(steps):
                step()
            return steps * batch, None

        cases.append(_Case(name, kind, cores, details, run))
    return cases


def _check_output(case: _Case, batch: int) -> None:
    """Raises unless the pipeline made what the goal is about: (batch, 224, 224, 3) float32."""
    want = [batch, IMAGE_SIZE, IMAGE_SIZE, 3]
    got = case.output or {}
    if got.get("images_shape") != want or got.get("images_dtype") != "float32":
        raise RuntimeError(f"{case.name} made images {got.get('images_shape')} {got.get('images_dtype')}, "
                           f"expected {want} float32 (NHWC): the timings would compare different work.")


# ---------------------------------------------------------------------------- statistics


def _spread(values: Sequence[float], prefix: str) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {f"{prefix}_median": float(np.median(a)), f"{prefix}_p10": float(np.percentile(a, 10)),
            f"{prefix}_p90": float(np.percentile(a, 90)), f"{prefix}_min": float(a.min()),
            f"{prefix}_max": float(a.max())}




def _summary(case: _Case) -> dict[str, Any]:
    rates = [p["images_per_s"] for p in case.passes]
    s = _spread(rates, "images_per_s")
    s.update({k.replace("images_per_s", "images_per_s_per_core"): v / case.threads for k, v in s.items()})
    s["images_per_cpu_s_median"] = float(np.median([p["images"] / p["cpu_s"] for p in case.passes if p["cpu_s"] > 0]
                                                   or [math.nan]))
    s["cpu_us_per_image_median"] = 1e6 / s["images_per_cpu_s_median"]
    s["cpu_utilisation_median"] = float(np.median([p["cpu_s"] / p["wall_s"] / case.threads for p in case.passes]))
    others = [p["others_cores"] for p in case.passes if "others_cores" in p]
    s["others_cores_median"] = float(np.median(others)) if others else None
    firsts = [p["first_batch_s"] for p in case.passes if "first_batch_s" in p]
    s["first_batch_s_median"] = float(np.median(firsts)) if firsts else None
    steady = [p["images_per_s_after_first_batch"] for p in case.passes if "images_per_s_after_first_batch" in p]
    s["images_per_s_after_first_batch_median"] = float(np.median(steady)) if steady else None
    return s


# ---------------------------------------------------------------------------- environment, arguments, main


def _environment() -> dict[str, Any]:
    from PIL import features

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        **common_environment(),
        "pillow": version("pillow"),
        "pillow_libjpeg_turbo": features.check_feature("libjpeg_turbo"),
        "scikit_learn": version("scikit-learn"),
        "nvidia_dali": version("nvidia-dali-cuda120") or version("nvidia-dali-cuda130"),
        "nvidia_dali_tf_plugin": version("nvidia-dali-tf-plugin-cuda120") or version("nvidia-dali-tf-plugin-cuda130"),
        "processor": platform.processor(),
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=512, help="train images in the data set (default 512)")
    p.add_argument("--batch", type=int, default=64, help="pipeline batch size (default 64)")
    p.add_argument("--repeats", type=int, default=10, help="timed passes per case, round-robin (default 10)")
    p.add_argument("--out", type=Path, default=Path("results/input_pipeline.jsonl"),
                   help="JSON lines file to append to; its folder is created (default results/input_pipeline.jsonl)")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "hvrep-bench-input-pipeline",
                   help="where the generated JPEGs and TFRecords are cached (default: under the system temp dir)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {QUICK_IMAGES} images, batch {QUICK_BATCH}, {QUICK_REPEATS} repeat "
                        "(overrides all three)")
    p.add_argument("--seed", type=int, default=0, help="seed of the image crops and the pipelines (default 0)")
    p.add_argument("--no-stages", action="store_true", help="leave out the stage and variant cases")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="run only the cases whose name contains TEXT (repeatable); decode cases always run")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.batch, args.repeats = QUICK_IMAGES, QUICK_BATCH, QUICK_REPEATS
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}.")
    if args.batch < 1 or args.images < args.batch:
        p.error(f"need 1 <= --batch <= --images, got --batch {args.batch}, --images {args.images}.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    cores = _usable_cpus()
    folder, records_dir, data_stats = _data_set(args.data_dir, args.images, args.seed)
    files = list_folder(folder, "train").files
    blobs = [Path(f).read_bytes() for f in files]

    cases = _decode_cases(blobs, cores)
    for backend in ("tfdata", "dali"):
        for fmt, path in (("folder", folder), ("tfrecord", records_dir)):
            cases.append(_pipeline_case(backend, fmt, path, args.batch, cores, len(files), args.seed))
    if not args.no_stages:
        cases += _tfdata_stage_cases(folder, args.batch, cores, args.seed)
        cases.append(_tfrecord_source_case(records_dir, args.batch, cores, args.seed))
        cases += _dali_stage_cases(folder, args.batch, cores, args.seed, len(files))
    if args.only:
        # Decode cases always run: every ratio is to them.
        cases = [c for c in cases if c.kind == "decode" or any(o in c.name for o in args.only)]

    load_before = os.getloadavg()
    for case in cases:
        if case.error is not None:
            print(f"{case.name}: {case.error[:1500]}", file=sys.stderr)
            continue
        try:
            case.warmup = _timed(case)
            if case.kind == "pipeline":
                _check_output(case, args.batch)
        except Exception as e:  # one failing case (e.g. DALI) is reported, the others still run
            case.error = f"warm-up: {type(e).__name__}: {e}".strip()[:2000]
            print(f"{case.name} failed in warm-up, skipped:\n"
                  + "".join(traceback.format_exception_only(e))[-1500:], file=sys.stderr)

    for _ in range(args.repeats):
        for case in cases:
            if case.error is None:
                try:
                    case.passes.append(_timed(case))
                except Exception as e:
                    case.error = f"timed pass {len(case.passes) + 1}: {type(e).__name__}: {e}".strip()[:2000]
                    print(f"{case.name} failed while timed:\n"
                          + "".join(traceback.format_exception_only(e))[-1500:], file=sys.stderr)
    load_after = os.getloadavg()

    ok = [c for c in cases if c.error is None and c.passes]
    rates = {c.name: [p["images_per_s"] for p in c.passes] for c in ok}
    all_core_decodes = [c for c in ok if c.kind == "decode" and c.threads == cores]
    limit = max(all_core_decodes, key=lambda c: float(np.median(rates[c.name])), default=None)
    cpu_rates = {c.name: [p["images_per_cpu_s"] for p in c.passes] for c in ok}
    limit_cpu = max(all_core_decodes, key=lambda c: float(np.median(cpu_rates[c.name])), default=None)

    run_id = new_run_id()
    config = {
        "images": len(files),
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup_passes": 1,
        "quick": args.quick,
        "seed": args.seed,
        "cores": cores,
        "image_size": IMAGE_SIZE,
        "augmentation": "random-resized-crop to 224 (scale 0.08-1, ratio 3/4-4/3), random flip, normalise, "
                        "NHWC float32 (hvrep.data.DataConfig defaults)",
        "data_dir": str(args.data_dir),
        "folder": str(folder),
        "tfrecord": str(records_dir),
        "data": data_stats,
        "goal": f"pipeline images/s >= {GOAL:.0%} of the decode limit",
        "decode_limit_case": limit.name if limit else None,
        "decode_limit_rule": f"the decode-only case on all {cores} cores with the highest median images/s",
        "goal_per_cpu_s": f"pipeline images per CPU-second >= {GOAL:.0%} of the CPU decode limit's",
        "decode_limit_cpu_case": limit_cpu.name if limit_cpu else None,
        "decode_limit_cpu_rule": f"the decode-only case on all {cores} cores with the highest median images per "
                                 "CPU-second",
        "stages": {"tfdata": list(TFDATA_STAGES), "dali": list(DALI_STAGES)},
        "schedule": "every case warmed up with one pass, then timed round-robin (one pass of each case per round)",
        "sync": "CPU eager ops and tf.data/DALI batches are complete when they are returned; nothing is queued",
        "epoch": "decode cases: every train image once; pipelines: one epoch, floor(images / batch) batches, "
                 "a new iterator each pass (start-up inside the time, also reported as first_batch_s)",
    }
    env = _environment()
    env["loadavg_before"] = list(load_before)
    env["loadavg_after"] = list(load_after)

    out_records = []
    for case in cases:
        summary = None
        if case.error is None and case.passes:
            summary = _summary(case)
            summary["vs_decode_limit"] = ratio(rates[case.name], rates[limit.name]) if limit else None
            steady = [p.get("images_per_s_after_first_batch") for p in case.passes]
            summary["vs_decode_limit_after_first_batch"] = (
                ratio(steady, rates[limit.name]) if limit and None not in steady else None)
            summary["vs_decode"] = {c.name: ratio(rates[case.name], rates[c.name]) for c in ok if c.kind == "decode"}
            summary["per_cpu_s_vs_decode_limit"] = (ratio(cpu_rates[case.name], cpu_rates[limit_cpu.name])
                                                    if limit_cpu else None)
            if case.kind == "pipeline" and summary["per_cpu_s_vs_decode_limit"] is not None:
                summary["meets_goal_per_cpu_s"] = summary["per_cpu_s_vs_decode_limit"]["of_medians"] >= GOAL
            if case.kind == "stage" and case.details["stage"] > 1:
                previous = next((r["summary"] for r in out_records if r["summary"] and r["kind"] == "stage"
                                 and r["backend"] == case.details["backend"] and r["format"] == case.details["format"]
                                 and r["stage"] == case.details["stage"] - 1), None)
                if previous is not None:
                    summary["stage_adds_cpu_us_per_image"] = (summary["cpu_us_per_image_median"]
                                                              - previous["cpu_us_per_image_median"])
            if case.kind == "pipeline" and summary["vs_decode_limit"] is not None:
                summary["meets_goal"] = summary["vs_decode_limit"]["of_medians"] >= GOAL
                after = summary["vs_decode_limit_after_first_batch"]
                summary["meets_goal_after_first_batch"] = None if after is None else after["of_medians"] >= GOAL
        out_records.append({
            "benchmark": "input_pipeline",
            "run_id": run_id,
            "case": case.name,
            "kind": case.kind,
            "threads": case.threads,
            **case.details,
            "ok": case.error is None,
            "error": case.error,
            "config": config,
            "env": env,
            "output": case.output,
            "warmup": case.warmup,
            "passes": case.passes,
            "summary": summary,
        })

    append_jsonl(args.out, out_records)

    _print_table(out_records, config, env, args.out)
    return 0




def _print_table(records: list[dict[str, Any]], config: dict[str, Any], env: dict[str, Any], out: Path) -> None:
    d = config["data"]
    print(f"input pipeline, {config['images']} train JPEGs cut from scikit-learn's photos: mean "
          f"{d['train_mean_width']:.0f}x{d['train_mean_height']:.0f}, {d['train_mean_kib']:.0f} KiB, quality "
          f"{d['jpeg_quality']}; batch {config['batch']}, {config['image_size']}px NHWC float32")
    print(f"warm-up 1 pass, {config['repeats']} timed passes per case (round-robin); TF {env['tensorflow']}, "
          f"DALI {env['nvidia_dali']}, Pillow {env['pillow']}; {config['cores']} usable CPUs of "
          f"{env['cpu_count']}, {env['hostname']}; load average {env['loadavg_before'][0]:.2f} -> "
          f"{env['loadavg_after'][0]:.2f}")
    header = (f"{'case':<38} {'thr':>3} {'img/s median':>12} {'p10':>7} {'p90':>7} {'per core':>8} "
              f"{'img/CPU-s':>9} {'CPU use':>7} {'others':>6}  {'vs decode limit':<20} {'goal':<4} "
              f"{'per CPU-s vs limit':<20} {'goal':<4} {'after 1st batch: img/s, vs limit':<32}")
    print(header)
    print("-" * len(header))
    for r in records:
        if r["kind"] in ("stage", "variant"):
            continue
        s = r["summary"]
        if s is None:
            print(f"{r['case']:<38} {r['threads']:>3} FAILED: {(r['error'] or '')[:300]}")
            continue
        others = "-" if s["others_cores_median"] is None else f"{s['others_cores_median']:.2f}"
        goal = {True: "met", False: "no"}.get(s.get("meets_goal"), "")
        cpu_goal = {True: "met", False: "no"}.get(s.get("meets_goal_per_cpu_s"), "")
        steady = ""
        if s["images_per_s_after_first_batch_median"] is not None:
            steady = (f"{s['images_per_s_after_first_batch_median']:>7.1f}  "
                      f"{fmt_ratio(s['vs_decode_limit_after_first_batch'])}")
        print(f"{r['case']:<38} {r['threads']:>3} {s['images_per_s_median']:>12.1f} {s['images_per_s_p10']:>7.1f} "
              f"{s['images_per_s_p90']:>7.1f} {s['images_per_s_per_core_median']:>8.1f} "
              f"{s['images_per_cpu_s_median']:>9.1f} {s['cpu_utilisation_median']:>7.0%} {others:>6}  "
              f"{fmt_ratio(s['vs_decode_limit']):<20} {goal:<4} {fmt_ratio(s['per_cpu_s_vs_decode_limit']):<20} "
              f"{cpu_goal:<4} {steady}")
    stages = [r for r in records if r["kind"] in ("stage", "variant")]
    if stages:
        print()
        print(f"{'stage breakdown (CPU time per image; ratios per CPU-second)':<70} {'img/CPU-s':>9} {'us/img':>7} "
              f"{'adds us':>7}  {'vs CPU decode limit':<20} img/s")
        for r in stages:
            s = r["summary"]
            label = f"{r['case']}: {r.get('adds') or ''}"[:70]
            if s is None:
                print(f"{label:<70} FAILED: {(r['error'] or '')[:200]}")
                continue
            adds = s.get("stage_adds_cpu_us_per_image")
            print(f"{label:<70} {s['images_per_cpu_s_median']:>9.1f} {s['cpu_us_per_image_median']:>7.0f} "
                  f"{'' if adds is None else f'{adds:+.0f}':>7}  {fmt_ratio(s['per_cpu_s_vs_decode_limit']):<20} "
                  f"{s['images_per_s_median']:.1f}")
    print(f"decode limit: {config['decode_limit_case']} ({config['decode_limit_rule']}); goal: {config['goal']}")
    print(f"CPU decode limit: {config['decode_limit_cpu_case']} ({config['decode_limit_cpu_rule']}); "
          f"goal per CPU-second: {config['goal_per_cpu_s']}")
    print("ratios: of medians [p10-p90 of per-round ratios]; goal: on the whole epoch. CPU use: process CPU time / "
          "(wall x threads); others: cores busy with other processes meanwhile (median); after 1st batch: the epoch "
          "without iterator start-up and the first batch.")
    print(f"appended {len(records)} lines to {out}")


if __name__ == "__main__":
    sys.exit(main())
