"""A run resumed with half or double the global batch follows its learning-rate schedule by epoch.

In-process on the local backend (2 logical CPU devices), the real app on the demo data (1,437 training images).
For each schedule two reference runs train without a stop, at global batch 64 and at 32, logging the LR after
every step; their checkpoints at the end of epoch 3 and 10 steps of 64 (20 of 32) later are the stopped runs,
resumed with the other batch for one step. The LR the resumed step logs must be the one the uninterrupted run
with that batch logs at the same number of samples.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train import optim as optimizers
from hvrep.train.checkpoint import read_metadata
from hvrep.train.main import run

N = 1437  # demo training images
SPE = {64: N // 64, 32: N // 32}  # 22 and 44 steps per epoch
MID = {64: 10, 32: 20}  # steps into epoch 4 where the mid-epoch checkpoints are (640 samples either way)
SCHEDULES = {
    # The demo's LARS: 2 warmup epochs to 5.0, polynomial decay over 8 epochs (epoch 3 is past the warmup).
    "explicit": {},
    # Goyal's recipe: 0.1 x batch / 256, x0.1 at 30/90 of 8 epochs (2.67): epoch 3 is past the first drop.
    "recipe": {"optim.optimizer": "recipe", "optim.label_smoothing": "0"},
}


def _cfg(demo_data: Path, out: Path, schedule: str, batch: int, **extra: str) -> configs.RunConfig:
    return configs.apply_overrides(configs.preset("demo"), {
        "data.data_dir": str(demo_data), "output_dir": str(out), "train.epochs": "8", "train.eval_every": "8",
        "model.width": "4", "train.log_every": "1", "train.global_batch": str(batch), "checkpoint.keep": "8",
        **SCHEDULES[schedule], **extra})


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _lr_after(events: list[dict]) -> dict[int, float]:
    """Step -> the LR logged after it (the LR of the step that follows)."""
    return {e["step"]: e["lr"] for e in events if e["event"] == "train"}


@pytest.fixture(scope="module")
def references(demo_data, tmp_path_factory):
    """Per (schedule, batch): the uninterrupted run's folder, one step past the mid-epoch checkpoint."""
    runs = {}
    for schedule in SCHEDULES:
        for batch in (64, 32):
            out = tmp_path_factory.mktemp(f"{schedule}-{batch}")
            mid = 3 * SPE[batch] + MID[batch]
            run(_cfg(demo_data, out, schedule, batch, **{"train.max_steps": str(mid + 1),
                                                         "checkpoint.every_steps": str(mid)}))
            runs[schedule, batch] = out
    return runs


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("where", ["epoch boundary", "mid-epoch"])
@pytest.mark.parametrize(("old", "new"), [(64, 32), (32, 64)], ids=["half", "double"])
def test_the_first_step_after_a_resume_with_another_batch_has_the_new_batchs_lr_at_that_epoch(
        references, demo_data, tmp_path, schedule, where, old, new):
    stopped_at = 3 * SPE[old] + (MID[old] if where == "mid-epoch" else 0)
    checkpoint = references[schedule, old] / "checkpoints" / f"ckpt-{stopped_at:08d}"
    meta = read_metadata(checkpoint)
    assert meta["epoch"] == 3 and meta["position"] == stopped_at - 3 * SPE[old], meta
    out = tmp_path / "resumed"
    shutil.copytree(checkpoint, out / "checkpoints" / checkpoint.name)

    run(_cfg(demo_data, out, schedule, new, **{"train.max_steps": str(stopped_at + 1)}), resume=True)

    trained = 3 * N + (MID[old] * old if where == "mid-epoch" else 0)  # samples at the stop: 3 epochs (+ 640)
    # The same point in the uninterrupted run with the new batch, and the step after it.
    point = 3 * SPE[new] + (trained - 3 * N) // new
    reference = _lr_after(_events(references[schedule, new]))
    resumed = _events(out)
    first = next(e for e in resumed if e["event"] == "train")
    assert first["step"] == stopped_at + 1
    # After the resumed run's first step: the reference's LR after the step that ends at the same samples.
    assert first["lr"] == pytest.approx(reference[point + 1], rel=1e-2), (first, reference[point + 1])
    # The first step itself ran at the reference's LR at the stop, which the resume records with the old one.
    change = next(e for e in resumed if e["event"] == "schedule")
    assert change["global_batch"] == [old, new]
    assert change["lr"][1] == pytest.approx(reference[point], rel=1e-2), (change, reference[point])
    # The LR the stopped run would have gone on with (after its step `stopped_at`; at the boundary the logged one
    # is the epoch's last step's, 29 samples before the epoch's end).
    before = _lr_after(_events(references[schedule, old]))[stopped_at]
    assert change["lr"][0] == pytest.approx(before, rel=1e-6 if where == "mid-epoch" else 2e-2)
    assert change["epochs_trained"] == pytest.approx(trained / N)


def test_an_explicit_peak_lr_is_never_rescaled(references):
    # The explicit schedule is the same function of epochs at every batch: after 3 epochs, whatever the batch
    # (the LR each epoch-end checkpoint records for the step after it).
    at_64, at_32 = (read_metadata(references["explicit", b] / "checkpoints" / f"ckpt-{3 * SPE[b]:08d}")["lr"]
                    for b in (64, 32))
    assert at_64 == pytest.approx(at_32, rel=1e-6)
    assert at_64 == pytest.approx(5.0 * (1 - (3 - 2) / (8 - 2)) ** 2, rel=1e-5)  # polynomial, power 2, after warmup


def test_the_recipe_scales_with_the_batch_and_keeps_the_checkpoints_length(tmp_path):
    cfg = configs.apply_overrides(configs.preset("demo"), {"data.data_dir": str(tmp_path), "optim.optimizer": "recipe",
                                                          "train.global_batch": "16384"})
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=None))  # the recipe's length
    optim = optimizers.build(cfg, 1_281_167)
    assert optim.epochs != 50
    optimizers.follow_checkpoint(cfg, optim, {"global_batch": 32768, "epochs": 50}, 1_281_167)
    assert optim.epochs == 50  # a LARS run keeps the length it started with
    assert optim.schedule.at_epoch(50) == pytest.approx(1e-4)  # the decay ends at the checkpoint's last epoch
    with pytest.raises(ConfigError, match=r"train.global_batch=16384 switches the recipe's optimizer.*trained with "
                                          r"8192 samples per update.*momentum SGD.*LARS.*Fix: resume with a "
                                          r"train.global_batch x comm.accumulation_steps of at most 8,192"):
        optimizers.follow_checkpoint(cfg, optim, {"global_batch": 8192, "epochs": 90}, 1_281_167)


def test_one_steps_per_epoch_rule_for_the_recipe_and_the_loop(references):
    from hvrep import recipes

    config = next(e for e in _events(references["recipe", 64]) if e["event"] == "config")
    assert config["steps_per_epoch"] == recipes.imagenet_resnet50(64, 8, train_images=N).steps_per_epoch == 22
