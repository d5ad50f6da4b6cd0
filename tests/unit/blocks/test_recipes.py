"""The ResNet-50 recipe picks the published settings for the batch size."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf

from hvrep import recipes
from hvrep.errors import ConfigError
from hvrep.optimizers import LARS, MomentumSGD
from tests.unit.blocks.test_lars import EXCLUDED, SHAPES, _variables, reference_step


def test_goyal_8k_uses_momentum_sgd_with_linear_scaling_and_5_epoch_warmup():
    r = recipes.imagenet_resnet50(8192)
    assert isinstance(r.optimizer, MomentumSGD) and not isinstance(r.optimizer, type(None))
    assert r.peak_lr == pytest.approx(0.1 * 8192 / 256)  # 3.2
    assert (r.epochs, r.warmup_epochs, r.weight_decay, r.label_smoothing) == (90, 5.0, 1e-4, 0.0)
    # Full batches only, the training loop's rule (hvrep.schedules.steps_per_epoch).
    assert r.steps_per_epoch == 1_281_167 // 8192 == 156
    assert float(r.schedule(0)) == pytest.approx(0.1)  # Goyal: warm up from the base LR
    assert r.schedule.at_epoch(5) == pytest.approx(3.2)  # warmup and decay are defined in epochs
    assert r.schedule.at_epoch(30) == pytest.approx(0.32)
    assert r.schedule.at_epoch(80) == pytest.approx(0.0032)
    # Called with optimizer steps, as Keras does: step k has trained k global batches.
    assert float(r.schedule(156)) == pytest.approx(r.schedule.at_epoch(156 * 8192 / 1_281_167))


def test_mlperf_rows_use_lars_with_polynomial_decay_from_zero():
    r = recipes.imagenet_resnet50(65536)
    assert type(r.optimizer) is LARS and r.optimizer.eta == 0.001
    assert (r.peak_lr, r.warmup_epochs, r.epochs, r.label_smoothing) == (25.0, 32.0, 88, 0.1)
    assert float(r.schedule(0)) == 0.0
    assert r.schedule.at_epoch(32) == pytest.approx(25.0)
    assert not r.extrapolated


def test_between_rows_settings_interpolate_in_log_batch():
    lo, mid, hi = (recipes.imagenet_resnet50(b) for b in (40960, 51200, 65536))
    assert lo.peak_lr < mid.peak_lr < hi.peak_lr
    assert lo.warmup_epochs < mid.warmup_epochs < hi.warmup_epochs


def test_beyond_the_published_range_warns_and_says_so():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = recipes.imagenet_resnet50(131072)
    assert r.extrapolated and r.peak_lr > 25.0
    assert any("beyond the largest published" in str(w.message) for w in caught)


def test_label_smoothing_and_bn_bias_exclusion_are_options():
    r = recipes.imagenet_resnet50(32768, label_smoothing=0.0, exclude_bn_and_bias_from_weight_decay=False)
    assert r.label_smoothing == 0.0 and r.optimizer.exclude_from_weight_decay_patterns == ()
    r2 = recipes.imagenet_resnet50(32768)
    assert r2.label_smoothing == 0.1 and "bias$" in r2.optimizer.exclude_from_weight_decay_patterns


def test_warmup_longer_than_training_and_bad_batch_are_refused():
    with pytest.raises(ConfigError, match="warmup longer than training"):
        recipes.imagenet_resnet50(65536, epochs=20)
    with pytest.raises(ConfigError, match="global_batch must be a positive int, got 0"):
        recipes.imagenet_resnet50(0)


def test_momentum_sgd_is_lars_without_adaptation():
    rng = np.random.default_rng(5)
    variables = _variables(rng, np.float64)
    opt = MomentumSGD(0.5, momentum=0.9, weight_decay=1e-4)
    ref = {p: (v.numpy(), np.zeros(SHAPES[p])) for p, v in variables.items()}
    for _ in range(3):
        grads = {p: rng.normal(size=s) for p, s in SHAPES.items()}
        opt.apply_gradients([(tf.constant(grads[p]), variables[p]) for p in SHAPES])
        for p in SHAPES:
            w, v = ref[p]
            wd = 0.0 if p in EXCLUDED else 1e-4
            # eta chosen so the "ratio" path is never taken: excluded=True gives plain momentum.
            g = grads[p] + wd * w
            ref[p] = reference_step(w, g, v, 0.5, 0.9, 0.0, 1.0, 0.0, False, excluded=True)
    for p, var in variables.items():
        np.testing.assert_allclose(var.numpy(), ref[p][0], rtol=1e-6)
    again = MomentumSGD.from_config(opt.get_config())
    assert again.coupled_weight_decay == 1e-4 and again.exclude_from_layer_adaptation_patterns == ("",)
