"""What an input pipeline produces, shared by the DALI and tf.data pipelines."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hvrep.errors import ConfigError

if TYPE_CHECKING:  # the module itself imports TensorFlow; `hvrep train` validates its config before that
    from hvrep.replica.context import InputContext

FORMATS = ("folder", "tfrecord")
BACKENDS = ("tfdata", "dali")
LAYOUTS = ("NHWC", "NCHW")
DTYPES = ("float32", "float16", "bfloat16")
ON_ERROR = ("raise", "skip")
# ImageNet's per-channel RGB statistics, on the 0-255 scale.
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
PAD_LABEL = -1
"""The label of an evaluation batch's padding rows, which never count."""


@dataclass(frozen=True)
class DataConfig:
    """One input pipeline's settings. Both backends apply exactly these.

    Attributes:
      data_dir: an ImageNet-style folder (``train/<class>/*.JPEG``,
        ``val/<class>/*.JPEG``) or a folder of TFRecord shards written by
        ``hvrep data prepare`` (``train-*-of-*``, ``validation-*-of-*``, ``idx/``).
      format: "folder" or "tfrecord".
      backend: "tfdata" or "dali".
      image_size: output side in pixels (224 for ResNet-50).
      resize_size: evaluation resizes the shorter side to this before the
        center crop (256 for 224).
      crop_scale: random-resized-crop area fraction range (Inception-style).
      crop_ratio: random-resized-crop aspect-ratio range.
      flip: random horizontal flip in training.
      mean, std: per-channel RGB normalisation, 0-255 scale.
      layout: "NHWC" or "NCHW".
      dtype: "float32", "float16" or "bfloat16" output.
      label_offset: subtracted from stored TFRecord labels (TF's ImageNet
        shards store 1..1000; ``hvrep data prepare`` writes the same).
      on_error: "raise" (a clear error naming the file) or "skip" (drop the
        sample and count it).
      seed: shuffling and augmentation seed (the same on every replica).
      shuffle_buffer: tf.data shuffle buffer (files or records).
      num_threads: DALI CPU threads.
      dali_device: "auto" (mixed on a GPU, cpu otherwise), "cpu" or "mixed".
    """

    data_dir: str
    format: str = "folder"
    backend: str = "tfdata"
    image_size: int = 224
    resize_size: int = 256
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    layout: str = "NHWC"
    dtype: str = "float32"
    label_offset: int = 1
    on_error: str = "raise"
    seed: int = 0
    shuffle_buffer: int = 10_000
    num_threads: int = 2
    dali_device: str = "auto"

    def __post_init__(self) -> None:
        for name, value, allowed in (("format", self.format, FORMATS), ("backend", self.backend, BACKENDS),
                                     ("layout", self.layout, LAYOUTS), ("dtype", self.dtype, DTYPES),
                                     ("on_error", self.on_error, ON_ERROR),
                                     ("dali_device", self.dali_device, ("auto", "cpu", "mixed"))):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}.")
        if self.image_size < 1 or self.resize_size < self.image_size:
            raise ConfigError(
                f"need 1 <= image_size <= resize_size, got image_size={self.image_size}, "
                f"resize_size={self.resize_size}."
            )
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ConfigError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale!r}.")
        lo, hi = self.crop_ratio
        if not 0 < lo <= hi:
            raise ConfigError(f"crop_ratio must satisfy 0 < low <= high, got {self.crop_ratio!r}.")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ConfigError(f"mean and std need 3 values each, std > 0; got {self.mean!r}, {self.std!r}.")


def renamed_batch(per_replica_batch_size: int | None, batch_size: int | None, function: str) -> int | None:
    """``per_replica_batch_size``, or the value given by its old name ``batch_size`` (with a DeprecationWarning)."""
    if batch_size is None:
        return per_replica_batch_size
    warnings.warn(f"hvrep.data.{function}(batch_size=...) is deprecated: it counts the batch per replica; pass "
                  f"per_replica_batch_size={batch_size!r} (the same value).", DeprecationWarning, stacklevel=3)
    if per_replica_batch_size is not None:
        raise ConfigError(f"hvrep.data.{function}: per_replica_batch_size={per_replica_batch_size!r} and batch_size="
                          f"{batch_size!r} are the same argument. Fix: pass per_replica_batch_size only.")
    return batch_size


def replica_batch(ctx: InputContext | None, per_replica_batch_size: int | None) -> tuple[InputContext, int]:
    """This replica's place (one replica when ``ctx`` is None) and its batch size, checked.

    The batch is ``ctx.per_replica_batch_size``, else ``per_replica_batch_size``.
    """
    from hvrep.replica.context import InputContext

    ctx = ctx or InputContext(0, 1, None)
    b = ctx.per_replica_batch_size or per_replica_batch_size
    if not b or b < 1:
        raise ConfigError("a per-replica batch size is needed: pass per_replica_batch_size= or a ctx with one.")
    if not 0 <= ctx.replica_id < ctx.num_replicas:
        raise ConfigError(f"replica_id must be in [0, {ctx.num_replicas}), got {ctx.replica_id}.")
    return ctx, b
