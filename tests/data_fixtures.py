"""Small JPEG data sets for the data tests.

``write_id_folder`` makes solid-colour images whose colour encodes a sample id:
a solid colour survives random-resized-crop, resize, flip and JPEG almost
unchanged, so a test can tell which sample every output row came from and
check "every sample exactly once" after real augmentation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

STEP = 16  # colour levels per channel: ids 0..15**3


def id_colour(i: int) -> tuple[int, int, int]:
    return (8 + STEP * (i % 15), 8 + STEP * (i // 15 % 15), 8 + STEP * (i // 225 % 15))


def colour_id(rgb: np.ndarray) -> int:
    """Inverse of ``id_colour`` for a (possibly slightly off) mean pixel value."""
    levels = np.clip(np.round((np.asarray(rgb, np.float64) - 8) / STEP), 0, 14).astype(int)
    return int(levels[0] + 15 * levels[1] + 225 * levels[2])


def write_id_folder(root: Path, counts: dict[str, int], classes: int = 4, size: int = 40) -> dict[str, dict]:
    """Writes ``root/{split}/c{k}/img_{id}.JPEG``; returns {split: {id: label}}. Ids are unique across splits."""
    from PIL import Image

    truth: dict[str, dict] = {}
    next_id = 0
    for split, n in counts.items():
        truth[split] = {}
        for _ in range(n):
            label = next_id % classes
            out = root / split / f"c{label}" / f"img_{next_id:05d}.JPEG"
            out.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (size, size + 8), id_colour(next_id)).save(out, format="JPEG", quality=100)
            truth[split][next_id] = label
            next_id += 1
    return truth


def ids_of(images: np.ndarray, labels: np.ndarray, mean, std, layout: str = "NHWC") -> list[tuple[int, int]]:
    """(sample id, label) of every non-padding row of a normalised batch."""
    images = np.asarray(images, np.float32)
    if layout == "NCHW":
        images = images.transpose(0, 2, 3, 1)
    rgb = images.mean(axis=(1, 2)) * np.asarray(std) + np.asarray(mean)
    return [(colour_id(c), int(y)) for c, y in zip(rgb, labels, strict=True) if y >= 0]
