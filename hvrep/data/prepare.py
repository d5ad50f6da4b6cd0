"""``hvrep data prepare SRC DST``: an ImageNet-style JPEG folder to TFRecord shards + DALI indexes.

Shards follow TensorFlow's ImageNet converter: ``train-00000-of-01024``,
``validation-00000-of-00128``, each record an ``Example`` with
``image/encoded`` (the JPEG bytes, unchanged), ``image/class/label`` (1-based,
as TF's and MLPerf's shards), ``image/class/synset``, ``image/filename``.
Files are shuffled once with a fixed seed so every shard mixes classes.

DALI's TFRecord reader needs an index per shard (``offset size`` per record);
it is written alongside, in ``DST/idx/<shard>.idx``, from the offsets of the
records as they are written (an uncompressed TFRecord record is 8 bytes of
length, 4 of CRC, the data, 4 of CRC).

Resuming: a shard and its index are written under temporary names and
renamed when complete, so a shard that exists is whole; a second run skips
them. ``DST/hvrep-manifest.json`` records what the shards hold; a run whose
source or settings differ from the manifest stops instead of mixing data sets.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from hvrep.data.files import list_folder, shard_name, staging_path
from hvrep.errors import DataError

MANIFEST = "hvrep-manifest.json"


@dataclass(frozen=True)
class PrepareResult:
    """What a prepare run did, per split: images written, images skipped (bad), shards written / reused."""

    written: dict[str, int]
    skipped: dict[str, list[str]]
    shards_written: int
    shards_reused: int


def check_jpeg(path: str, data: bytes) -> str | None:
    """Why ``data`` is not a usable JPEG, or None. Decodes at 1/8 scale (fast) to catch truncation."""
    import io

    from PIL import Image

    if data[:2] != b"\xff\xd8":
        return "not a JPEG (no start-of-image marker)"
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG":
                return f"not a JPEG ({im.format})"
            im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except (OSError, SyntaxError, ValueError) as e:
        return f"cannot be decoded ({e})"
    return None


def _example(data: bytes, label: int, synset: str, filename: str) -> bytes:
    import tensorflow as tf

    def b(v: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    feature = {
        "image/encoded": b(data),
        "image/format": b(b"JPEG"),
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label + 1])),
        "image/class/synset": b(synset.encode()),
        "image/filename": b(os.path.basename(filename).encode()),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _default_shards(n: int, cap: int) -> int:
    return max(1, min(cap, math.ceil(n / 1000)))


def prepare(src: str | Path, dst: str | Path, train_shards: int | None = None, val_shards: int | None = None,
            on_error: str = "raise", seed: int = 0, progress: bool = True) -> PrepareResult:
    """Converts ``src`` (``train/``, ``val/`` class folders) into TFRecord shards in ``dst``.

    Args:
      train_shards: training shard count; default one per ~1,000 images, at
        most 1,024 (TF's ImageNet layout).
      val_shards: validation shard count; default one per ~1,000 images, at
        most 128.
      on_error: "raise" stops at the first bad JPEG, naming it; "skip" leaves
        it out and lists it in the result and the manifest.

    Raises:
      hvrep.errors.DataError: bad source layout, a bad JPEG (on_error="raise"),
        or a destination prepared from another source or with other settings.
    """
    from tqdm import tqdm

    if on_error not in ("raise", "skip"):
        raise DataError(f"on_error must be 'raise' or 'skip', got {on_error!r}.")
    src, dst = Path(src), Path(dst)
    (dst / "idx").mkdir(parents=True, exist_ok=True)
    listings = {split: list_folder(src, split) for split in ("train", "val")}
    if listings["train"].classes != listings["val"].classes:
        raise DataError(
            f"train/ and val/ in {src} have different class folders "
            f"({len(listings['train'].classes)} vs {len(listings['val'].classes)}). Fix: the same classes in both."
        )
    counts = {"train": train_shards or _default_shards(len(listings["train"].files), 1024),
              "val": val_shards or _default_shards(len(listings["val"].files), 128)}
    fingerprint = hashlib.sha256("\n".join(
        f"{f}|{os.path.getsize(f)}" for split in ("train", "val") for f in listings[split].files).encode()
    ).hexdigest()
    settings = {"source": str(src.resolve()), "fingerprint": fingerprint, "shards": counts, "seed": seed,
                "classes": list(listings["train"].classes), "on_error": on_error}
    manifest_path = dst / MANIFEST
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        differ = [f"{k}: {old.get(k)!r} then, {v!r} now" for k, v in settings.items()
                  if old.get(k) != v and k != "classes"] or (["classes"] if old.get("classes") != settings["classes"]
                                                             else [])
        if differ:
            raise DataError(
                f"{dst} was prepared from another source or with other settings ({'; '.join(differ)[:300]}). "
                "Fix: use the same settings to resume, an empty destination, or delete it to start over."
            )
    written: dict[str, int] = {}
    skipped: dict[str, list[str]] = {}
    shards_written = shards_reused = 0
    for split, listing in listings.items():
        order = list(range(len(listing.files)))
        random.Random(seed).shuffle(order)
        n = counts[split]
        written[split], skipped[split] = 0, []
        per_shard = []
        bar = tqdm(total=len(order), desc=f"{split} shards", unit="img", disable=not progress, file=sys.stderr)
        for i in range(n):
            part = order[i * len(order) // n:(i + 1) * len(order) // n]
            name = shard_name(split, i, n)
            shard, index = dst / name, dst / "idx" / f"{name}.idx"
            if shard.is_file() and index.is_file():  # complete from an earlier run
                shards_reused += 1
                per_shard.append(sum(1 for _ in index.open()))
                written[split] += per_shard[-1]
                bar.update(len(part))
                continue
            records = []
            for j in part:
                path = listing.files[j]
                data = Path(path).read_bytes()
                problem = check_jpeg(path, data)
                if problem:
                    if on_error == "raise":
                        raise DataError(f"{path}: {problem}. Fix: replace or delete the file, or pass "
                                        "--on-error skip to leave it out (it is then listed in the manifest).")
                    skipped[split].append(path)
                    bar.update(1)
                    continue
                records.append(_example(data, listing.labels[j], listing.classes[listing.labels[j]], path))
                bar.update(1)
            _write_shard(shard, index, records)
            shards_written += 1
            per_shard.append(len(records))
            written[split] += len(records)
        bar.close()
        settings.setdefault("records_per_shard", {})[split] = per_shard  # type: ignore[index]
    staged = staging_path(manifest_path)
    staged.write_text(json.dumps({**settings, "written": written, "skipped": skipped}, indent=1))
    os.replace(staged, manifest_path)
    return PrepareResult(written, skipped, shards_written, shards_reused)


def _write_shard(shard: Path, index: Path, records: list[bytes]) -> None:
    import tensorflow as tf

    tmp_shard, tmp_index = staging_path(shard), staging_path(index)
    offset, lines = 0, []
    with tf.io.TFRecordWriter(str(tmp_shard)) as writer:
        for rec in records:
            writer.write(rec)
            size = len(rec) + 16  # length (8) + its CRC (4) + data + data CRC (4)
            lines.append(f"{offset} {size}\n")
            offset += size
    if os.path.getsize(tmp_shard) != offset:
        raise DataError(f"{tmp_shard}: wrote {os.path.getsize(tmp_shard)} bytes, expected {offset}; disk full?")
    tmp_index.write_text("".join(lines))
    os.replace(tmp_index, index)
    os.replace(tmp_shard, shard)  # last: a shard that exists is complete
