"""Learning-rate rules for large batches, as serialisable Keras ``LearningRateSchedule``s.

All arguments are in optimizer steps. Each schedule warms up linearly from
``warmup_start_lr`` (lr(0)) to ``peak_lr`` (lr(warmup_steps)), then decays:

    warmup:      lr(s) = start + (peak - start) * s / W                     for s < W
    polynomial:  lr(s) = end + (peak - end) * (1 - (s - W) / (T - W)) ** power   (MLPerf: power 2)
    cosine:      lr(s) = end + (peak - end) * (1 + cos(pi * (s - W) / (T - W))) / 2
    step:        lr(s) = peak * factor ** (number of boundaries <= s)     (Goyal: x0.1 at epochs 30, 60, 80)

with s clamped to T (``total_steps``) after the end. Goyal et al. (2017)
warm up from the base (unscaled) LR to the linearly scaled one; MLPerf warms
up from 0: set ``warmup_start_lr`` accordingly.

Schedules in epochs: :func:`epoch_schedule` defines warmup and decay in epochs
and returns an :class:`EpochSchedule`, whose position is the samples trained,
not the optimizer's step count. A run resumed with another global batch
(after a requeue onto fewer GPUs, say) then goes on from the epoch it had
reached: a step count means other samples at another batch, and a schedule
evaluated at the restored step would jump forward or back. ``hvrep train`` and
``hvrep.recipes`` use it; :func:`steps_per_epoch` is the one rule both use for
an epoch's steps.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hvrep.errors import ConfigError

__all__ = [
    "DECAYS",
    "ConstantWithWarmup",
    "CosineDecayWithWarmup",
    "EpochSchedule",
    "PolynomialDecayWithWarmup",
    "StepDecayWithWarmup",
    "epoch_schedule",
    "linear_scaling",
    "steps_per_epoch",
    "warmup_schedule",
]

DECAYS = ("polynomial", "cosine", "step", "constant")
"""The decay names ``warmup_schedule`` and ``epoch_schedule`` take."""


def steps_per_epoch(train_images: int, global_batch: int) -> int:
    """Optimizer steps in one epoch: full global batches only (``train_images // global_batch``).

    The rule of hvrep's data plan (an epoch drops its last, partial batch), shared by the training loops and
    the recipes.

    Raises:
      hvrep.errors.ConfigError: non-positive arguments, or fewer images than one global batch.
    """
    if not isinstance(train_images, int) or train_images < 1:
        raise ConfigError(f"train_images must be a positive int, got {train_images!r}.")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive int, got {global_batch!r}.")
    if train_images < global_batch:
        raise ConfigError(f"{train_images} training images cannot fill one global batch of {global_batch}. Fix: a "
                          f"global batch of at most {train_images}.")
    return train_images // global_batch


def linear_scaling(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): ``base_lr * global_batch / base_batch``."""
    if not base_lr > 0:
        raise ConfigError(f"base_lr must be > 0, got {base_lr!r}.")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch must be a positive int, got {global_batch!r}.")
    if not isinstance(base_batch, int) or base_batch < 1:
        raise ConfigError(f"base_batch must be a positive int, got {base_batch!r}.")
    return base_lr * global_batch / base_batch


class _Warmup(keras.optimizers.schedules.LearningRateSchedule, abc.ABC):
    """Linear warmup, then ``_decay``; subclasses define the decay."""

    def __init__(self, peak_lr: float, total_steps: int, warmup_steps: int = 0,
                 warmup_start_lr: float = 0.0) -> None:
        if not peak_lr > 0:
            raise ConfigError(f"peak_lr must be > 0, got {peak_lr!r}.")
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ConfigError(f"total_steps must be a positive int, got {total_steps!r}.")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}.")
        if warmup_steps > total_steps:
            raise ConfigError(
                f"warmup_steps={warmup_steps} is longer than training (total_steps={total_steps}). Fix: shorten "
                "the warmup or train longer."
            )
        if warmup_start_lr < 0:
            raise ConfigError(f"warmup_start_lr must be >= 0, got {warmup_start_lr!r}.")
        self.peak_lr = float(peak_lr)
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.warmup_start_lr = float(warmup_start_lr)

    @abc.abstractmethod
    def _decay(self, s: tf.Tensor) -> tf.Tensor:
        """LR at step s in [W, T] (float64)."""

    def __call__(self, step: Any) -> tf.Tensor:
        s = tf.minimum(tf.cast(step, tf.float64), float(self.total_steps))
        w = float(self.warmup_steps)
        if self.warmup_steps > 0:
            warm = self.warmup_start_lr + (self.peak_lr - self.warmup_start_lr) * s / w
            lr = tf.where(s < w, warm, self._decay(tf.maximum(s, w)))
        else:
            lr = self._decay(s)
        return tf.cast(lr, tf.float32)

    def get_config(self) -> dict[str, Any]:
        return {"peak_lr": self.peak_lr, "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "warmup_start_lr": self.warmup_start_lr}


def _fraction(s: tf.Tensor, w: int, t: int) -> tf.Tensor:
    """Progress through the decay phase, in [0, 1]."""
    return (s - w) / float(max(t - w, 1))


@keras.saving.register_keras_serializable(package="hvrep")
class PolynomialDecayWithWarmup(_Warmup):
    """Warmup, then ``end + (peak - end) * (1 - progress) ** power`` (MLPerf: power 2)."""

    def __init__(self, peak_lr: float, total_steps: int, warmup_steps: int = 0, warmup_start_lr: float = 0.0,
                 end_lr: float = 0.0, power: float = 2.0) -> None:
        super().__init__(peak_lr, total_steps, warmup_steps, warmup_start_lr)
        if end_lr < 0 or end_lr > peak_lr:
            raise ConfigError(f"end_lr must be in [0, peak_lr={peak_lr}], got {end_lr!r}.")
        if not power > 0:
            raise ConfigError(f"power must be > 0, got {power!r}.")
        self.end_lr, self.power = float(end_lr), float(power)

    def _decay(self, s: tf.Tensor) -> tf.Tensor:
        frac = _fraction(s, self.warmup_steps, self.total_steps)
        return self.end_lr + (self.peak_lr - self.end_lr) * tf.pow(1.0 - frac, self.power)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "end_lr": self.end_lr, "power": self.power}


@keras.saving.register_keras_serializable(package="hvrep")
class CosineDecayWithWarmup(_Warmup):
    """Warmup, then ``end + (peak - end) * (1 + cos(pi * progress)) / 2``."""

    def __init__(self, peak_lr: float, total_steps: int, warmup_steps: int = 0, warmup_start_lr: float = 0.0,
                 end_lr: float = 0.0) -> None:
        super().__init__(peak_lr, total_steps, warmup_steps, warmup_start_lr)
        if end_lr < 0 or end_lr > peak_lr:
            raise ConfigError(f"end_lr must be in [0, peak_lr={peak_lr}], got {end_lr!r}.")
        self.end_lr = float(end_lr)

    def _decay(self, s: tf.Tensor) -> tf.Tensor:
        frac = _fraction(s, self.warmup_steps, self.total_steps)
        return self.end_lr + (self.peak_lr - self.end_lr) * 0.5 * (1.0 + tf.cos(math.pi * frac))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "end_lr": self.end_lr}


@keras.saving.register_keras_serializable(package="hvrep")
class StepDecayWithWarmup(_Warmup):
    """Warmup, then ``peak * factor ** k`` after the k-th boundary (steps, increasing)."""

    def __init__(self, peak_lr: float, total_steps: int, boundaries: Sequence[int], factor: float = 0.1,
                 warmup_steps: int = 0, warmup_start_lr: float = 0.0) -> None:
        super().__init__(peak_lr, total_steps, warmup_steps, warmup_start_lr)
        b = [int(x) for x in boundaries]
        if any(x <= warmup_steps or x > total_steps for x in b) or b != sorted(set(b)):
            raise ConfigError(
                f"boundaries must increase strictly within (warmup_steps={warmup_steps}, total_steps="
                f"{total_steps}], got {list(boundaries)!r}."
            )
        if not 0 < factor < 1:
            raise ConfigError(f"factor must be in (0, 1), got {factor!r}.")
        self.boundaries, self.factor = b, float(factor)

    def _decay(self, s: tf.Tensor) -> tf.Tensor:
        passed = tf.add_n([tf.cast(s >= float(x), tf.float64) for x in self.boundaries]) if self.boundaries \
            else tf.zeros_like(s)
        return self.peak_lr * tf.pow(tf.constant(self.factor, tf.float64), passed)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "boundaries": self.boundaries, "factor": self.factor}


@keras.saving.register_keras_serializable(package="hvrep")
class ConstantWithWarmup(_Warmup):
    """Warmup, then ``peak`` until the end."""

    def _decay(self, s: tf.Tensor) -> tf.Tensor:
        return tf.fill(tf.shape(s), tf.constant(self.peak_lr, tf.float64))


def warmup_schedule(decay: str, **kwargs: Any) -> _Warmup:
    """Builds a schedule by decay name: "polynomial", "cosine", "step" or "constant".

    Raises:
      hvrep.errors.ConfigError: an unknown name (the message lists the choices) or bad arguments.
    """
    classes = {"polynomial": PolynomialDecayWithWarmup, "cosine": CosineDecayWithWarmup,
               "step": StepDecayWithWarmup, "constant": ConstantWithWarmup}
    if decay not in classes:
        raise ConfigError(f"decay must be one of {DECAYS}, got {decay!r}.")
    try:
        return classes[decay](**kwargs)
    except TypeError as e:
        raise ConfigError(f"{classes[decay].__name__}: {e}") from None


@keras.saving.register_keras_serializable(package="hvrep")
class EpochSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule over samples trained, called, as Keras does, with the optimizer's step count.

    The step is turned into samples through an anchor that a training loop sets where it knows what was
    trained (an epoch's start, a resume)::

        samples(step) = anchor_samples + (step - anchor_step) * samples_per_step
        lr(step) = schedule(samples(step))

    A new schedule is anchored at step 0, sample 0, so without :meth:`anchor` it is an ordinary step
    schedule. Build one with :func:`epoch_schedule`.

    Args:
      schedule: a warmup schedule whose "steps" are samples (warmup and decay at sample counts).
      samples_per_epoch: samples in one epoch (the training set's size).
      samples_per_step: samples one optimizer step trains (the global batch, times the accumulation steps).

    The anchor lives in two variables (created where the schedule is, e.g. inside ``Replicator.scope()``),
    not in checkpoints: the loop sets it from what it restored.
    """

    def __init__(self, schedule: _Warmup, samples_per_epoch: int, samples_per_step: int) -> None:
        if not isinstance(schedule, _Warmup):
            raise ConfigError(f"schedule must be an hvrep.schedules warmup schedule over samples, got "
                              f"{type(schedule).__name__}. Fix: build it with hvrep.schedules.epoch_schedule.")
        for name, value in (("samples_per_epoch", samples_per_epoch), ("samples_per_step", samples_per_step)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}.")
        self.schedule = schedule
        self.samples_per_epoch = samples_per_epoch
        self.samples_per_step = samples_per_step
        # float64: sample counts of long ImageNet runs (~1e8) stay exact; int64 for the step.
        self._anchor_samples = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="hvrep_lr_anchor_samples")
        self._anchor_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvrep_lr_anchor_step")
        self._per_step = tf.Variable(float(samples_per_step), dtype=tf.float64, trainable=False,
                                     name="hvrep_lr_samples_per_step")

    def anchor(self, step: int, samples: float, samples_per_step: int | None = None) -> None:
        """Says that optimizer step ``step`` is where ``samples`` samples have been trained, and how many each
        following step trains (None: unchanged). Call outside the compiled step (e.g. at an epoch's start)."""
        if samples_per_step is not None:
            if not isinstance(samples_per_step, int) or samples_per_step < 1:
                raise ConfigError(f"samples_per_step must be a positive int, got {samples_per_step!r}.")
            self.samples_per_step = samples_per_step
            self._per_step.assign(float(samples_per_step))
        self._anchor_samples.assign(float(samples))
        self._anchor_step.assign(int(step))

    def samples_at(self, step: Any) -> tf.Tensor:
        """Samples trained at optimizer step ``step`` (float64)."""
        delta = tf.cast(tf.cast(step, tf.int64) - self._anchor_step, tf.float64)
        return self._anchor_samples + delta * self._per_step

    def epochs_at(self, step: Any) -> tf.Tensor:
        """Epochs trained at optimizer step ``step`` (float64)."""
        return self.samples_at(step) / float(self.samples_per_epoch)

    def at_epoch(self, epochs: float) -> float:
        """The learning rate after ``epochs`` epochs of training, whatever the batch."""
        return float(self.schedule(tf.constant(epochs * self.samples_per_epoch, tf.float64)))

    def __call__(self, step: Any) -> tf.Tensor:
        return self.schedule(self.samples_at(step))

    def get_config(self) -> dict[str, Any]:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                "samples_per_epoch": self.samples_per_epoch, "samples_per_step": self.samples_per_step}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EpochSchedule:
        config = dict(config)
        config["schedule"] = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(**config)


def epoch_schedule(decay: str, *, peak_lr: float, epochs: float, samples_per_epoch: int, samples_per_step: int,
                   warmup_epochs: float = 0.0, warmup_start_lr: float = 0.0,
                   boundaries: Sequence[float] | None = None, **kwargs: Any) -> EpochSchedule:
    """A warmup schedule defined in epochs (see the module docstring), as an :class:`EpochSchedule`.

    Args:
      decay: "polynomial", "cosine", "step" or "constant".
      peak_lr: the LR at the end of warmup.
      epochs: epochs of training (the decay ends there).
      samples_per_epoch: the training set's size.
      samples_per_step: the global batch (times the accumulation steps).
      warmup_epochs: epochs of linear warmup from ``warmup_start_lr``.
      boundaries: for "step": the epochs after which the LR drops by ``factor``.
      **kwargs: the decay's other arguments (``end_lr``, ``power``, ``factor``).

    Raises:
      hvrep.errors.ConfigError: bad arguments, naming them in epochs.
    """
    if not epochs > 0:
        raise ConfigError(f"epochs must be > 0, got {epochs!r}.")
    if not 0 <= warmup_epochs <= epochs:
        raise ConfigError(f"warmup_epochs={warmup_epochs:g} must be in [0, epochs={epochs:g}]: the warmup is longer "
                          "than training. Fix: a shorter warmup or more epochs.")
    if not isinstance(samples_per_epoch, int) or samples_per_epoch < 1:
        raise ConfigError(f"samples_per_epoch must be a positive int, got {samples_per_epoch!r}.")
    n = samples_per_epoch
    arguments: dict[str, Any] = {"peak_lr": peak_lr, "total_steps": max(1, round(epochs * n)),
                                 "warmup_steps": round(warmup_epochs * n), "warmup_start_lr": warmup_start_lr,
                                 **kwargs}
    if decay == "step":
        if boundaries is None:
            raise ConfigError("decay='step' needs boundaries (epochs). Fix: e.g. boundaries=[30, 60, 80].")
        arguments["boundaries"] = [round(b * n) for b in boundaries]
    elif boundaries is not None:
        raise ConfigError(f"boundaries are for decay='step', not {decay!r}. Fix: leave them out.")
    return EpochSchedule(warmup_schedule(decay, **arguments), samples_per_epoch, samples_per_step)
