"""The training app's optimizer: the recipe's or the configured one, with its schedule in epochs.

Both loops (``controller.py`` and ``fitloop.py``) build it here, and both adapt it
here to the checkpoint a run resumes from (``follow_checkpoint``), so a resume
with another global batch continues the same way in either loop.

The batch that counts is the batch per optimizer update, ``train.global_batch x
comm.accumulation_steps`` (:func:`update_batch`): it picks the recipe and its peak
LR, sets the schedule's samples per step, and is what a resume compares
(docs/large-batch.md#which-batch-which-learning-rate).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hvrep import recipes, schedules
from hvrep.errors import ConfigError
from hvrep.optimizers import LARS, MomentumSGD
from hvrep.train import config as configs


@dataclasses.dataclass
class Optim:
    """The optimizer (before loss scaling or distribution), its schedule in epochs, and the run's length."""

    optimizer: Any
    schedule: schedules.EpochSchedule
    epochs: int
    label_smoothing: float
    rule: str  # how the peak LR was chosen, for the log


def update_batch(cfg: configs.RunConfig) -> int:
    """Samples per optimizer update over all replicas: ``train.global_batch x comm.accumulation_steps``."""
    return cfg.train.global_batch * cfg.comm.accumulation_steps


def _saved_update_batch(metadata: dict[str, Any]) -> int | None:
    """The batch per update a checkpoint was trained with (its global batch x its accumulation steps)."""
    batch = metadata.get("global_batch")
    steps = (metadata.get("accumulation") or {}).get("steps", 1)
    return batch * steps if isinstance(batch, int) and isinstance(steps, int) else None


def _batch_words(cfg: configs.RunConfig, per_update: int) -> str:
    """How a message names this run's batch: the setting, and the batch per update where accumulation differs."""
    k = cfg.comm.accumulation_steps
    return (f"train.global_batch={cfg.train.global_batch}" if k == 1 else
            f"train.global_batch={cfg.train.global_batch} x comm.accumulation_steps={k} = {per_update} per update")


def build(cfg: configs.RunConfig, train_images: int, epochs: int | None = None) -> Optim:
    """The recipe's or the explicit optimizer; ``epochs`` (a checkpoint's) overrides the configured length."""
    o, t = cfg.optim, cfg.train
    exclude = None if o.exclude_bn_and_bias else []  # None: the optimizers' defaults (BN and biases)
    per_step = update_batch(cfg)
    if o.optimizer == "recipe":
        try:
            recipe = recipes.imagenet_resnet50(per_step, epochs or t.epochs, train_images=train_images,
                                               label_smoothing=o.label_smoothing,
                                               exclude_bn_and_bias_from_weight_decay=o.exclude_bn_and_bias)
        except ConfigError as e:  # the recipe names its own arguments; say which settings of this run they are
            raise ConfigError(
                f"train.epochs={epochs or t.epochs} is too short for optim.optimizer=recipe at "
                f"{_batch_words(cfg, per_step)} ({e}). Fix: a larger train.epochs, or an explicit optimizer "
                "(optim.optimizer=lars or momentum_sgd) with a shorter optim.warmup_epochs.") from e
        return Optim(recipe.optimizer, recipe.schedule, recipe.epochs, recipe.label_smoothing,
                      f"the recipe for {per_step} samples per update: peak {recipe.peak_lr:.6g} after "
                      f"{recipe.warmup_epochs:g} warmup epochs")
    n_epochs = epochs or t.epochs or 90
    if o.warmup_epochs > n_epochs:
        raise ConfigError(f"optim.warmup_epochs={o.warmup_epochs:g} is longer than training (train.epochs="
                         f"{n_epochs}). Fix: a shorter optim.warmup_epochs or a larger train.epochs.")
    kwargs: dict[str, Any] = {"peak_lr": o.peak_lr, "epochs": n_epochs, "warmup_epochs": o.warmup_epochs,
                              "samples_per_epoch": train_images, "samples_per_step": per_step}
    if o.decay == "step":  # Goyal's 30/60/80 of 90 epochs, scaled to this run (each after the warmup)
        after_warmup = o.warmup_epochs + per_step / train_images
        kwargs["boundaries"] = [max(after_warmup, n_epochs * f) for f in (30 / 90, 60 / 90, 80 / 90)]
    schedule = schedules.epoch_schedule(o.decay, **kwargs)
    if o.optimizer == "lars":
        opt = LARS(schedule, momentum=o.momentum, weight_decay=o.weight_decay, exclude_from_weight_decay=exclude,
                   exclude_from_layer_adaptation=exclude)
    else:
        opt = MomentumSGD(schedule, momentum=o.momentum, weight_decay=o.weight_decay,
                          exclude_from_weight_decay=exclude)
    return Optim(opt, schedule, n_epochs, o.label_smoothing or 0.0,
                  f"optim.peak_lr={o.peak_lr:g}, not rescaled; the schedule goes on by epoch")


def follow_checkpoint(cfg: configs.RunConfig, optim: Optim, metadata: dict[str, Any], train_images: int) -> None:
    """Adapts the schedule to the checkpoint a run resumes from (before the first step).

    With ``optim.optimizer=recipe`` the new batch's recipe applies from the epoch reached and the run keeps the
    checkpoint's length (unless ``train.epochs`` says otherwise); a batch change that switches the recipe's
    optimizer is refused. Batches are compared per optimizer update (global batch x accumulation steps, the
    checkpoint's and this run's). An explicit schedule is left as configured: it goes on by epoch.
    """
    if cfg.optim.optimizer != "recipe":
        return
    old, new = _saved_update_batch(metadata), update_batch(cfg)
    limit = recipes.GOYAL_MAX_BATCH
    if old is not None and (old <= limit) != (new <= limit):
        names = {True: "momentum SGD (Goyal et al.)", False: "LARS (MLPerf)"}
        raise ConfigError(
            f"{_batch_words(cfg, new)} switches the recipe's optimizer: the checkpoint was trained with {old} "
            f"samples per update, i.e. {names[old <= limit]}, and {new} takes {names[new <= limit]}, whose state "
            f"cannot continue the other's. Fix: resume with a train.global_batch x comm.accumulation_steps "
            f"{'of at most' if old <= limit else 'above'} {limit:,}, or start a new run in another output_dir.")
    saved_epochs = metadata.get("epochs")
    if cfg.train.epochs is None and isinstance(saved_epochs, int) and saved_epochs != optim.epochs:
        recipe = recipes.imagenet_resnet50(new, saved_epochs, train_images=train_images,
                                           label_smoothing=cfg.optim.label_smoothing,
                                           exclude_bn_and_bias_from_weight_decay=cfg.optim.exclude_bn_and_bias)
        optim.schedule.schedule = recipe.schedule.schedule
        optim.epochs = saved_epochs
