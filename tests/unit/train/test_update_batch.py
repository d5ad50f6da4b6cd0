"""``hvrep train`` counts the batch per optimizer update (``train.global_batch x comm.accumulation_steps``):
the recipe, its peak LR, the schedule, the MLPerf log's ``global_batch_size`` and the optimizer-switch check on
resume all use it (docs/large-batch.md#which-batch-which-learning-rate).

The ResNet-50 recipe switches from momentum SGD to LARS above 8,192 samples per update, so 4,096 x 4 must build
LARS as 16,384 does. No run trains on batches this large here (the demo data holds 1,437 images): the tests
build the real optimizer both loops build (``hvrep.train.optim``), feed the real MLPerf log the ``config``
event both loops write, and check the real checkpoint metadata both loops write against a resume in the other.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hvrep import recipes
from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train import mlperf, resume
from hvrep.train import optim as optimizers

IMAGENET = 1_281_167


def _cfg(tmp_path, batch: int, accumulation: int = 1, loop: str = "custom", **extra: str) -> configs.RunConfig:
    cfg = configs.build("resnet50_imagenet", [f"data.data_dir={tmp_path}", f"output_dir={tmp_path / 'run'}",
                                              "optim.optimizer=recipe", f"train.global_batch={batch}",
                                              f"comm.accumulation_steps={accumulation}", f"train.loop={loop}",
                                              *(f"{k}={v}" for k, v in extra.items())])
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=None))  # the recipe's length


def _config(opt) -> dict:
    # The learning rate's config holds the schedule; compare it as the JSON metrics.jsonl records.
    return json.loads(json.dumps(opt.get_config(), default=str))


def test_accumulation_builds_the_recipe_of_the_batch_per_update(tmp_path):
    accumulated = optimizers.build(_cfg(tmp_path, 4096, 4), IMAGENET)
    whole = optimizers.build(_cfg(tmp_path, 16384), IMAGENET)
    assert type(accumulated.optimizer).__name__ == type(whole.optimizer).__name__ == "LARS"
    assert _config(accumulated.optimizer) == _config(whole.optimizer)  # peak LR, warmup, decay, momentum, decay
    assert accumulated.epochs == whole.epochs
    peak = recipes.imagenet_resnet50(16384).peak_lr
    assert peak > 10  # LARS's peak at 16k (momentum SGD's linear scaling at 4,096 would be 1.6)
    warmup = recipes.imagenet_resnet50(16384).warmup_epochs
    assert accumulated.schedule.at_epoch(warmup) == pytest.approx(peak, rel=1e-6)
    assert accumulated.schedule.samples_per_step == 16384
    assert "16384 samples per update" in accumulated.rule


def test_the_mllog_states_the_batch_per_update(tmp_path):
    cfg = _cfg(tmp_path, 4096, 4, **{"train.mllog": str(tmp_path / "mlperf.log")})
    optim = optimizers.build(cfg, IMAGENET)
    (log,) = mlperf.listeners(cfg, chief=True, resume=False, overwrite=False, started=1.0)
    # The config event as both loops write it (hvrep/train/main.py) once the optimizer is built.
    log.hear("config", 0, {"config": configs.to_dict(cfg), "replicas": 8, "env": {},
                           "optimizer": type(optim.optimizer).__name__,
                           "optimizer_config": optim.optimizer.get_config(),
                           "epochs": optim.epochs, "steps_per_epoch": IMAGENET // 4096, "train_images": IMAGENET,
                           "val_images": 50_000})
    log.close()
    lines = (tmp_path / "mlperf.log").read_text().splitlines()
    got = {r["key"]: r["value"] for r in (json.loads(x.removeprefix(":::MLLOG ")) for x in lines)}
    assert got["global_batch_size"] == 16384
    assert got["gradient_accumulation_steps"] == 4
    assert got["opt_name"] == "lars"
    assert got["lars_opt_base_learning_rate"] == pytest.approx(recipes.imagenet_resnet50(16384).peak_lr)
    assert got["model_bn_span"] == 4096 // 8  # batch norm still sees one micro-batch per replica


def _saved(loop: str, batch: int, accumulation: int) -> dict:
    """checkpoint.json of a checkpoint saved at an epoch's end by ``loop`` (both loops write this record)."""
    return resume.checkpoint_record(epoch=3, segments=[], world_size=8, global_batch=batch, train_examples=IMAGENET,
                                    samples_per_epoch=IMAGENET, epochs=40, lr=lambda e: 1.0, loop=loop,
                                    accumulation={"steps": accumulation, "micro_step": 0} if loop == "custom" else None)


# (saved by, its batch, its accumulation) -> (resumed by, its batch, its accumulation): the same samples per update
# on both sides, whichever loop saved and whichever resumes.
SAME = [(("custom", 4096, 4), ("fit", 16384, 1)), (("fit", 16384, 1), ("custom", 4096, 4)),
        (("custom", 16384, 1), ("custom", 2048, 8)), (("custom", 2048, 4), ("fit", 8192, 1))]
SWITCH = [(("fit", 8192, 1), ("custom", 4096, 4)), (("custom", 4096, 4), ("fit", 8192, 1)),
          (("custom", 4096, 2), ("custom", 4096, 4))]


@pytest.mark.parametrize(("saved", "resumed"), SAME, ids=lambda c: "x".join(map(str, c)))
def test_a_resume_at_the_same_batch_per_update_keeps_the_optimizer(tmp_path, saved, resumed):
    loop, batch, k = resumed
    cfg = _cfg(tmp_path, batch, k, loop=loop)
    optim = optimizers.build(cfg, IMAGENET)
    optimizers.follow_checkpoint(cfg, optim, _saved(*saved), IMAGENET)
    assert optim.epochs == 40  # the checkpoint's length, at the same recipe


@pytest.mark.parametrize(("saved", "resumed"), SWITCH, ids=lambda c: "x".join(map(str, c)))
def test_a_resume_that_switches_the_recipes_optimizer_is_refused(tmp_path, saved, resumed):
    loop, batch, k = resumed
    cfg = _cfg(tmp_path, batch, k, loop=loop)
    optim = optimizers.build(cfg, IMAGENET)
    old, new = saved[1] * saved[2], batch * k
    with pytest.raises(ConfigError, match=rf"switches the recipe's optimizer: the checkpoint was trained with {old} "
                                          rf"samples per update.* and {new} takes .*Fix: resume with a "
                                          r"train.global_batch x comm.accumulation_steps (of at most|above) 8,192"):
        optimizers.follow_checkpoint(cfg, optim, _saved(*saved), IMAGENET)
