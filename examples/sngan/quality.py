"""Sample quality for class-conditional generators of the digits: a Fréchet distance and a class accuracy.

Both are measured with one digits classifier (a small CNN), trained once on the training split and cached
under hvrep's cache directory, keyed by everything that built it (this module's source, the data set's
files, TensorFlow's and Keras' versions): another data set or a changed recipe trains a new one.

- Fréchet distance (the FID recipe, with this classifier's penultimate layer as the feature space):
  ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)), against the features of the real training images.
- Class accuracy: the classifier's accuracy on images generated for each requested class.

Each figure is computed for the same number of images (the validation split's size, default) from three
sources: real held-out images (the floor a perfect generator would reach), a "generator" that outputs each
class's mean training image (a baseline any useful GAN must beat on the Fréchet distance), and the GAN.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import scipy.linalg
import tensorflow as tf

from hvrep import _env
from hvrep.data import DataConfig, make_dataset
from hvrep.errors import DataError

_EPOCHS = 15
_BATCH = 64
_SEED = 0


def _classifier() -> keras.Model:
    """32x32x3 in [-1, 1] -> 10 logits; its layer "features" (64) is the Fréchet feature space."""
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dropout(0.3),
        keras.layers.Dense(64, activation="relu", name="features"),
        keras.layers.Dense(10, name="logits"),
    ], name="digits_classifier")


def images(data: DataConfig, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A split's images (N, 32, 32, 3) as the GAN sees them, and labels (N,), in listing order."""
    xs, ys = [], []
    for x, y in make_dataset(data, split, per_replica_batch_size=256, training=False):
        keep = y.numpy() >= 0  # evaluation pads the last batch with label -1
        xs.append(x.numpy()[keep])
        ys.append(y.numpy()[keep])
    return np.concatenate(xs), np.concatenate(ys)


def cache_key(data: DataConfig) -> str:
    """What built the classifier: this module's source, the data files (names, sizes), the pipeline's
    settings and the framework versions."""
    root = Path(data.data_dir)
    files = sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())
    what = {"source": inspect.getsource(_classifier) + inspect.getsource(_train), "files": files,
            "data": dataclasses.asdict(dataclasses.replace(data, data_dir="")),
            "tensorflow": tf.__version__, "keras": keras.__version__}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _train(data: DataConfig) -> keras.Model:
    keras.utils.set_random_seed(_SEED)
    x, y = images(data, "train")
    model = _classifier()
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=_BATCH, epochs=_EPOCHS, shuffle=True, verbose=0)
    return model


def classifier(data: DataConfig, say: Callable[[str], None] = print) -> tuple[keras.Model, Path]:
    """The cached classifier for ``data`` (trained now, ~30 s on one core, if the cache has none) and its file."""
    path = _env.cache_dir() / "sngan-classifier" / cache_key(data) / "classifier.keras"
    if not path.is_file():
        say(f"sngan: training the digits classifier for the quality figures (once; cached in {path.parent})")
        model = _train(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".keras", dir=path.parent)
        os.close(fd)
        model.save(tmp)
        os.replace(tmp, path)  # atomic: a reader sees a complete file or none
    return keras.models.load_model(path, compile=False), path


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to feature sets ``a`` (N, F) and ``b`` (M, F)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    with warnings.catch_warnings():  # a set of few distinct images (the class means) has a singular covariance
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        root, _ = scipy.linalg.sqrtm(s_a @ s_b, disp=False)
    root = root.real  # rounding leaves a tiny imaginary part
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(s_a + s_b - 2.0 * root))


class Judge:
    """Scores sets of images against the real training images, with the cached classifier.

    Args:
      data: the GAN's data configuration (images in [-1, 1]).
      per_class: images per class of each scored set (default: as many as the validation split's rarest
        class has, so every set is the same size as the held-out one).
    """

    def __init__(self, data: DataConfig, per_class: int | None = None,
                 say: Callable[[str], None] = print) -> None:
        self.model, self.path = classifier(data, say)
        self._features = keras.Model(self.model.inputs[0], [self.model.get_layer("features").output,
                                                         self.model.outputs[0]])
        train_x, train_y = images(data, "train")
        self.num_classes = int(train_y.max()) + 1
        self.real_features, _ = self._predict(train_x)
        self.class_means = np.stack([train_x[train_y == c].mean(0) for c in range(self.num_classes)])
        val_x, val_y = images(data, "val")
        fewest = int(np.bincount(val_y, minlength=self.num_classes).min())
        self.per_class = per_class or fewest
        if self.per_class > fewest:
            raise DataError(f"per_class={self.per_class} is more than the validation split holds of some class "
                            f"({fewest}). Fix: per_class <= {fewest}.")
        pick = np.concatenate([np.flatnonzero(val_y == c)[:self.per_class] for c in range(self.num_classes)])
        self.held_out = (val_x[pick], val_y[pick])

    def requested_labels(self) -> np.ndarray:
        """The classes a scored set holds: ``per_class`` of each, in class order."""
        return np.repeat(np.arange(self.num_classes, dtype=np.int32), self.per_class)

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feats, logits = [], []
        for i in range(0, len(x), 256):
            f, lg = self._features(x[i:i + 256], training=False)
            feats.append(np.asarray(f, np.float64))
            logits.append(np.asarray(lg))
        return np.concatenate(feats), np.concatenate(logits)

    def score(self, x: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
        """{"fid", "class_accuracy", "per_class_accuracy": [one per class]} of images ``x`` requested as ``labels``."""
        feats, logits = self._predict(np.asarray(x, np.float32))
        hit = logits.argmax(-1) == labels
        per_class = [float(hit[labels == c].mean()) for c in range(self.num_classes)]
        return {"fid": frechet_distance(feats, self.real_features), "class_accuracy": float(hit.mean()),
                "per_class_accuracy": per_class}

    def references(self) -> dict[str, dict[str, Any]]:
        """The real held-out images' figures and the class-mean baseline's, on as many images as a GAN's set."""
        labels = self.requested_labels()
        return {"held_out": self.score(*self.held_out), "class_mean": self.score(self.class_means[labels], labels)}


def grid(x: np.ndarray, rows: int) -> np.ndarray:
    """Images (rows * cols, H, W, 3) in [-1, 1] -> one uint8 picture (rows * H, cols * W, 3), row by row."""
    n, h, w, c = x.shape
    cols = n // rows
    pixels = np.clip((x[:rows * cols] + 1.0) * 127.5, 0, 255).astype(np.uint8)
    return pixels.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)
