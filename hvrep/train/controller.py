"""The outer loop of ``hvrep train`` (Orbit's controller): train N steps, evaluate, checkpoint, check for stop.

The controller owns the cadence (``train.log_every``, ``train.eval_every``,
``checkpoint.every_steps`` / ``every_epochs``, ``train.max_steps``, the
target accuracy and the stop agreement on signals); the runner (``steps.py``)
owns the compiled steps. Chief-only actions (writing, printing, saving) were
decided when the writers were built, so nothing here asks for the rank.

Every checkpoint records where the epoch's data stands: the world size, the
global batch and the epoch's segments (``hvrep.data.plan``). A run resumed
at the same size and batch continues the interrupted batches exactly; at
another size or batch it goes on with the samples the epoch has not trained
on yet, with the new batch, and says so.

With tf.data (``data.backend=tfdata``, a folder or indexed TFRecords) one pipeline serves every epoch of
the run (``hvrep.data.tfdata_epochs``): it is built and started once, at the first epoch, each epoch's plan
is computed on tf.data's thread as its turn comes, and its prefetch runs on into the next epoch while this
one ends, is evaluated and saved. A pipeline per epoch cost each epoch its start, the same at any number of
ranks while an epoch's steps shrink with them: on the 2-rank demo 40-61 ms of a ~570 ms epoch
(``input_wait_sec`` in the epoch events), 1-2 ms now (docs/one-host.md).

Elsewhere (DALI, a ``train_dataset`` of the caller's, shards without an index) each epoch has its own: the
next epoch's dataset is built and its first batch read on a background thread as soon as this epoch's last
step has run, while it is evaluated and saved. Either way an error the next epoch's input meets (a missing
shard, a corrupt first image) is raised where that epoch starts.

The finished epoch's iterator is let go on another background thread: deleting a
tf.data iterator waits for its autotuning thread, and on a loaded core that took
up to 1.3 s (``make demo``, rank 1, 2 cores), which the other rank then spent
waiting in its first all-reduce of the next epoch.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorflow as tf

from hvrep.data import DataConfig, EpochPlan, EpochPosition, Segment, data_errors, epoch_plan, make_dataset
from hvrep.errors import DataError
from hvrep.replica import watchdog
from hvrep.train import crash, faultpoint
from hvrep.train.checkpoint import CheckpointManager
from hvrep.train.config import RunConfig
from hvrep.train.metrics import MetricsWriter
from hvrep.train.position import SchedulePosition, announce, trained_samples
from hvrep.train.preemption import stop_on_signals
from hvrep.train.resume import ResumePoint, checkpoint_record, powersgd_record
from hvrep.train.steps import Runner


@dataclasses.dataclass(frozen=True)
class LoopState:
    """The variables a checkpoint carries for the loop: global step, epoch, position (steps) in the epoch."""

    step: tf.Variable
    epoch: tf.Variable
    position: tf.Variable


@dataclasses.dataclass
class _EpochLoop:
    """One epoch's counters on the host: the step is counted here, not read back from the device."""

    epoch: int
    position: int
    at: EpochPosition
    segment_steps: int
    train_examples: int
    step: int
    bar: Any
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    steps_done: int = 0
    in_loop: int = 0  # steps since the last host round-trip
    input_wait: float = 0.0  # seconds the epoch waited for its first batch (in its time, so in its images/s)
    loss_sum: float = 0.0
    correct_sum: int = 0
    segments: list[Segment] = dataclasses.field(default_factory=list)

    def advance(self) -> None:
        self.step += 1
        self.steps_done += 1
        self.segment_steps += 1
        self.in_loop += 1


class Controller:
    """Runs the epochs of one training run.

    Args:
      cfg: the run's configuration.
      runner: the compiled steps.
      state: step, epoch and position variables (restored when resuming).
      checkpoints: saves (chief) and keeps the last ``checkpoint.keep``.
      metrics: metrics.jsonl, TensorBoard and console (chief).
      epochs, steps_per_epoch: the run's length.
      val_images: images in the validation split (for the accuracy's denominator).
      resumed: the checkpoint restored, or None.
      schedule: the learning-rate schedule's position, anchored at every epoch's start to the samples trained.
      schedule_rule: how the schedule's peak was chosen, for the resume's log line.
      train_dataset: builds one replica's training batches of an epoch, with
        ``hvrep.data.make_dataset``'s signature (the default);
        ``benchmarks/loop_overhead.py`` passes a synthetic one to time the loop
        without the input pipeline.
    """

    def __init__(self, cfg: RunConfig, runner: Runner, state: LoopState, checkpoints: CheckpointManager,
                 metrics: MetricsWriter, *, epochs: int, steps_per_epoch: int, val_images: int,
                 schedule: SchedulePosition, resumed: ResumePoint | None = None, schedule_rule: str = "",
                 train_dataset: Callable[..., tf.data.Dataset] = make_dataset) -> None:
        self.cfg = cfg
        self.train_dataset = train_dataset
        self.runner = runner
        self.state = state
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.val_images = val_images
        self.resumed = resumed
        self.schedule = schedule
        self.schedule_rule = schedule_rule
        self._announced = False
        # An elastic run's commits (hvrep.train.elastic.ElasticLoop sets it), or None.
        self.elastic: Any = None

    def _save(self, epoch: int, segments: list[Segment], train_examples: int) -> None:
        """Saves on every rank's call (the chief writes), with where the epoch's data stands."""
        watchdog.note_step(f"checkpoint at step {int(self.state.step.numpy())}")
        self.runner.prepare_checkpoint()
        n, gb = self.runner.repl.num_replicas, self.cfg.train.global_batch
        self.checkpoints.save(int(self.state.step.numpy()), metadata=checkpoint_record(
            epoch=epoch, segments=segments, world_size=n, global_batch=gb, train_examples=train_examples,
            samples_per_epoch=self.schedule.schedule.samples_per_epoch, epochs=self.epochs,
            lr=self.schedule.schedule.at_epoch, loop="custom",
            accumulation=self.runner.accumulation_record(), local_sgd=self.runner.local_sgd_record(),
            powersgd=powersgd_record(self.runner.repl.config)))

    def _anchor(self, epoch: int, at: EpochPosition) -> None:
        """Anchors the schedule at the samples trained before this epoch's first step; logs a resume once."""
        gb = self.cfg.train.global_batch
        lr = self.schedule.anchor(trained_samples(epoch, at, gb, self.schedule.schedule.samples_per_epoch))
        if self.resumed is not None and not self._announced:
            self._announced = True
            announce(self.metrics, self.resumed.metadata, step=int(self.state.step.numpy()), global_batch=gb, lr=lr,
                     epochs_trained=self.schedule.epochs(), rule=self.schedule_rule)

    def _position(self, epoch: int, plan: EpochPlan, segments: list[Segment]) -> tuple[EpochPosition, int]:
        """Where this epoch's data resumes, and the steps left in it; says when the size or batch changed."""
        n, gb = self.runner.repl.num_replicas, self.cfg.train.global_batch
        saved = self.resumed.metadata.get("train_examples") if self.resumed else None
        if segments and saved is not None and saved != plan.num_samples:
            raise DataError(
                f"the checkpoint resumed from was trained on {saved} training samples, but {self.cfg.data.data_dir} "
                f"holds {plan.num_samples}: the interrupted epoch cannot go on. Fix: resume with the data set it "
                "was trained on."
            )
        at = EpochPosition.resume(segments, n, gb)
        left = plan.steps(n, gb // n, at) - at.steps
        if at.done and at.steps == 0:
            last, trained = at.done[-1], sum(s.steps * s.global_batch for s in at.done)
            self.metrics.write("resume", int(self.state.step.numpy()), epoch=epoch, trained_samples=trained,
                               samples=plan.num_samples, replicas=[last.replicas, n],
                               global_batch=[last.global_batch, gb], rule=plan.rule(n), steps=left)
            self.metrics.say(
                f"epoch {epoch + 1} resumes after {trained} of its {plan.num_samples} samples: world size "
                f"{last.replicas} -> {n}, global batch {last.global_batch} -> {gb}. The samples it has not trained "
                f"on go on from the next one, dealt {plan.rule(n)} to {n} replica(s): {left} steps of {gb}.")
        return at, left

    def _epoch_config(self, epoch: int) -> DataConfig:
        """An epoch's data config: its own seed (its order and its augmentation)."""
        cfg = self.cfg
        return dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000 + epoch)

    def _epoch_input(self, epoch: int, segments: list[Segment]) -> tuple[Any, EpochPlan, EpochPosition, int,
                                                                         Callable[[Any], Any]]:
        """An epoch's data config (its seed), plan, position, steps left, and the input_fn of its batches."""
        cfg = self.cfg
        epoch_cfg = self._epoch_config(epoch)
        plan = epoch_plan(epoch_cfg, "train")
        at, left = self._position(epoch, plan, segments)

        def train_input(ctx: Any) -> Any:
            # Resuming mid-epoch drops the trained batches before anything is read.
            return self.train_dataset(epoch_cfg, "train", ctx, position=at, threads=cfg.train.threads)

        return epoch_cfg, plan, at, left, train_input

    def _loop_ends(self, lp: _EpochLoop) -> bool:
        """A loop ends after ``steps_per_loop`` steps, and at every log, checkpoint and max_steps boundary."""
        t = self.cfg.train
        every = self.cfg.checkpoint.every_steps
        return (lp.in_loop >= t.steps_per_loop or lp.step % t.log_every == 0 or bool(every and lp.step % every == 0)
                or bool(t.max_steps and lp.step >= t.max_steps) or bool(self.elastic and self.elastic.due(lp.step)))

    def _end_of_loop(self, lp: _EpochLoop, stop: Any) -> str | None:
        """One host round-trip: the loop's totals and the stop agreement in one reduce, then the actions due at
        this step. Returns why to stop ("signal", "max_steps"), or None."""
        cfg, state, repl = self.cfg, self.state, self.runner.repl
        n, gb = repl.num_replicas, cfg.train.global_batch
        state.step.assign(lp.step)
        state.position.assign(lp.position + lp.steps_done)
        lp.segments = lp.at.segments(n, gb, lp.segment_steps)
        # Agree on stopping (a signal may have reached only some ranks) in the reduce of the totals: one
        # collective, where StopRequest.agreed would add a second per loop.
        if faultpoint.ARMED:  # the fault campaign's points (benchmarks/faults.py); False otherwise
            faultpoint.reached("step.collective")
        flags = repl.reduce({"stop": tf.constant(int(stop.requested)), "totals": self.runner.totals()}, "sum")
        self.runner.reset_totals()
        lp.loss_sum += float(flags["totals"][0]) / n
        lp.correct_sum += int(flags["totals"][1])
        ips = lp.steps_done * gb / max(time.perf_counter() - lp.t0, 1e-9)
        lp.bar.set_postfix(loss=f"{lp.loss_sum / lp.steps_done:.3f}", img_s=f"{ips:,.0f}")
        lp.bar.update(lp.in_loop)
        lp.in_loop = 0
        if lp.step % cfg.train.log_every == 0:
            lr = float(tf.convert_to_tensor(self.runner.optimizer.learning_rate))
            self.metrics.write("train", lp.step, epoch=lp.epoch, loss=lp.loss_sum / lp.steps_done, lr=lr,
                               images_per_sec=ips, train_top1=lp.correct_sum / (lp.steps_done * gb))
        if cfg.checkpoint.every_steps and lp.step % cfg.checkpoint.every_steps == 0:
            self._save(lp.epoch, lp.segments, lp.train_examples)
        if self.elastic is not None and self.elastic.due(lp.step):
            self.elastic.commit(lp.step, lp.epoch, lp.position + lp.steps_done, lp.segments)
        if faultpoint.ARMED:
            faultpoint.reached("step.between")
        if int(flags["stop"]) > 0:
            return "signal"
        if cfg.train.max_steps and lp.step >= cfg.train.max_steps:
            return "max_steps"
        return None

    def _whole_run_batches(self, epoch: int, at: EpochPosition) -> Iterator[Any] | None:
        """The batches of every epoch from ``epoch`` (from ``at``) to the last, from one pipeline built once
        (``hvrep.data.tfdata_epochs``); None where it does not apply (DALI, a ``train_dataset`` of the caller's,
        TFRecord shards without an index), and each epoch builds its own."""
        cfg = self.cfg
        if self.train_dataset is not make_dataset or cfg.data.backend != "tfdata":
            return None
        import hvrep.data

        if not hvrep.data.tfdata_epochs_apply(cfg.data):
            return None

        def train_input(ctx: Any) -> Any:
            return hvrep.data.tfdata_epochs(self._epoch_config, epoch, self.epochs, ctx, position=at,
                                            threads=cfg.train.threads)

        return iter(self.runner.repl.distribute_dataset(train_input, global_batch_size=cfg.train.global_batch))

    @staticmethod
    def _epoch_of(whole: Iterator[Any], steps: int) -> tuple[Iterator[Any], Any]:
        """The next ``steps`` batches of the run's one pipeline, as :meth:`_batches` gives an epoch's."""
        it = itertools.islice(whole, steps)
        return it, next(it, None)

    def _batches(self, train_input: Callable[[Any], Any]) -> tuple[Iterator[Any], Any]:
        """An epoch's iterator and its first batch (None if it has none): the part of starting an epoch that
        waits on the input pipeline, run ahead on the controller's thread."""
        it = iter(self.runner.repl.distribute_dataset(train_input, global_batch_size=self.cfg.train.global_batch))
        return it, next(it, None)

    @staticmethod
    def _chained(started: tuple[Iterator[Any], Any]) -> Iterator[Any]:
        it, first = started
        return it if first is None else itertools.chain([first], it)

    def run(self) -> dict[str, Any]:
        """Trains until the last epoch, ``max_steps``, the target accuracy or a signal.

        Returns:
          {"stopped": "completed" | "max_steps" | "target_accuracy" | "signal",
          "time_to_accuracy_sec"?, "top1", "top5", "images_per_sec" (per-epoch rates), "wall_sec"}.
        """
        cfg, state, epochs = self.cfg, self.state, self.epochs
        repl = self.runner.repl
        n, gb = repl.num_replicas, cfg.train.global_batch
        start_time = time.time()
        summary: dict[str, Any] = {"stopped": "completed"}
        top1 = top5 = float("nan")
        images_per_sec: list[float] = []
        if self.elastic is not None:  # where the last commit stands (the loop's variables are set from it)
            segments = self.elastic.enter()
        else:
            segments = self.resumed.segments(n, gb) if self.resumed else []
        train_examples = 0
        # The next epoch's input (its _epoch_input and the future of its _batches), starting on `pool` while this
        # epoch is evaluated and saved (see the module docstring).
        ahead: tuple[tuple[Any, ...], Future] | None = None
        # The run's one pipeline for every epoch (_whole_run_batches), built at the first epoch; False where each
        # epoch builds its own.
        whole: Any = None
        with (stop_on_signals() as stop, ThreadPoolExecutor(1, thread_name_prefix="hvrep-next-epoch") as pool,
              ThreadPoolExecutor(1, thread_name_prefix="hvrep-release") as release):
            epoch = int(state.epoch.numpy())
            while epoch < epochs:
                position = int(state.position.numpy())
                epoch_input, pending = ahead if ahead is not None else (self._epoch_input(epoch, segments), None)
                ahead = None
                epoch_cfg, plan, at, left, train_input = epoch_input
                train_examples = plan.num_samples
                self.metrics.mark("epoch_start", epoch=epoch)
                self._anchor(epoch, at)
                lp = _EpochLoop(epoch=epoch, position=position, at=at, segment_steps=at.steps,
                                train_examples=train_examples, step=int(state.step.numpy()), segments=segments,
                                bar=self.metrics.progress(position + left, position, f"epoch {epoch + 1}/{epochs}",
                                                          every=cfg.train.log_every))
                self.runner.reset_totals()
                with data_errors(epoch_cfg, "train"):
                    # Waiting here, if the pipeline is not ready yet, counts in the epoch's time.
                    if whole is None:
                        whole = (self._whole_run_batches(epoch, at) if pending is None else None) or False
                    if whole:
                        started = self._epoch_of(whole, left)
                    else:
                        started = pending.result() if pending is not None else self._batches(train_input)
                    lp.input_wait = time.perf_counter() - lp.t0
                    for x, y in self._chained(started):
                        # The outputs are not read here: the next step is dispatched without waiting on the host.
                        watchdog.note_step(f"train step {lp.step + 1}")  # what a timeout report names
                        crash.note_step(lp.step + 1, x, y)  # what a native crash's report names
                        self.runner.train(x, y)
                        lp.advance()
                        if self.elastic is not None:
                            self.elastic.state.step = lp.step  # live: a rollback says how many steps it undid
                        if self._loop_ends(lp) and (reason := self._end_of_loop(lp, stop)):
                            summary["stopped"] = reason
                            break
                    else:
                        if lp.in_loop and (reason := self._end_of_loop(lp, stop)):  # the epoch's last, shorter loop
                            summary["stopped"] = reason
                # The finished epoch's iterator (held by `started` and by `pending`'s result) is deleted on
                # `release`, not here and not when the next epoch's replaces it (see the module docstring).
                finished: list[Any] = [started, pending]
                started = pending = None
                release.submit(finished.clear)
                del finished
                segments = lp.segments
                loss_sum, correct_sum, steps_done, bar, t0 = lp.loss_sum, lp.correct_sum, lp.steps_done, lp.bar, lp.t0
                input_wait = lp.input_wait
                bar.close()
                elapsed = time.perf_counter() - t0
                if steps_done:
                    images_per_sec.append(steps_done * gb / elapsed)
                if summary["stopped"] in ("signal", "max_steps"):
                    break
                epoch += 1
                segments = []
                if epoch < epochs and not whole:
                    following = self._epoch_input(epoch, [])
                    ahead = (following, pool.submit(self._batches, following[4]))
                state.epoch.assign(epoch)
                state.position.assign(0)
                # An epoch resumed at its end (stopped after its last step) trained nothing here: no loss or rate.
                line: dict[str, Any] = {"epoch": epoch}
                if steps_done:
                    line.update(loss=loss_sum / steps_done, images_per_sec=images_per_sec[-1],
                                train_top1=correct_sum / (steps_done * gb), input_wait_sec=input_wait)
                if epoch % cfg.train.eval_every == 0 or epoch == epochs:
                    watchdog.note_step(f"evaluation after epoch {epoch}")
                    self.metrics.mark("eval_start", epoch=epoch)
                    top1, top5 = self.runner.evaluate(cfg.data, self.val_images, gb // n, cfg.train.threads)
                    line.update(top1=top1, top5=top5)
                self.metrics.write("epoch", int(state.step.numpy()), **line)
                acc = f"  val top-1 {top1:.4f} top-5 {top5:.4f}" if "top1" in line else ""
                trained = (f"loss {line['loss']:.4f}  {line['images_per_sec']:,.0f} images/s" if steps_done
                           else "trained before the resume")
                self.metrics.say(f"epoch {epoch}/{epochs}  {trained}{acc}")
                if epoch % cfg.checkpoint.every_epochs == 0 or epoch == epochs:
                    self._save(epoch, segments, train_examples)
                if self.elastic is not None:
                    self.elastic.commit(int(state.step.numpy()), epoch, 0, [])
                target = cfg.train.target_accuracy
                if target is not None and "top1" in line and top1 >= target:
                    summary["stopped"] = "target_accuracy"
                    summary["time_to_accuracy_sec"] = time.time() - start_time
                    break
            if ahead is not None:
                ahead[1].cancel()  # the run stopped before the epoch it started; the pool's exit waits for it
            if whole:  # its iterator, like an epoch's, is deleted on `release`
                left_over: list[Any] = [whole]
                whole = None
                release.submit(left_over.clear)
                del left_over
            if summary["stopped"] in ("signal", "max_steps"):
                self._save(int(state.epoch.numpy()), segments, train_examples)
        summary.update(top1=top1, top5=top5, images_per_sec=images_per_sec, wall_sec=time.time() - start_time)
        return summary
