"""``hvrep data demo DST``: the embedded demo data set, written as ImageNet would be.

scikit-learn ships 1,797 real 8×8 handwritten digits (10 classes); they are
upscaled to ``size`` pixels, saved as RGB JPEGs in ``DST/folder/{train,val}/
digit_<d>/`` and converted to TFRecord shards in ``DST/tfrecord/`` by the same
code as ImageNet, so the demo and the tests exercise the real readers and
decoders. Every 5th digit goes to validation (360 images), the rest to
training (1,437). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from hvrep.data.files import staging_path
from hvrep.data.prepare import PrepareResult, prepare

TRAIN_IMAGES, VAL_IMAGES = 1437, 360


def write_demo(dst: str | Path, size: int = 32, train_shards: int = 4, val_shards: int = 2,
               progress: bool = False) -> PrepareResult:
    """Writes the demo data set (idempotent: a complete earlier run is reused)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    dst = Path(dst)
    folder = dst / "folder"
    done = dst / "folder.done"
    if not done.is_file():
        digits = load_digits()
        for i, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
            split = "val" if i % 5 == 0 else "train"
            out = folder / split / f"digit_{label}" / f"digit_{i:05d}.JPEG"
            out.parent.mkdir(parents=True, exist_ok=True)
            gray = (image * (255.0 / 16.0)).astype(np.uint8)
            rgb = Image.fromarray(gray, "L").resize((size, size), Image.BILINEAR).convert("RGB")
            staged = staging_path(out)
            rgb.save(staged, format="JPEG", quality=95)
            staged.replace(out)
        staged = staging_path(done)
        staged.write_text(json.dumps({"images": len(digits.images), "size": size}))
        staged.replace(done)
    return prepare(folder, dst / "tfrecord", train_shards=train_shards, val_shards=val_shards, progress=progress)
