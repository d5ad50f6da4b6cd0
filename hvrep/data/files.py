"""Finding a data set's files: the ImageNet folder layout and TFRecord shards with DALI indexes."""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hvrep.errors import DataError

JPEG_SUFFIXES = (".jpeg", ".jpg")
SPLIT_DIRS = {"train": ("train",), "val": ("val", "validation")}
SHARD_PREFIX = {"train": "train", "val": "validation"}
_SHARD_RE = re.compile(r"^(?P<prefix>train|validation)-(?P<i>\d{5})-of-(?P<n>\d{5})$")


@dataclass(frozen=True)
class FolderListing:
    """The images of one split, sorted by class then name. Labels index ``classes``."""

    files: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]


def staging_path(path: Path) -> Path:
    """A name of its own next to ``path``, to write into and then ``os.replace`` onto ``path``.

    Unique per writer, so writers racing for the same output (two jobs filling one cache, a data set prepared
    from two nodes of a shared file system) each move a complete file into place.
    """
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def split_dir(root: str | Path, split: str) -> Path:
    if split not in SPLIT_DIRS:
        raise DataError(f"split must be 'train' or 'val', got {split!r}.")
    root = Path(root)
    for name in SPLIT_DIRS[split]:
        if (root / name).is_dir():
            return root / name
    raise DataError(
        f"{root} has no {' or '.join(SPLIT_DIRS[split])}/ folder. Fix: point data_dir at the folder that holds "
        "train/<class>/*.JPEG and val/<class>/*.JPEG."
    )


def list_folder(root: str | Path, split: str) -> FolderListing:
    """Lists ``root/<split>/<class>/*.JPEG``; classes are the sorted folder names.

    Raises:
      hvrep.errors.DataError: no split folder, no class folders, or a class
        folder without JPEGs (each named, with the fix).
    """
    base = split_dir(root, split)
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{base} holds no class folders. Fix: one folder per class, e.g. {base}/n01440764/*.JPEG.")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        found = sorted(p for p in (base / name).iterdir() if p.suffix.lower() in JPEG_SUFFIXES and p.is_file())
        if not found:
            raise DataError(
                f"class folder {base / name} holds no .JPEG/.jpg files. Fix: add its images or remove the folder "
                "(every class folder becomes a label)."
            )
        files += [str(p) for p in found]
        labels += [label] * len(found)
    return FolderListing(tuple(files), tuple(labels), tuple(classes))


def shard_name(split: str, index: int, count: int) -> str:
    return f"{SHARD_PREFIX[split]}-{index:05d}-of-{count:05d}"


@dataclass(frozen=True)
class ShardListing:
    """A split's TFRecord shards, their DALI index files and record counts, in shard order.

    An index is "" for a shard that has none (listed with ``require_index=False``: tf.data reads such a
    shard sequentially)."""

    shards: tuple[str, ...]
    indexes: tuple[str, ...]
    counts: tuple[int, ...]
    # Each shard's index entries, (records, 2) int64 [offset, size], as read for the listing (None: no index).
    entries: tuple[np.ndarray | None, ...] = field(default=(), compare=False, repr=False)


def list_shards(root: str | Path, split: str, require_index: bool = True) -> ShardListing:
    """The TFRecord shards of a split, their DALI index files and record counts (read once, from the indexes).

    Args:
      require_index: a shard without an index is an error (DALI's reader
        needs them); False: it is listed with index "" and its records are
        counted by reading it (tf.data, which then reads it whole).

    Raises:
      hvrep.errors.DataError: no shards, a missing shard in the numbering, or
        a missing index file, each named.
    """
    root = Path(root)
    prefix = SHARD_PREFIX[split]
    found = sorted(p for p in root.iterdir() if p.is_file() and _SHARD_RE.match(p.name)
                   and p.name.startswith(prefix + "-"))
    if not found:
        raise DataError(
            f"{root} has no {prefix}-NNNNN-of-NNNNN TFRecord shards. Fix: run `hvrep data prepare SRC {root}`."
        )
    count = int(_SHARD_RE.match(found[0].name)["n"])  # type: ignore[index]
    expected = [root / shard_name(split, i, count) for i in range(count)]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} of {count} {prefix} shards are missing in {root}: {', '.join(missing[:5])}. "
            f"Fix: run `hvrep data prepare SRC {root}` again (it resumes)."
        )
    index = [root / "idx" / f"{p.name}.idx" for p in expected]
    missing = [str(p) for p in index if not p.is_file()]
    if missing and require_index:
        raise DataError(
            f"DALI index files are missing: {', '.join(missing[:5])}. Fix: run `hvrep data prepare SRC {root}` "
            "again; it rewrites the index of every shard."
        )
    entries = tuple(_checked_entries(shard, idx) if idx.is_file() else None
                    for shard, idx in zip(expected, index, strict=True))
    counts = tuple(len(e) if e is not None else _count_records(shard) for shard, e in zip(expected, entries,
                                                                                        strict=True))
    return ShardListing(tuple(map(str, expected)), tuple(str(p) if p.is_file() else "" for p in index), counts,
                        entries)


def _count_records(shard: Path) -> int:
    """The records of a shard without an index: read through once."""
    import tensorflow as tf

    return int(tf.data.TFRecordDataset(str(shard)).reduce(np.int64(0), lambda n, _: n + 1))


def index_entries(index: str | Path) -> np.ndarray:
    """A DALI index's ``offset size`` lines as an (records, 2) int64 array (a record's bytes, framing included)."""
    return np.asarray(Path(index).read_text().split(), dtype=np.int64).reshape(-1, 2)


def read_records(paths: Sequence[str], which: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The serialized records at ``offsets`` (of ``sizes`` bytes, framing included, as an index gives them) in
    ``paths[which]``, in the order given, each read by its byte offset: nothing else of the files is read.

    The reads go in file and offset order (sequential on disk where the records are), and each record's length
    field is checked against the index.

    Returns:
      An object array of ``bytes`` (the records' data, without the 12-byte header and 4-byte CRC).

    Raises:
      hvrep.errors.DataError: a record is shorter than its index says, or its length field differs (a stale
        index), naming the file and offset.
    """
    out = np.empty(len(offsets), dtype=object)
    fds: dict[int, int] = {}
    try:
        for j in np.lexsort((offsets, which)):
            k = int(which[j])
            if k not in fds:
                fds[k] = os.open(paths[k], os.O_RDONLY)
            offset, size = int(offsets[j]), int(sizes[j])
            data = os.pread(fds[k], size, offset)
            if len(data) != size or int.from_bytes(data[:8], "little") != size - 16:
                raise DataError(
                    f"{paths[k]}: the record at byte {offset} does not match its index entry ({size} bytes): the "
                    "index is stale or belongs to another shard. Fix: delete the shard and its index and rerun "
                    "`hvrep data prepare SRC DST`.")
            out[j] = data[12:-4]
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def check_index(shard: Path, index: Path) -> int:
    """Checks that a DALI index describes its shard (the last record ends at the file's end).

    Returns:
      The number of records.

    Raises:
      hvrep.errors.DataError: a truncated shard or a stale/foreign index, naming both files.
    """
    return len(_checked_entries(shard, index))


def _checked_entries(shard: Path, index: Path) -> np.ndarray:
    """:func:`check_index`'s check; returns the index's entries."""
    lines = index.read_text().split()
    size = shard.stat().st_size
    if len(lines) % 2:
        raise DataError(f"index {index} is malformed (odd number of fields). Fix: rerun `hvrep data prepare`.")
    entries = np.asarray(lines, dtype=np.int64).reshape(-1, 2)
    end = int(entries[-1].sum()) if len(entries) else 0
    if end != size:
        what = "truncated" if size < end else "longer than its index says"
        raise DataError(
            f"shard {shard} ({size} bytes) does not match its index {index} (records end at byte {end}): the "
            f"shard is {what} or the index belongs to another shard. Fix: delete both and rerun "
            "`hvrep data prepare SRC DST` (it rewrites missing shards)."
        )
    return entries
