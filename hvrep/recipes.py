"""Published large-batch recipes for ResNet-50 on ImageNet, picked by global batch size.

:func:`imagenet_resnet50` returns what published runs used at that batch size:

| global batch | optimizer | peak LR | warmup (epochs, from) | decay | epochs | momentum | weight decay | label smoothing | source |
|---|---|---|---|---|---|---|---|---|---|
| <= 8,192 | momentum SGD | 0.1 × batch / 256 | 5, from 0.1 (none at <= 256) | step ×0.1 at 30, 60, 80 | 90 | 0.9 | 1e-4 | 0 | Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2, §5.1 |
| 3,264 (anchor) | LARS η=0.001 | ≈ 11 | 2, from 0 | polynomial, power 2 | ≈ 37 | 0.9 | 5e-5 | 0.1 | MLPerf Training ResNet-50 LARS submissions (v0.7–v1.0), reference hyper-parameter names `lars_opt_*` |
| 40,960 | LARS η=0.001 | ≈ 19 | 24, from 0 | polynomial, power 2 | ≈ 72 | 0.9 | 5e-5 | 0.1 | MLPerf TPU-pod submissions (Kumar et al. 2019, "Scale MLPerf-0.6 models on Google TPU-v3 Pods") |
| 65,536 | LARS η=0.001 | ≈ 25 | 32, from 0 | polynomial, power 2 | ≈ 88 | 0.9 | 5e-5 | 0.1 | same |

Above 8,192, LARS settings are interpolated linearly in log2(batch) between the
rows (the 3,264 row anchors the low end). The LARS rows are approximate: they
summarise the cited submissions, whose exact values differ from run to run;
check the MLPerf results log of the submission you reproduce. Beyond 65,536 the
recipe warns and extrapolates the last two rows explicitly (``Recipe.extrapolated``).
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any

from hvrep import schedules
from hvrep.errors import ConfigError
from hvrep.optimizers import LARS, MomentumSGD

IMAGENET_TRAIN_IMAGES = 1_281_167
GOYAL_MAX_BATCH = 8192

# (global batch, peak LR, warmup epochs, epochs, momentum, weight decay): see the module table.
_LARS_ROWS = (
    (3264, 11.0, 2.0, 37, 0.9, 5e-5),
    (40960, 19.0, 24.0, 72, 0.9, 5e-5),
    (65536, 25.0, 32.0, 88, 0.9, 5e-5),
)


@dataclass(frozen=True)
class Recipe:
    """What to train ResNet-50 with at one global batch size.

    Attributes:
      optimizer: a Keras optimizer (``MomentumSGD`` or ``LARS``) driven by ``schedule``;
        create the recipe inside ``Replicator.scope()``.
      schedule: the learning-rate schedule, defined in epochs (``hvrep.schedules.EpochSchedule``: called
        with the optimizer's step; a training loop may anchor it to the samples trained).
      epochs: epochs to train.
      warmup_epochs: epochs of linear warmup.
      steps_per_epoch: ``hvrep.schedules.steps_per_epoch``: full global batches, as the data plan trains.
      peak_lr: the LR at the end of warmup.
      label_smoothing: for the cross-entropy loss.
      weight_decay: coupled L2 decay in the optimizer.
      exclude_bn_and_bias_from_weight_decay: whether batch-norm parameters and
        biases skip weight decay (and, for LARS, layer adaptation).
      source: where the numbers come from.
      extrapolated: True when the batch lies beyond the published range.
    """

    optimizer: Any
    schedule: schedules.EpochSchedule
    epochs: int
    warmup_epochs: float
    steps_per_epoch: int
    peak_lr: float
    label_smoothing: float
    weight_decay: float
    exclude_bn_and_bias_from_weight_decay: bool
    source: str
    extrapolated: bool = False


def _interpolate(global_batch: int) -> tuple[tuple[float, ...], bool]:
    x = math.log2(global_batch)
    rows = _LARS_ROWS
    if global_batch > rows[-1][0]:
        lo, hi, extrapolated = rows[-2], rows[-1], True
    else:
        lo, hi = next((a, b) for a, b in itertools.pairwise(rows) if global_batch <= b[0])
        extrapolated = False
    t = (x - math.log2(lo[0])) / (math.log2(hi[0]) - math.log2(lo[0]))
    values = tuple(a + (b - a) * t for a, b in zip(lo[1:], hi[1:], strict=True))
    return values, extrapolated


def imagenet_resnet50(
    global_batch: int,
    epochs: int | None = None,
    *,
    train_images: int = IMAGENET_TRAIN_IMAGES,
    label_smoothing: float | None = None,
    exclude_bn_and_bias_from_weight_decay: bool = True,
) -> Recipe:
    """The published recipe for ResNet-50 on ImageNet at ``global_batch`` (see the module table).

    Args:
      global_batch: images per optimizer step over all replicas.
      epochs: override the recipe's epoch count (the schedule stretches to it).
      train_images: training-set size (ImageNet-1k: 1,281,167).
      label_smoothing: override the recipe's (0 for Goyal, 0.1 for MLPerf).
      exclude_bn_and_bias_from_weight_decay: no decay (and no LARS adaptation)
        on batch-norm parameters and biases, as in both sources.

    Raises:
      hvrep.errors.ConfigError: a non-positive batch, epochs or image count, or
        warmup longer than the requested epochs.
    """
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive int, got {global_batch!r}.")
    if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
        raise ConfigError(f"epochs must be a positive int, got {epochs!r}.")
    if not isinstance(train_images, int) or train_images < 1:
        raise ConfigError(f"train_images must be a positive int, got {train_images!r}.")
    steps_per_epoch = schedules.steps_per_epoch(train_images, global_batch)
    in_epochs = {"samples_per_epoch": train_images, "samples_per_step": global_batch}
    exclude = None if exclude_bn_and_bias_from_weight_decay else []  # None: BN and biases (DEFAULT_EXCLUDE)

    if global_batch <= GOYAL_MAX_BATCH:
        peak = schedules.linear_scaling(0.1, global_batch, 256)
        n_epochs = epochs or 90
        warmup = 5.0 if global_batch > 256 else 0.0
        smoothing = 0.0 if label_smoothing is None else label_smoothing
        _check_warmup(warmup, n_epochs)
        schedule = schedules.epoch_schedule(
            "step", peak_lr=peak, epochs=n_epochs, boundaries=[e * n_epochs / 90 for e in (30, 60, 80)], factor=0.1,
            warmup_epochs=warmup, warmup_start_lr=min(0.1, peak), **in_epochs)
        optimizer = MomentumSGD(schedule, momentum=0.9, weight_decay=1e-4, exclude_from_weight_decay=exclude)
        return Recipe(optimizer, schedule, n_epochs, warmup, steps_per_epoch, peak, smoothing, 1e-4,
                      exclude_bn_and_bias_from_weight_decay,
                      "Goyal et al. 2017: linear scaling (0.1 per 256), 5-epoch gradual warmup, step decay")

    (peak, warmup, rec_epochs, momentum, wd), extrapolated = _interpolate(global_batch)
    if extrapolated:
        warnings.warn(
            f"global_batch={global_batch} is beyond the largest published LARS run (65,536); the recipe "
            "extrapolates the last two rows in log2(batch). Expect to tune it.", stacklevel=2)
    n_epochs = epochs or round(rec_epochs)
    _check_warmup(warmup, n_epochs)
    smoothing = 0.1 if label_smoothing is None else label_smoothing
    schedule = schedules.epoch_schedule("polynomial", peak_lr=peak, epochs=n_epochs, warmup_epochs=warmup,
                                        warmup_start_lr=0.0, end_lr=1e-4, power=2.0, **in_epochs)
    optimizer = LARS(schedule, momentum=momentum, weight_decay=wd, eta=0.001, epsilon=0.0,
                     exclude_from_weight_decay=exclude, exclude_from_layer_adaptation=exclude)
    return Recipe(optimizer, schedule, n_epochs, warmup, steps_per_epoch, peak, smoothing, wd,
                  exclude_bn_and_bias_from_weight_decay,
                  "MLPerf ResNet-50 LARS submissions (interpolated in log2(batch)); approximate, see hvrep.recipes",
                  extrapolated)


def _check_warmup(warmup_epochs: float, epochs: int) -> None:
    if warmup_epochs >= epochs:
        raise ConfigError(
            f"the recipe warms up for {warmup_epochs:g} epochs but epochs={epochs}: warmup longer than training. "
            "Fix: train for more epochs."
        )
