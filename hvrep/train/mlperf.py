"""MLPerf Training logs of ``hvrep train`` (``train.mllog=<file>``): the events of a ResNet-50 run, from the chief.

    hvrep train --config demo train.mllog=runs/demo/mlperf.log
    python -m mlperf_logging.compliance_checker --usage training --ruleset 4.0.0 runs/demo/mlperf.log

The log is a :class:`~hvrep.train.metrics.Listener` of the chief's metrics
writer, chosen once when the run starts (:func:`listeners`; every other rank
gets none). It turns the run's own events into ``mlperf_logging.mllog`` lines:

- at start-up: ``cache_clear``, ``init_start`` (when ``hvrep train`` began),
  ``submission_*``;
- on metrics.jsonl's ``config`` event (the optimizer, its schedule and the run's
  length are built): ``global_batch_size``, ``train_samples``, ``eval_samples``,
  ``gradient_accumulation_steps``, ``seed``, ``opt_name``, the optimizer's
  hyperparameters, ``model_bn_span``, then ``init_stop`` and ``run_start``;
- per epoch: ``epoch_start`` (``MetricsWriter.mark``), ``epoch_stop`` and
  ``eval_start`` (the evaluation's mark), ``eval_stop`` and ``eval_accuracy``
  (the ``epoch`` event, with its top-1);
- on the ``final`` event: ``run_stop`` with status "success" (the target
  accuracy reached, or, without ``train.target_accuracy``, every epoch trained)
  or "aborted" (a signal, ``train.max_steps``, the watchdog, or a target
  missed).

Every hyperparameter is read from what the run built, as metrics.jsonl's
``config`` event records it (the optimizer's Keras ``get_config()``, with its
``EpochSchedule``), not derived again from the settings. hvrep's schedule runs
on samples trained, so the MLPerf keys in steps and epochs are converted from
it: warmup epochs = warmup samples / samples per epoch, decay steps = the
optimizer steps the run trains after the warmup.

MLPerf allows one ``run_start`` per log, so a resumed attempt writes a new file:
``train.mllog=mlperf.log`` is refused when ``mlperf.log`` exists, unless
``--resume`` (then ``mlperf.2.log``, ``mlperf.3.log`` ...: the next free name) or
``--overwrite`` with the log inside ``output_dir`` (it moves aside with the run).
docs/mlperf.md says what each event holds and which closed-division checks a
demo run fails.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from hvrep.errors import ConfigError
from hvrep.train import rundir
from hvrep.train.config import RunConfig
from hvrep.train.metrics import Listener

BENCHMARK = "resnet"  # submission_benchmark: hvrep train's model is a ResNet (ResNet-50 v1.5 for ImageNet)
_OPT_NAMES = {"LARS": "lars", "MomentumSGD": "sgd"}  # the optimizer classes ruleset 4.0.0 names for ResNet


def log_path(cfg: RunConfig, resume: bool, overwrite: bool) -> Path | None:
    """The file this attempt's MLPerf log goes to (None without ``train.mllog``); checked before TensorFlow starts.

    Raises:
      ConfigError: the file exists and this is not a resumed attempt (nor ``--overwrite`` moving it aside).
    """
    if cfg.train.mllog is None:
        return None
    path = Path(cfg.train.mllog)
    if not path.exists():
        return path
    if resume:
        k = 2
        while (candidate := path.with_name(f"{path.stem}.{k}{path.suffix}")).exists():
            k += 1
        return candidate
    if rundir.joins_running_job(cfg.output_dir):
        return path  # an elastic worker joining the job that writes it (the chief writes the log)
    output_dir = Path(cfg.output_dir).resolve()
    if overwrite and output_dir in path.resolve().parents:
        return path  # --overwrite moves output_dir, and the log with it, aside before the log is written
    raise ConfigError(
        f"train.mllog={cfg.train.mllog} exists: an MLPerf log holds one run (one run_start). Fix: another file "
        f"name, remove it, or --resume to continue that run (its log then goes to "
        f"{path.with_name(f'{path.stem}.2{path.suffix}')}).")


def listeners(cfg: RunConfig, *, chief: bool, resume: bool, overwrite: bool, started: float) -> list[Listener]:
    """The chief's MLPerf log when ``train.mllog`` is set, else nothing; call once, after ``--overwrite`` moved
    the old run aside.

    Args:
      started: when ``hvrep train`` began (seconds since the epoch): the log's ``init_start``.
    """
    path = log_path(cfg, resume, overwrite) if chief else None
    return [MLPerfLog(path, cfg, started)] if path is not None else []


class MLPerfLog:
    """Writes one attempt's MLPerf Training log to ``path`` (created; never appended to)."""

    def __init__(self, path: Path, cfg: RunConfig, started: float) -> None:
        from mlperf_logging.mllog import constants, mllog

        self.path = path
        self._cfg = cfg
        self._keys = constants
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = logging.FileHandler(path, mode="x", encoding="utf-8")  # "x": never into another run's log
        logger = logging.Logger(f"hvrep.mlperf.{path}")  # not the shared "mllog" logger: one file per MLPerfLog
        logger.propagate = False
        logger.addHandler(self._handler)
        # stack offset 1: the call site recorded in each line's metadata is this module's.
        self._log = mllog.MLLogger(logger=logger, default_stack_offset=1, root_dir=str(Path(__file__).parents[2]))
        self._epoch_open: int | None = None
        self._stopped = False
        t = self._cfg.train
        k = self._keys
        self._log.event(k.CACHE_CLEAR, value=t.mllog_cache_clear)
        self._log.start(k.INIT_START, time_ms=int(started * 1e3))
        self._log.event(k.SUBMISSION_BENCHMARK, value=BENCHMARK)
        self._log.event(k.SUBMISSION_DIVISION, value=t.mllog_division)
        self._log.event(k.SUBMISSION_ORG, value=t.mllog_org)
        self._log.event(k.SUBMISSION_STATUS, value=t.mllog_status)

    def hear(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        k = self._keys
        if event == "config":
            self._start(values)
        elif event == "epoch_start":
            self._epoch_open = int(values["epoch"]) + 1
            self._log.start(k.EPOCH_START, metadata={k.EPOCH_NUM: self._epoch_open})
        elif event == "eval_start":
            self._end_epoch()
            self._log.start(k.EVAL_START, metadata={k.EPOCH_NUM: int(values["epoch"])})
        elif event == "epoch":
            self._end_epoch()
            if "top1" in values:
                meta = {k.EPOCH_NUM: int(values["epoch"])}
                self._log.end(k.EVAL_STOP, metadata=meta)
                self._log.event(k.EVAL_ACCURACY, value=float(values["top1"]), metadata=meta)
        elif event == "final" and not self._stopped:
            self._stopped = True
            target = self._cfg.train.target_accuracy
            reached = values.get("stopped") == "target_accuracy" or (
                values.get("stopped") == "completed" and target is None)
            self._log.end(k.RUN_STOP, metadata={k.STATUS: k.SUCCESS if reached else k.ABORTED})

    def close(self) -> None:
        self._handler.close()

    def _end_epoch(self) -> None:
        if self._epoch_open is not None:
            self._log.end(self._keys.EPOCH_STOP, metadata={self._keys.EPOCH_NUM: self._epoch_open})
            self._epoch_open = None

    def _start(self, values: dict[str, Any]) -> None:
        """The run's constants and hyperparameters (from the ``config`` event), then ``init_stop``, ``run_start``."""
        k = self._keys
        config, env = values["config"], values.get("env", {})
        replicas = int(values["replicas"])
        platform = self._cfg.train.mllog_platform or f"{replicas}x{'GPU' if env.get('gpus') else 'CPU'}"
        self._log.event(k.SUBMISSION_PLATFORM, value=platform)
        schedule = _Schedule.of(values["optimizer_config"]["learning_rate"])
        self._log.event(k.GLOBAL_BATCH_SIZE, value=schedule.samples_per_step)
        self._log.event(k.TRAIN_SAMPLES, value=int(values["train_images"]))
        self._log.event(k.EVAL_SAMPLES, value=int(values["val_images"]))
        self._log.event(k.GRADIENT_ACCUMULATION_STEPS, value=int(config["comm"]["accumulation_steps"]))
        self._log.event(k.SEED, value=int(config["train"]["seed"]))
        # Batch norm is per replica (hvrep.layers.FusedBatchNormalization, no cross-replica statistics), over one
        # micro-batch of train.global_batch / replicas.
        self._log.event(k.MODEL_BN_SPAN, value=int(config["train"]["global_batch"]) // replicas)
        for key, value in hyperparameters(values["optimizer"], values["optimizer_config"], int(values["epochs"]),
                                          int(values["steps_per_epoch"]),
                                          int(config["comm"]["accumulation_steps"])).items():
            self._log.event(key, value=value)
        self._log.end(k.INIT_STOP)
        self._log.start(k.RUN_START)


class _Schedule:
    """The learning-rate schedule as the optimizer's config holds it (``hvrep.schedules.EpochSchedule``), in
    samples: warmup from ``start`` to ``peak`` over ``warmup`` samples, then the decay until ``total``."""

    def __init__(self, decay: str, inner: dict[str, Any], samples_per_epoch: int, samples_per_step: int) -> None:
        self.decay = decay
        self.inner = inner
        self.samples_per_epoch = samples_per_epoch
        self.samples_per_step = samples_per_step

    @classmethod
    def of(cls, learning_rate: dict[str, Any]) -> _Schedule:
        """From the optimizer config's ``learning_rate``: hvrep train's optimizers always have an EpochSchedule."""
        outer = learning_rate["config"]
        inner = outer["schedule"]
        return cls(inner["class_name"], inner["config"], int(outer["samples_per_epoch"]),
                   int(outer["samples_per_step"]))

    def end_lr(self) -> float:
        """The LR the schedule ends at (after ``total`` samples)."""
        c = self.inner
        if "end_lr" in c:
            return float(c["end_lr"])
        if "boundaries" in c:
            return float(c["peak_lr"]) * float(c["factor"]) ** len(c["boundaries"])
        return float(c["peak_lr"])


def hyperparameters(optimizer: str, optimizer_config: dict[str, Any], epochs: int, steps_per_epoch: int,
                    accumulation_steps: int) -> dict[str, Any]:
    """The MLPerf keys of an optimizer and its schedule, as built (``get_config()``), for ruleset 4.0.0's ResNet.

    Args:
      optimizer: the optimizer's class name ("LARS", "MomentumSGD"); ``opt_name`` is "lars" or "sgd", else the
        class name in lower case.
      optimizer_config: its Keras ``get_config()`` (with the ``EpochSchedule`` hvrep train builds).
      epochs, steps_per_epoch: the run's length (steps of ``train.global_batch``).
      accumulation_steps: micro-batches per optimizer step.
    """
    from mlperf_logging.mllog import constants as k

    name = _OPT_NAMES.get(optimizer, optimizer.lower())
    schedule = _Schedule.of(optimizer_config["learning_rate"])
    c, n = schedule.inner, schedule.samples_per_epoch
    warmup_epochs = float(c["warmup_steps"]) / n
    out: dict[str, Any] = {k.OPT_NAME: name}
    prefix = "lars_opt" if name == "lars" else f"{name}_opt"
    out[f"{prefix}_base_learning_rate"] = float(c["peak_lr"])
    out[f"{prefix}_end_learning_rate"] = schedule.end_lr()
    if schedule.decay == "PolynomialDecayWithWarmup":
        out[f"{prefix}_learning_rate_decay_poly_power"] = float(c["power"])
    else:  # not the reference's polynomial decay: say which (the closed division then fails the power's check)
        out[k.OPT_LR_ALT_DECAY_FUNC] = {"CosineDecayWithWarmup": "cosine", "StepDecayWithWarmup": "step",
                                        "ConstantWithWarmup": "constant"}.get(schedule.decay, schedule.decay)
        if "boundaries" in c:
            out[k.OPT_LR_DECAY_BOUNDARY_EPOCHS] = [b / n for b in c["boundaries"]]
            out[k.OPT_LR_DECAY_FACTOR] = float(c["factor"])
    out[f"{prefix}_learning_rate_decay_steps"] = decay_steps(
        warmup_samples=int(c["warmup_steps"]), samples_per_epoch=n, samples_per_step=schedule.samples_per_step,
        epochs=epochs, updates_per_epoch=steps_per_epoch // max(accumulation_steps, 1))
    # ruleset 4.0.0 names LARS's warmup lars_opt_learning_rate_warmup_epochs, SGD's opt_learning_rate_warmup_epochs.
    out[f"{prefix}_learning_rate_warmup_epochs" if name == "lars" else k.OPT_LR_WARMUP_EPOCHS] = warmup_epochs
    out[k.OPT_LR_WARMUP_START_LR] = float(c.get("warmup_start_lr", 0.0))
    out[f"{prefix}_momentum"] = float(optimizer_config.get("momentum", 0.0))
    out[f"{prefix}_weight_decay"] = float(optimizer_config.get("weight_decay") or 0.0)
    if name == "lars":
        out[k.LARS_EPSILON] = float(optimizer_config.get("epsilon", 0.0))
    return out


def decay_steps(*, warmup_samples: int, samples_per_epoch: int, samples_per_step: int, epochs: int,
                updates_per_epoch: int) -> int:
    """Optimizer steps the run trains after the warmup.

    The schedule stands at ``e * samples_per_epoch`` at epoch ``e``'s first step (``position.py``) and moves by
    ``samples_per_step`` each step: step ``i`` of epoch ``e`` is in the decay when ``e * samples_per_epoch + i *
    samples_per_step >= warmup_samples``.
    """
    total = 0
    for e in range(epochs):
        before = warmup_samples - e * samples_per_epoch
        first = 0 if before <= 0 else math.ceil(before / max(samples_per_step, 1))
        total += max(0, updates_per_epoch - first)
    return total
