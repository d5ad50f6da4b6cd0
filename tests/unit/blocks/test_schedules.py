"""Schedules equal their closed forms at the boundaries that matter; bad settings are named."""

from __future__ import annotations

import math

import keras
import pytest

from hvrep import schedules
from hvrep.errors import ConfigError

PEAK, START, END, W, T = 3.2, 0.1, 0.0001, 50, 1000


def lr(schedule, step):
    return float(schedule(step))


def _close(a, b):
    assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("start", [0.0, START], ids=["mlperf-from-zero", "goyal-from-base"])
def test_warmup_is_linear_from_start_to_peak(start):
    s = schedules.PolynomialDecayWithWarmup(PEAK, T, W, warmup_start_lr=start, end_lr=END)
    _close(lr(s, 0), start)
    _close(lr(s, W // 2), start + (PEAK - start) * (W // 2) / W)
    _close(lr(s, W - 1), start + (PEAK - start) * (W - 1) / W)
    _close(lr(s, W), PEAK)


def test_polynomial_decay_power_two():
    s = schedules.PolynomialDecayWithWarmup(PEAK, T, W, end_lr=END, power=2.0)
    mid = W + (T - W) // 2
    _close(lr(s, mid), END + (PEAK - END) * (1 - (mid - W) / (T - W)) ** 2)
    _close(lr(s, T - 1), END + (PEAK - END) * (1 / (T - W)) ** 2)
    _close(lr(s, T), END)
    _close(lr(s, T + 500), END)  # clamped after the end


def test_cosine_decay():
    s = schedules.CosineDecayWithWarmup(PEAK, T, W, end_lr=END)
    mid = W + (T - W) // 2
    _close(lr(s, W), PEAK)
    _close(lr(s, mid), END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * (mid - W) / (T - W))))
    _close(lr(s, T), END)


def test_step_decay_goyal():
    # Goyal et al.: 90 epochs, 5 warmup, x0.1 at epochs 30, 60, 80 (here 10 steps per epoch).
    s = schedules.StepDecayWithWarmup(PEAK, 900, [300, 600, 800], factor=0.1, warmup_steps=50,
                                      warmup_start_lr=0.1)
    _close(lr(s, 0), 0.1)
    _close(lr(s, 50), PEAK)
    _close(lr(s, 299), PEAK)
    _close(lr(s, 300), PEAK * 0.1)
    _close(lr(s, 700), PEAK * 0.01)
    _close(lr(s, 899), PEAK * 0.001)


def test_no_warmup_starts_at_peak():
    _close(lr(schedules.PolynomialDecayWithWarmup(PEAK, T, 0), 0), PEAK)
    _close(lr(schedules.ConstantWithWarmup(PEAK, T, W), T), PEAK)


def test_linear_scaling_rule():
    assert schedules.linear_scaling(0.1, 8192) == pytest.approx(3.2)
    assert schedules.linear_scaling(0.1, 8192, base_batch=512) == pytest.approx(1.6)
    with pytest.raises(ConfigError, match="global_batch must be a positive int, got 0"):
        schedules.linear_scaling(0.1, 0)


@pytest.mark.parametrize("s", [
    schedules.PolynomialDecayWithWarmup(PEAK, T, W, warmup_start_lr=START, end_lr=END, power=2.0),
    schedules.CosineDecayWithWarmup(PEAK, T, W, end_lr=END),
    schedules.StepDecayWithWarmup(PEAK, T, [300, 600], factor=0.5, warmup_steps=W),
    schedules.ConstantWithWarmup(PEAK, T, W),
], ids=lambda s: type(s).__name__)
def test_schedules_serialise_and_come_back_equal(s):
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(s))
    assert type(again) is type(s) and again.get_config() == s.get_config()
    for step in (0, W, 400, T):
        _close(lr(again, step), lr(s, step))


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda: schedules.PolynomialDecayWithWarmup(0.0, T, W), "peak_lr must be > 0, got 0.0"),
    (lambda: schedules.PolynomialDecayWithWarmup(-1.0, T, W), "peak_lr must be > 0, got -1.0"),
    (lambda: schedules.CosineDecayWithWarmup(PEAK, 100, 200), "warmup_steps=200 is longer than training"),
    (lambda: schedules.StepDecayWithWarmup(PEAK, T, [600, 300]), "boundaries must increase"),
    (lambda: schedules.warmup_schedule("exponential", peak_lr=PEAK, total_steps=T),
     "decay must be one of ('polynomial', 'cosine', 'step', 'constant'), got 'exponential'"),
])
def test_bad_settings_are_named(make, fragment):
    with pytest.raises(ConfigError) as e:
        make()
    assert fragment in str(e.value)


def test_factory_builds_by_name():
    s = schedules.warmup_schedule("cosine", peak_lr=PEAK, total_steps=T, warmup_steps=W)
    assert isinstance(s, schedules.CosineDecayWithWarmup)
