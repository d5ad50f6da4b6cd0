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
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hvrep.errors import ConfigError

DECAYS = ("polynomial", "cosine", "step", "constant")


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
