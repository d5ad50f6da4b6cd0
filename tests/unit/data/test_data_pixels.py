"""The tf.data pipeline's pixels, bit for bit, against the documented steps written out one TF op at a time.

The pipeline is free to fuse, reorder and vectorise (``hvrep.data.tfdata`` does,
for speed: see ``benchmarks/input_pipeline.py``) but not to change a value: a
textured image (not a solid colour, which any crop or flip leaves unchanged)
must come out exactly as the reference makes it:

- training, sample id ``i`` of the epoch plan, epoch seed ``s``: the window of
  ``tf.image.stateless_sample_distorted_bounding_box`` seeded ``(s, i)``, decoded
  with ``decode_and_crop_jpeg``, bilinear ``tf.image.resize`` to ``image_size``,
  flipped by ``stateless_random_flip_left_right`` seeded ``(s, i + 1)``, then
  ``x * (1 / std) + (-mean / std)`` in float32;
- evaluation: shorter side to ``resize_size`` (rounded), bilinear, center crop,
  the same normalisation.

A second reference in float64 NumPy checks that these TF steps are what the
docstrings say (crop inside the image, resize with half-pixel centres).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvrep.data import DataConfig, make_dataset, prepare
from hvrep.data.files import list_folder, list_shards
from hvrep.data.tfdata import tfdata_plan

SIZES = [(61, 47), (40, 90), (120, 100), (33, 33), (200, 64)]  # (width, height): up- and downscaled crops


@pytest.fixture(scope="module")
def textured(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("textured")
    rng = np.random.default_rng(5)
    for split, n in (("train", 24), ("val", 7)):
        for k in range(n):
            w, h = SIZES[k % len(SIZES)]
            # Smooth gradients plus noise: every crop, resize and flip shows in the pixels.
            yy, xx = np.mgrid[0:h, 0:w]
            base = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (w + h)], -1)
            pixels = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            out = root / "folder" / split / f"c{k % 2}" / f"{split}_{k:03d}.JPEG"
            out.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    prepare(root / "folder", root / "tfrecord", train_shards=2, val_shards=1, progress=False)
    return root


def _config(root, fmt: str, **kw) -> DataConfig:
    return DataConfig(str(root / fmt), format=fmt, **{"image_size": 24, "resize_size": 28, "seed": 11, **kw})


def _finish(image: tf.Tensor, config: DataConfig) -> np.ndarray:
    scale = tf.constant([1.0 / s for s in config.std], tf.float32)
    shift = tf.constant([-m / s for m, s in zip(config.mean, config.std, strict=True)], tf.float32)
    return (tf.cast(image, tf.float32) * scale + shift).numpy()


def _reference_train(data: bytes, i: int, config: DataConfig) -> np.ndarray:
    seed = tf.constant([config.seed, i], tf.int64)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.io.extract_jpeg_shape(data), bounding_boxes=tf.zeros([1, 0, 4]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=config.crop_ratio, area_range=config.crop_scale, max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    image = tf.io.decode_and_crop_jpeg(data, tf.stack([begin[0], begin[1], size[0], size[1]]), channels=3)
    image = tf.image.resize(image, [config.image_size, config.image_size], method="bilinear")
    if config.flip:
        image = tf.image.stateless_random_flip_left_right(image, seed=seed + 1)
    return _finish(image, config)


def _reference_eval(data: bytes, config: DataConfig) -> np.ndarray:
    image = tf.io.decode_jpeg(data, channels=3)
    h, w = image.shape[:2]
    scale = config.resize_size / min(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    image = tf.image.resize(image, [new_h, new_w], method="bilinear")
    top, left = (new_h - config.image_size) // 2, (new_w - config.image_size) // 2
    return _finish(image[top:top + config.image_size, left:left + config.image_size], config)


def _encoded(root, fmt: str, split: str) -> list[bytes]:
    """The JPEG bytes of every sample, in the plan's numbering (listing order)."""
    if fmt == "folder":
        return [open(f, "rb").read() for f in list_folder(root / "folder", split).files]
    out = []
    for record in tf.data.TFRecordDataset(list(list_shards(root / "tfrecord", split).shards)):
        example = tf.train.Example.FromString(record.numpy())
        out.append(example.features.feature["image/encoded"].bytes_list.value[0])
    return out


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
def test_training_pixels_are_the_documented_steps_exactly(textured, fmt):
    config = _config(textured, fmt)
    b = 4
    ids = tfdata_plan(config).share(0, 1, b).ids
    encoded = _encoded(textured, fmt, "train")
    got = np.concatenate([x.numpy() for x, _ in make_dataset(config, "train", batch_size=b)])
    assert got.shape == (len(ids) // b * b, 24, 24, 3) and got.dtype == np.float32
    unflipped = _config(textured, fmt, flip=False)
    flips = 0
    for row, i in zip(got, ids, strict=False):
        want = _reference_train(encoded[i], int(i), config)
        np.testing.assert_array_equal(row, want, err_msg=f"sample {i}")
        flips += not np.array_equal(row, _reference_train(encoded[i], int(i), unflipped))
    assert 0 < flips < len(got)  # both sides of the coin were exercised


@pytest.mark.parametrize("fmt", ["folder", "tfrecord"])
def test_evaluation_pixels_are_the_documented_steps_exactly(textured, fmt):
    config = _config(textured, fmt)
    encoded = _encoded(textured, fmt, "val")
    x, y = zip(*[(x.numpy(), y.numpy()) for x, y in make_dataset(config, "val", batch_size=4)], strict=True)
    x, y = np.concatenate(x), np.concatenate(y)
    real = y >= 0
    assert real.sum() == len(encoded)
    for row, data in zip(x[real], encoded, strict=True):
        np.testing.assert_array_equal(row, _reference_eval(data, config))
    # Padding rows: a zero image, normalised.
    np.testing.assert_array_equal(x[~real], np.broadcast_to(_finish(tf.zeros([24, 24, 3]), config), x[~real].shape))


@pytest.mark.parametrize(("layout", "dtype"), [("NCHW", "float16"), ("NHWC", "bfloat16")])
def test_layout_and_dtype_only_transpose_and_cast(textured, layout, dtype):
    base = _config(textured, "folder")
    config = _config(textured, "folder", layout=layout, dtype=dtype)
    for split in ("train", "val"):
        want = np.concatenate([x.numpy() for x, _ in make_dataset(base, split, batch_size=4)])
        got = np.concatenate([tf.cast(x, tf.float32).numpy() for x, _ in make_dataset(config, split, batch_size=4)])
        want = tf.cast(tf.cast(want, tf.as_dtype(dtype)), tf.float32).numpy()
        np.testing.assert_array_equal(got, want.transpose(0, 3, 1, 2) if layout == "NCHW" else want)


def _bilinear(image: np.ndarray, h: int, w: int) -> np.ndarray:
    """Half-pixel-centre bilinear resize without antialiasing, float64."""
    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        x = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, None)
        lo = np.minimum(np.floor(x).astype(int), n_in - 1)
        return lo, np.minimum(lo + 1, n_in - 1), x - lo

    y0, y1, fy = axis(image.shape[0], h)
    x0, x1, fx = axis(image.shape[1], w)
    img = image.astype(np.float64)
    top = img[y0][:, x0] + (img[y0][:, x1] - img[y0][:, x0]) * fx[None, :, None]
    bottom = img[y1][:, x0] + (img[y1][:, x1] - img[y1][:, x0]) * fx[None, :, None]
    return top + (bottom - top) * fy[:, None, None]


def test_training_reference_is_a_crop_of_the_image_resized_bilinear(textured):
    """The TF steps above, checked in float64: a window of the image, half-pixel bilinear."""
    config = _config(textured, "folder", flip=False)
    for i, data in enumerate(_encoded(textured, "folder", "train")[:len(SIZES)]):
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.io.extract_jpeg_shape(data), bounding_boxes=tf.zeros([1, 0, 4]), seed=[config.seed, i],
            min_object_covered=0.0, aspect_ratio_range=config.crop_ratio, area_range=config.crop_scale,
            max_attempts=10, use_image_if_no_bounding_boxes=True)
        (top, left), (h, w) = begin.numpy()[:2], size.numpy()[:2]
        window = tf.io.decode_and_crop_jpeg(data, [top, left, h, w], channels=3).numpy()
        # libjpeg upsamples chroma at the window's edge from the window alone: a level or two off there.
        full = tf.io.decode_jpeg(data, channels=3).numpy()[top:top + h, left:left + w]
        assert np.abs(window.astype(int) - full).mean() < 1.0
        got = _reference_train(data, i, config) * np.asarray(config.std) + np.asarray(config.mean)
        np.testing.assert_allclose(got, _bilinear(window, 24, 24), atol=1e-3)
