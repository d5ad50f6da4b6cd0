"""``train.loop=fit``: the same run trained by Keras' ``model.fit`` through ``hvrep.keras`` instead of hvrep's loop.

What is the same as the custom loop (``controller.py``): the model, the
optimizer and schedule, the data pipeline with its per-epoch seed and plan,
the exact global evaluation (``Runner.evaluate``), ``metrics.jsonl`` and the
console lines, the checkpoint at the end of every ``checkpoint.every_epochs``
(model, optimizer, step, epoch), ``train.max_steps`` and the target accuracy.
What fit does its own way: the step (Keras' ``train_step``: loss, backward
pass, ``hvrep.keras.DistributedOptimizer``), the loop over batches
(``train.steps_per_loop`` becomes ``steps_per_execution``), and the training
loss and accuracy (Keras' metrics, averaged over the ranks by
``MetricAverageCallback``). Not supported here: ``--resume``, gradient
accumulation, and stopping on signals; use ``train.loop=custom`` for those.

One ``fit`` call per epoch: each epoch builds its dataset with that epoch's
seed, as the custom loop does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

import hvrep
import hvrep.keras
from hvrep.data import data_errors, make_dataset
from hvrep.errors import ConfigError
from hvrep.replica.context import InputContext
from hvrep.train.checkpoint import CheckpointManager
from hvrep.train.config import RunConfig
from hvrep.train.metrics import MetricsWriter
from hvrep.train.steps import Runner


def check_supported(cfg: RunConfig, resume: bool) -> None:
    """Raises ConfigError for what the fit loop does not do, naming the fix."""
    if resume:
        raise ConfigError("--resume works with train.loop=custom only: the fit loop does not restore a run. Fix: "
                          "resume with train.loop=custom (the checkpoints are the same), or start afresh.")
    if cfg.comm.accumulation_steps > 1:
        raise ConfigError(f"comm.accumulation_steps={cfg.comm.accumulation_steps} works with train.loop=custom "
                          "only. Fix: train.loop=custom, or accumulation_steps=1 with a larger batch.")


def _train_dataset(repl: hvrep.Replicator, data_cfg: Any, global_batch: int, num_classes: int) -> tf.data.Dataset:
    """This process's batches for one epoch, labels one-hot: a rank's own on horovod; in one process (an
    in-graph backend) the whole global batch, which Keras splits over the replicas of ``repl.scope()``'s strategy."""
    if repl.num_processes > 1:
        dataset = repl.distribute_dataset(lambda ctx: make_dataset(data_cfg, "train", ctx),
                                          global_batch_size=global_batch)
    else:
        dataset = make_dataset(data_cfg, "train", InputContext(0, 1, global_batch))
    return dataset.map(lambda x, y: (x, tf.one_hot(y, num_classes)), num_parallel_calls=tf.data.AUTOTUNE)


class _EpochRecorder(keras.callbacks.Callback):
    """Keeps the epoch's logs (after MetricAverageCallback averaged them) and its wall time."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, float] = {}
        self.seconds = 0.0
        self._t0 = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._t0 = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.logs = dict(logs or {})


def run_fit(cfg: RunConfig, repl: hvrep.Replicator, build: Callable[[], tuple[Any, Any, int, float]], *,
            steps_per_epoch: int, val_images: int, metrics: MetricsWriter) -> dict[str, Any]:
    """Trains with ``model.fit``; returns what ``Controller.run`` returns.

    Args:
      build: called inside ``repl.scope()``; returns (model, optimizer, epochs, label smoothing).
    """
    n, gb = repl.num_replicas, cfg.train.global_batch
    with repl.scope():
        model, optimizer, epochs, smoothing = build()
        distributed = hvrep.keras.DistributedOptimizer(optimizer, repl)
        model.compile(optimizer=distributed,
                      loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=smoothing),
                      metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
                      steps_per_execution=cfg.train.steps_per_loop, jit_compile=cfg.train.jit_compile)
        distributed.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    # The exact global evaluation of the custom loop (padding excluded, every image once).
    evaluator = Runner(repl, model, distributed, num_classes=cfg.model.num_classes, label_smoothing=smoothing,
                       fp16=False, jit_compile=False)
    ckpt = CheckpointManager(Path(cfg.output_dir) / "checkpoints", is_chief=repl.is_chief, keep=cfg.checkpoint.keep,
                             model=model, optimizer=distributed, step=step, epoch=epoch_var,
                             position=tf.Variable(0, dtype=tf.int64, trainable=False, name="position"))
    recorder = _EpochRecorder()
    callbacks = [hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
                 hvrep.keras.callbacks.MetricAverageCallback(repl), recorder]
    start = time.time()
    summary: dict[str, Any] = {"stopped": "completed"}
    top1 = top5 = float("nan")
    rates: list[float] = []
    done = 0
    for epoch in range(epochs):
        steps = steps_per_epoch
        if cfg.train.max_steps:
            steps = min(steps, cfg.train.max_steps - done)
        epoch_cfg = dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000 + epoch)
        with data_errors(epoch_cfg, "train"):
            model.fit(_train_dataset(repl, epoch_cfg, gb, cfg.model.num_classes), initial_epoch=epoch,
                      epochs=epoch + 1, steps_per_epoch=steps, shuffle=False, verbose=0, callbacks=callbacks)
        done += steps
        step.assign(done)
        rates.append(steps * gb / max(recorder.seconds, 1e-9))
        line = {"epoch": epoch + 1, "loss": float(recorder.logs.get("loss", float("nan"))),
                "images_per_sec": rates[-1], "train_top1": float(recorder.logs.get("accuracy", float("nan")))}
        last = epoch + 1 == epochs or bool(cfg.train.max_steps and done >= cfg.train.max_steps)
        if (epoch + 1) % cfg.train.eval_every == 0 or last:
            top1, top5 = evaluator.evaluate(cfg.data, val_images, gb // n)
            line.update(top1=top1, top5=top5)
        metrics.write("epoch", done, **line)
        acc = f"  val top-1 {top1:.4f} top-5 {top5:.4f}" if "top1" in line else ""
        metrics.say(f"epoch {epoch + 1}/{epochs} (fit)  loss {line['loss']:.4f}  {rates[-1]:,.0f} images/s{acc}")
        epoch_var.assign(epoch + 1)
        if (epoch + 1) % cfg.checkpoint.every_epochs == 0 or last:
            ckpt.save(done, metadata={"epoch": epoch + 1, "position": 0, "world_size": n, "global_batch": gb,
                                      "segments": [], "loop": "fit"})
        target = cfg.train.target_accuracy
        if target is not None and "top1" in line and top1 >= target:
            summary.update(stopped="target_accuracy", time_to_accuracy_sec=time.time() - start)
            break
        if cfg.train.max_steps and done >= cfg.train.max_steps:
            summary["stopped"] = "max_steps"
            break
    summary.update(top1=top1, top5=top5, images_per_sec=rates, wall_sec=time.time() - start, step=done,
                   epoch=int(epoch_var.numpy()), checkpoint=str(ckpt.latest()) if ckpt.latest() else None)
    return summary
