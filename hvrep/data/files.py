"""Finding a data set's files: the ImageNet folder layout and TFRecord shards with DALI indexes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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
    """A split's TFRecord shards, their DALI index files and record counts, in shard order."""

    shards: tuple[str, ...]
    indexes: tuple[str, ...]
    counts: tuple[int, ...]


def list_shards(root: str | Path, split: str) -> ShardListing:
    """The TFRecord shards of a split, their DALI index files and record counts (read once, from the indexes).

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
    if missing:
        raise DataError(
            f"DALI index files are missing: {', '.join(missing[:5])}. Fix: run `hvrep data prepare SRC {root}` "
            "again; it rewrites the index of every shard."
        )
    counts = tuple(check_index(shard, idx) for shard, idx in zip(expected, index, strict=True))
    return ShardListing(tuple(map(str, expected)), tuple(map(str, index)), counts)


def check_index(shard: Path, index: Path) -> int:
    """Checks that a DALI index describes its shard (the last record ends at the file's end).

    Returns:
      The number of records.

    Raises:
      hvrep.errors.DataError: a truncated shard or a stale/foreign index, naming both files.
    """
    lines = index.read_text().split()
    size = shard.stat().st_size
    if not lines:
        end, count = 0, 0
    else:
        if len(lines) % 2:
            raise DataError(f"index {index} is malformed (odd number of fields). Fix: rerun `hvrep data prepare`.")
        end, count = int(lines[-2]) + int(lines[-1]), len(lines) // 2
    if end != size:
        what = "truncated" if size < end else "longer than its index says"
        raise DataError(
            f"shard {shard} ({size} bytes) does not match its index {index} (records end at byte {end}): the "
            f"shard is {what} or the index belongs to another shard. Fix: delete both and rerun "
            "`hvrep data prepare SRC DST` (it rewrites missing shards)."
        )
    return count
