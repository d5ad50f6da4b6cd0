"""``train.loop=fit``: the same run trained by Keras' ``model.fit`` through ``hvrep.keras`` instead of hvrep's loop.

What is the same as the custom loop (``controller.py``): the model, the
optimizer and its schedule in epochs (``optim.py``, ``position.py``), the data
pipeline with its per-epoch seed and plan, the exact global evaluation
(``Evaluator.evaluate``), ``metrics.jsonl`` and the console lines, ``train.max_steps``
and the target accuracy, and the checkpoints: the same trackables under the
same names and the same ``checkpoint.json``, so a checkpoint written by either
loop resumes in the other (``--resume``, restored as ``resume.py`` agrees on
every rank), at the same or another world size or global batch. SIGTERM or
SIGUSR1 (``slurm/preemptible.sbatch``) stops every rank at the same step
boundary and saves where the epoch stands, as the custom loop does.

What fit does its own way: the step (Keras' ``train_step``: loss, backward
pass, ``hvrep.keras.DistributedOptimizer``), the loop over batches
(``train.steps_per_loop`` becomes ``steps_per_execution``; the stop agreement
runs once per execution), and the training loss and accuracy (Keras' metrics,
averaged over the ranks by ``MetricAverageCallback``). Not supported here:
gradient accumulation; use ``train.loop=custom`` for it.

One ``fit`` call per epoch (or per rest of an epoch): each builds its dataset
with that epoch's seed and plan, as the custom loop does. With the in-graph
backend one process reads the whole global batch and Keras splits it, so its
segments are recorded as one data replica of the global batch.

Checkpoints written by the fit loop before this layout (format 1) nested the
optimizer inside ``DistributedOptimizer``; ``resume.py`` still reads them.
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
from hvrep.data import EpochPosition, data_errors, epoch_plan, make_dataset
from hvrep.replica.context import InputContext
from hvrep.train import crash, position
from hvrep.train import optim as optimizers
from hvrep.train import resume as resuming
from hvrep.train.checkpoint import CheckpointManager
from hvrep.train.config import RunConfig
from hvrep.train.controller import LoopState
from hvrep.train.metrics import MetricsWriter
from hvrep.train.position import SchedulePosition
from hvrep.train.preemption import stop_on_signals
from hvrep.train.steps import Evaluator


def _train_dataset(repl: hvrep.Replicator, data_cfg: Any, global_batch: int, num_classes: int,
                   at: EpochPosition, threads: int | None, steps: int) -> tf.data.Dataset:
    """This process's first ``steps`` batches of (the rest of) one epoch, labels one-hot: a rank's own on horovod;
    in one process (an in-graph backend) the whole global batch, which Keras splits over the replicas of
    ``repl.scope()``'s strategy.

    Exactly ``steps``: Keras runs whole executions of ``steps_per_execution`` steps while data lasts, so a
    ``steps_per_epoch`` that is not a multiple of it would train up to ``steps_per_execution - 1`` more.
    """
    if repl.num_processes > 1:
        dataset = repl.distribute_dataset(
            lambda ctx: make_dataset(data_cfg, "train", ctx, position=at, threads=threads),
            global_batch_size=global_batch)
    else:
        dataset = make_dataset(data_cfg, "train", InputContext(0, 1, global_batch), position=at, threads=threads)
    return dataset.map(lambda x, y: (x, tf.one_hot(y, num_classes)),
                       num_parallel_calls=tf.data.AUTOTUNE).take(steps)


class _EpochRecorder(keras.callbacks.Callback):
    """Keeps the epoch's logs (after MetricAverageCallback averaged them), its wall time and steps trained."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, float] = {}
        self.seconds = 0.0
        self.steps = 0
        self.limit = 0
        self._t0 = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._t0 = time.perf_counter()
        self.steps = 0

    def steps_after(self, batch: int) -> int:
        """The fit call's steps trained when Keras reports ``batch``: it passes the last step of the execution,
        counted from 0 in the fit call, as if every execution were whole; the last one stops where the data does
        (``limit``, the fit call's steps)."""
        return min(batch + 1, self.limit)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps = self.steps_after(batch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.logs = dict(logs or {})


class _StepLog(keras.callbacks.Callback):
    """The custom loop's ``train`` event every ``train.log_every`` steps (at the end of the execution that reaches
    it): the next step's LR, images/s, and the chief's running loss and accuracy in the epoch (Keras' means so far;
    the epoch's line averages them over the ranks)."""

    def __init__(self, metrics: MetricsWriter, log_every: int, global_batch: int, schedule: SchedulePosition,
                 recorder: _EpochRecorder) -> None:
        super().__init__()
        self.metrics, self.log_every, self.global_batch, self.schedule = metrics, log_every, global_batch, schedule
        self.recorder = recorder  # counts the fit call's steps
        self.first_step = 0  # the global step before this fit call
        self.epoch = 0
        self._t0 = 0.0
        self._last = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._t0 = time.perf_counter()
        self._last = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        steps = self.recorder.steps_after(batch)
        step = self.first_step + steps
        if step // self.log_every > (self.first_step + self._last) // self.log_every:
            logs = logs or {}
            self.metrics.write("train", step, epoch=self.epoch, loss=float(logs.get("loss", float("nan"))),
                               lr=self.schedule.lr(),
                               images_per_sec=steps * self.global_batch / max(time.perf_counter() - self._t0, 1e-9),
                               train_top1=float(logs.get("accuracy", float("nan"))))
        self._last = steps


class _StopAgreement(keras.callbacks.Callback):
    """Stops fit on every rank after the same execution when a signal reached any rank (one reduce each)."""

    def __init__(self, repl: hvrep.Replicator, stop: Any) -> None:
        super().__init__()
        self.repl = repl
        self.stop = stop
        self.signalled = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.stop.agreed(self.repl):
            self.signalled = True
            self.model.stop_training = True


def run_fit(cfg: RunConfig, repl: hvrep.Replicator, make_model: Callable[[], Any], *, train_images: int,
            val_images: int, metrics: MetricsWriter, resume: bool,
            started: Callable[[Any, int, Path | None], None]) -> dict[str, Any]:
    """Trains with ``model.fit``; returns what ``Controller.run`` returns, with "step", "epoch" and "checkpoint".

    Args:
      make_model: called inside ``repl.scope()``.
      resume: restore the newest checkpoint of ``cfg.output_dir`` first (either loop's).
      started: called once the run's optimizer, length and checkpoint are known (the config event).
    """
    n, gb = repl.num_replicas, cfg.train.global_batch
    data_replicas = repl.num_processes  # the in-graph backend reads the global batch in one pipeline
    with repl.scope():
        model = make_model()
        optim = optimizers.build(cfg, train_images)
        distributed = hvrep.keras.DistributedOptimizer(optim.optimizer, repl)
        model.compile(optimizer=distributed,
                      loss=keras.losses.CategoricalCrossentropy(from_logits=True,
                                                                label_smoothing=optim.label_smoothing),
                      metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
                      steps_per_execution=cfg.train.steps_per_loop, jit_compile=cfg.train.jit_compile)
        distributed.build(model.trainable_variables)
        state = LoopState(step=tf.Variable(0, dtype=tf.int64, trainable=False, name="step"),
                          epoch=tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch"),
                          position=tf.Variable(0, dtype=tf.int64, trainable=False, name="position"))
    # The exact global evaluation of the custom loop (padding excluded, every image once).
    evaluator = Evaluator(repl, model, cfg.model.num_classes)
    # The custom loop's trackables: the optimizer it saves is the one inside the DistributedOptimizer (with its
    # LossScaleOptimizer under mixed_float16, as the custom loop wraps it).
    # PowerSGD's state (comm.compression=powersgd) is the DistributedOptimizer's, kept apart from the optimizer's.
    extra_state = {"powersgd": distributed.powersgd} if distributed.powersgd is not None else {}
    ckpt = CheckpointManager(Path(cfg.output_dir) / "checkpoints", is_chief=repl.is_chief, keep=cfg.checkpoint.keep,
                             model=model, optimizer=distributed.inner_optimizer, step=state.step, epoch=state.epoch,
                             position=state.position, **extra_state)
    resumed = resuming.restore(repl, ckpt, 1, powersgd=resuming.powersgd_record(repl.config)) if resume else None
    if resumed:
        optimizers.follow_checkpoint(cfg, optim, resumed.metadata, train_images)
    schedule = SchedulePosition(optim.schedule, distributed, gb)
    epochs = optim.epochs
    started(optim.optimizer, epochs, resumed.folder if resumed else None)

    recorder = _EpochRecorder()
    summary: dict[str, Any] = {"stopped": "completed"}
    top1 = top5 = float("nan")
    rates: list[float] = []
    done = int(state.step.numpy())
    segments = resumed.segments(data_replicas, gb) if resumed else []
    train_examples = 0
    start = time.time()

    def save(epoch: int) -> None:
        if distributed.powersgd is not None:  # every rank, between fit calls: one copy of the error feedback
            repl.run(distributed.powersgd.average_errors)
        ckpt.save(done, metadata=resuming.checkpoint_record(
            epoch=epoch, segments=segments, world_size=n, global_batch=gb, train_examples=train_examples,
            samples_per_epoch=optim.schedule.samples_per_epoch, epochs=epochs, lr=optim.schedule.at_epoch,
            loop="fit", powersgd=resuming.powersgd_record(repl.config)))

    with stop_on_signals() as stop:
        agreement = _StopAgreement(repl, stop)
        step_log = _StepLog(metrics, cfg.train.log_every, gb, schedule, recorder)
        callbacks = [hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
                     hvrep.keras.callbacks.MetricAverageCallback(repl), recorder, step_log, agreement]
        epoch = int(state.epoch.numpy())
        while epoch < epochs:
            epoch_cfg = dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000 + epoch)
            plan = epoch_plan(epoch_cfg, "train")
            train_examples = plan.num_samples
            at = EpochPosition.resume(segments, data_replicas, gb)
            left = plan.steps(data_replicas, gb // data_replicas, at) - at.steps
            steps = min(left, cfg.train.max_steps - done) if cfg.train.max_steps else left
            lr = schedule.anchor(position.trained_samples(epoch, at, gb, optim.schedule.samples_per_epoch))
            if resumed is not None and epoch == int(resumed.metadata.get("epoch", 0)):
                position.announce(metrics, resumed.metadata, step=done, global_batch=gb, lr=lr,
                                  epochs_trained=schedule.epochs(), rule=optim.rule)
                resumed = None
            metrics.mark("epoch_start", epoch=epoch)
            recorder.steps, recorder.limit = 0, steps
            step_log.first_step, step_log.epoch = done, epoch
            if steps > 0:
                # Keras' compiled loop runs the steps: a native crash's report names the fit call.
                crash.note(f"model.fit after step {done}, epoch {epoch + 1}: per-replica batch {gb // n}")
                with data_errors(epoch_cfg, "train"):
                    model.fit(_train_dataset(repl, epoch_cfg, gb, cfg.model.num_classes, at, cfg.train.threads, steps),
                              initial_epoch=epoch, epochs=epoch + 1, steps_per_epoch=steps, shuffle=False,
                              verbose=0, callbacks=callbacks)
            trained = recorder.steps
            done += trained
            state.step.assign(done)
            segments = at.segments(data_replicas, gb, at.steps + trained)
            if trained:
                rates.append(trained * gb / max(recorder.seconds, 1e-9))
            if agreement.signalled:
                summary["stopped"] = "signal"
                break
            if cfg.train.max_steps and done >= cfg.train.max_steps:
                summary["stopped"] = "max_steps"
                break
            epoch += 1
            segments = []
            state.epoch.assign(epoch)
            # An epoch resumed at its end (stopped after its last step) trained nothing here: no loss or rate.
            line: dict[str, Any] = {"epoch": epoch}
            if trained:
                line.update(loss=float(recorder.logs.get("loss", float("nan"))), images_per_sec=rates[-1],
                            train_top1=float(recorder.logs.get("accuracy", float("nan"))))
            if epoch % cfg.train.eval_every == 0 or epoch == epochs:
                metrics.mark("eval_start", epoch=epoch)
                top1, top5 = evaluator.evaluate(cfg.data, val_images, gb // n, cfg.train.threads)
                line.update(top1=top1, top5=top5)
            metrics.write("epoch", done, **line)
            acc = f"  val top-1 {top1:.4f} top-5 {top5:.4f}" if "top1" in line else ""
            done_here = (f"loss {line['loss']:.4f}  {line['images_per_sec']:,.0f} images/s" if trained
                         else "trained before the resume")
            metrics.say(f"epoch {epoch}/{epochs} (fit)  {done_here}{acc}")
            if epoch % cfg.checkpoint.every_epochs == 0 or epoch == epochs:
                save(epoch)
            target = cfg.train.target_accuracy
            if target is not None and "top1" in line and top1 >= target:
                summary.update(stopped="target_accuracy", time_to_accuracy_sec=time.time() - start)
                break
        if summary["stopped"] in ("signal", "max_steps"):
            state.position.assign(sum(s.steps for s in segments))
            save(epoch)
    summary.update(top1=top1, top5=top5, images_per_sec=rates, wall_sec=time.time() - start, step=done,
                   epoch=int(state.epoch.numpy()), checkpoint=str(ckpt.latest()) if ckpt.latest() else None)
    return summary
