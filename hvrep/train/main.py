"""``hvrep train`` / ``python -m hvrep.train``: a ResNet training run assembled from its configuration.

    horovodrun -np 8 hvrep train --config resnet50_imagenet data.data_dir=/data/imagenet-tfr
    hvrep train --config demo                      # the embedded digits, one process
    hvrep train --config demo --resume             # continue from the last checkpoint

The loop owns what TF-Replicator's users wrote by hand: the replicated step
(``hvrep.Replicator``), the input pipeline (``hvrep.data``), the large-batch
recipe, exact global evaluation (top-1/top-5 over all replicas, padding
excluded), a target accuracy that stops the run, atomic checkpoints of model,
optimizer (and gradient accumulation), step, epoch and where the epoch's data
stands (world size, global batch, segments), resuming on every rank from the
chief's checkpoint (``resume.py``) at the same or another world size, and a
clean stop on SIGTERM / SIGUSR1 that every rank agrees on. Only the chief prints, writes TensorBoard
summaries and ``metrics.jsonl``, and saves.

This module builds the run (replicator, data sizes, model, optimizer, state,
checkpoints, writers) and parses ``hvrep train``'s flags; ``controller.py``
owns the loop's cadence and ``steps.py`` the compiled steps (Orbit's split).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from hvrep.errors import EXIT_INTERRUPTED, EXIT_NO_SPACE, EXIT_OK, EXIT_USAGE, HvrepError
from hvrep.replica import cores
from hvrep.train import config as configs
from hvrep.train import mlperf, rundir

# Exit codes of `hvrep train`: hvrep.errors.EXIT_CODES (docs/troubleshooting.md, "Exit codes"). A run stopped by
# SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) has saved where it stands and exits 0 like a finished one: its last line and
# metrics.jsonl's `final` event (stopped="signal") say so.


_NO_SPACE_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def _no_space(err: BaseException) -> bool:
    """Whether ``err`` or an error it was raised from is a full file system (ENOSPC) or quota (EDQUOT):
    TensorFlow's save ops carry it in their message only."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if type(cause).__module__.startswith("tensorflow") and any(t in str(cause) for t in _NO_SPACE_TEXTS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _first_line(err: BaseException) -> str:
    """``err``'s message on one line: a TensorFlow op error's first line, without its ``{{function_node …}}``."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\{\{[^}]*\}\}\s*", "", text)


def _model(cfg: configs.RunConfig) -> Any:
    from hvrep import models

    m, size = cfg.model, cfg.data.image_size
    shape = (size, size, 3) if m.data_format == "channels_last" else (3, size, size)
    if m.name == "resnet50":
        return models.resnet50(m.num_classes, shape, m.data_format, m.zero_init_residual)
    return models.small_resnet(m.num_classes, shape, m.data_format, width=m.width,
                               zero_init_residual=m.zero_init_residual)


def run(cfg: configs.RunConfig, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Trains; returns the final summary (the same on every rank).

    Args:
      resume: continue from the newest checkpoint of ``cfg.output_dir``.
      overwrite: start over in an ``output_dir`` that holds checkpoints, moving the old run aside (the chief).

    Raises:
      ConfigError: ``output_dir`` holds checkpoints and neither ``resume`` nor ``overwrite`` was given, or the
        data folder is missing or of another format (checked before TensorFlow is imported).
    """
    started = time.time()  # the MLPerf log's init_start
    rundir.check_data_dir(cfg.data)
    rundir.check_output_dir(cfg.output_dir, resume, overwrite)
    mlperf.log_path(cfg, resume, overwrite)
    from hvrep import _env

    elastic = _env.horovod_elastic()
    # A worker the elastic driver added to the running job: the others are past the start (its barrier, the
    # resume) and wait for it in the state's sync, so it must skip straight there. Decided before the Replicator:
    # the chief records the job only after every worker of the first world has joined the rendezvous.
    joining = elastic and rundir.joins_running_job(cfg.output_dir)
    resume = resume and not joining  # the job's state comes from rank 0's sync
    if elastic:
        cfg.elastic.check_batch(cfg.train.global_batch)
        configs.check_combinations(cfg, elastic=True)  # the support table's refusals of elastic runs

    _env.quiet_tensorflow_logs()
    import keras
    import tensorflow as tf

    import hvrep
    from hvrep import kernels, schedules
    from hvrep.data import num_examples, write_demo
    from hvrep.replica import watchdog
    from hvrep.train import crash
    from hvrep.train import optim as optimizers
    from hvrep.train import resume as resuming
    from hvrep.train.checkpoint import CheckpointManager
    from hvrep.train.controller import Controller, LoopState
    from hvrep.train.metrics import MetricsWriter
    from hvrep.train.position import SchedulePosition
    from hvrep.train.steps import Runner

    # The rank's CPU budget, from its place on the node (the launcher's variables) before TensorFlow's runtime
    # starts (its pools are fixed then); the resolved values replace the settings, so the data pipeline gets
    # them and metrics.jsonl records them.
    placement = hvrep.resolve_placement()
    # Elastic: no binding. Several "hosts" may be one machine, each rank local rank 0 of its own, and local ranks
    # change at each reset: binding by local rank would put them on the same cores.
    launcher_binds = placement.launcher != "horovodrun"  # horovodrun binds no rank: they share what they inherit
    budget = cores.default_budget(cfg.train.threads, False if elastic else cfg.train.bind_cores, placement.local_size,
                                  launcher_binds=launcher_binds)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, threads=budget.threads,
                                                             bind_cores=budget.bind))
    if cfg.train.threads is not None:
        cores.set_pools(cfg.train.threads, f"train.threads={cfg.train.threads}")
    if cfg.train.precision != "fp32":
        keras.mixed_precision.set_global_policy("mixed_float16" if cfg.train.precision == "fp16" else "mixed_bfloat16")
    repl = hvrep.Replicator("auto", config=cfg.comm, cpu_budget="off")  # applied above, from the settings
    chief, n = repl.is_chief, repl.num_replicas
    binding = (cores.bind_cores(repl.local_rank, repl.local_size, cfg.train.threads, launcher_binds=launcher_binds)
               if cfg.train.bind_cores
               else cores.Binding(cores.current_cores(), bound_here=False))
    out = Path(cfg.output_dir)
    demo_root = _env.cache_dir() / "demo-data"
    if chief and Path(cfg.data.data_dir).parent == demo_root:
        write_demo(demo_root)  # once; every rank waits below
    moved = rundir.move_aside(out) if chief and overwrite and rundir.holds_checkpoints(out) else None
    if chief and elastic:
        rundir.mark_elastic_job(out)  # so a worker joining later accepts the job's own checkpoints
    if not joining:
        repl.reduce(tf.constant(0), "sum")
    skipped = _skipped_files(cfg) if chief and cfg.data.on_error == "skip" else None

    gb = cfg.train.global_batch
    if gb % n:
        raise HvrepError(f"train.global_batch={gb} must divide by the {n} replicas. Fix: use {max(1, gb // n) * n}.")
    # A rank killed by a signal (a native crash) is reported with the step and shapes it was running.
    crash.start(out, repl.rank)
    train_images = num_examples(cfg.data, "train")
    val_images = num_examples(cfg.data, "val")
    steps_per_epoch = schedules.steps_per_epoch(train_images, gb)

    keras.utils.set_random_seed(cfg.train.seed)
    if cfg.train.loop == "fit":
        return _run_fit(cfg, repl, resume, steps_per_epoch, train_images, val_images, binding, moved, skipped,
                        budget, mlperf.listeners(cfg, chief=chief, resume=resume, overwrite=overwrite, started=started))
    with repl.scope():
        model = _model(cfg)
        optim = optimizers.build(cfg, train_images)
        optimizer = optim.optimizer
        if cfg.train.precision == "fp16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        state = LoopState(step=tf.Variable(0, dtype=tf.int64, trainable=False, name="step"),
                          epoch=tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch"),
                          position=tf.Variable(0, dtype=tf.int64, trainable=False, name="position"))
    runner = Runner(repl, model, optimizer, num_classes=cfg.model.num_classes, label_smoothing=optim.label_smoothing,
                    fp16=cfg.train.precision == "fp16", jit_compile=cfg.train.jit_compile)
    extra_state = {"accumulation": runner.accumulation} if runner.accumulation is not None else {}
    if runner.local_sgd is not None:
        extra_state["local_sgd"] = runner.local_sgd
    if runner.powersgd is not None:
        extra_state["powersgd"] = runner.powersgd
    ckpt = CheckpointManager(out / "checkpoints", is_chief=chief, keep=cfg.checkpoint.keep, model=model,
                             optimizer=optimizer, step=state.step, epoch=state.epoch, position=state.position,
                             **extra_state)
    # Every rank restores the chief's newest checkpoint, or every rank stops saying why.
    resumed = resuming.restore(repl, ckpt, cfg.comm.accumulation_steps, runner.local_sgd_record(),
                               resuming.powersgd_record(repl.config)) if resume else None
    restored = resumed.folder if resumed else None
    if resumed:
        optimizers.follow_checkpoint(cfg, optim, resumed.metadata, train_images)
    schedule = SchedulePosition(optim.schedule, optimizer, gb * cfg.comm.accumulation_steps)

    # Chief-only output is decided here, once: other ranks get a writer that does nothing.
    metrics = MetricsWriter(out, chief, mlperf.listeners(cfg, chief=chief, resume=resume, overwrite=overwrite,
                                                         started=started))
    _last_words(watchdog.current(), metrics, ckpt.latest)
    fast_path = {"precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile,
                 "input": cfg.data.backend, "compression": cfg.comm.compression,
                 "fusion_threshold_bytes": cfg.comm.fusion_threshold_bytes, "num_groups": cfg.comm.num_groups,
                 "kernels": kernels.status().describe()}
    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": cfg.train.threads,
           "cores": list(binding.cores), "bound_here": binding.bound_here, "cpu_budget": budget.why,
           "gpus": [d.name for d in tf.config.list_logical_devices("GPU")], "tensorflow": tf.__version__}
    epochs = optim.epochs
    metrics.write("config", config=configs.to_dict(cfg), replicas=n, backend=repl.backend, fast_path=fast_path, env=env,
                  optimizer=type(optim.optimizer).__name__, optimizer_config=optim.optimizer.get_config(),
                  epochs=epochs, steps_per_epoch=steps_per_epoch, train_images=train_images, val_images=val_images,
                  resumed_from=str(restored) if restored else None)
    metrics.say(f"hvrep train: {cfg.name} on {n} replica(s) ({repl.backend}), global batch {gb}, {epochs} epochs x "
                f"{steps_per_epoch} steps, fast path {fast_path}" + (f", resumed from {restored}" if restored else ""))
    _say_start(metrics, moved, skipped)

    controller = Controller(cfg, runner, state, ckpt, metrics, epochs=epochs, steps_per_epoch=steps_per_epoch,
                            val_images=val_images, resumed=resumed, schedule=schedule, schedule_rule=optim.rule)
    if elastic:
        from hvrep.train.elastic import ElasticLoop

        def after_reset() -> None:
            # Rank 0 of the new world is the chief: it takes over metrics.jsonl and the checkpoints.
            if repl.is_chief and not controller.metrics.enabled:
                controller.metrics = MetricsWriter(out, True)
            ckpt.is_chief = repl.is_chief
            _last_words(watchdog.current(), controller.metrics, ckpt.latest)

        segments = resumed.segments(n, gb) if resumed else []
        result = ElasticLoop(controller, cfg.elastic.commit_every_steps, after_reset, segments).run()
        metrics, n = controller.metrics, repl.num_replicas
    else:
        result = controller.run()
    rates = result["images_per_sec"]
    summary = {k: result[k] for k in ("stopped", "time_to_accuracy_sec") if k in result}
    summary.update(step=int(state.step.numpy()), epoch=int(state.epoch.numpy()), top1=result["top1"],
                   top5=result["top5"], images_per_sec=sorted(rates)[len(rates) // 2] if rates else None,
                   replicas=n, wall_sec=result["wall_sec"], output_dir=str(out),
                   checkpoint=str(ckpt.latest()) if ckpt.latest() else None)
    return _finish(summary, metrics, n)


def _last_words(hang: Any, metrics: Any, latest: Any) -> None:
    """When the watchdog ends the run (a hang: exit 75, stopped="timeout", which slurm/preemptible.sbatch requeues;
    ranks in different collectives: exit 65, stopped="mismatch", which it does not), the chief says so in
    metrics.jsonl with the report and the newest complete checkpoint (nothing is saved from the stuck step)."""
    if hang is not None:
        hang.on_end(lambda stopped, report: metrics.record_only(
            "final", stopped=stopped, report=report, checkpoint=str(latest()) if latest() else None))


def _finish(summary: dict[str, Any], metrics: Any, n: int) -> dict[str, Any]:
    """Writes the run's final line and says it (both loops)."""
    out = summary["output_dir"]
    metrics.write("final", summary["step"], **{k: v for k, v in summary.items() if k != "step"})
    metrics.close()
    top1, top5 = summary["top1"], summary["top5"]
    accuracy = "" if math.isnan(top1) else f"val top-1 {top1:.4f}, top-5 {top5:.4f}, "
    metrics.say(f"hvrep train: {summary['stopped']} at step {summary['step']}: {accuracy}median "
                f"{summary['images_per_sec'] or 0:,.0f} images/s on {n} replica(s). Outputs in {out}/ "
                "(metrics.jsonl, tensorboard/, checkpoints/)")
    if summary["stopped"] == "signal":  # the last line a stopped run prints: how to go on
        metrics.say(f"hvrep train: stopped at step {summary['step']} (saved {summary['checkpoint']}); continue with "
                    "`--resume`")
    return summary


def _warn_elastic_settings(cfg: configs.RunConfig) -> None:
    """Elastic settings outside horovodrun's elastic driver: a warning from the first rank (before TensorFlow)."""
    from hvrep import _env, resolve_placement

    if _env.horovod_elastic() or resolve_placement().rank != 0:
        return
    if (warning := cfg.elastic.unused_warning(cfg.train.global_batch)) is not None:
        print(f"hvrep train: warning: {warning}", file=sys.stderr)


def _skipped_files(cfg: configs.RunConfig) -> dict[str, list[str]]:
    """The images ``data.on_error=skip`` leaves out, per split (the tf.data pipeline's check; DALI logs its own)."""
    if cfg.data.backend != "tfdata":
        return {}
    from hvrep.data.tfdata import bad_jpegs

    return {split: bad_jpegs(cfg.data, split) for split in ("train", "val")}


def _say_start(metrics: Any, moved: Path | None, skipped: dict[str, list[str]] | None) -> None:
    """What the chief says after the config line: the old run moved aside (--overwrite), the images skipped."""
    if moved is not None:
        metrics.say(f"hvrep train: --overwrite: the earlier run in this output_dir was moved to {moved}")
    for split, files in (skipped or {}).items():
        if files:
            metrics.write("skipped", split=split, count=len(files), files=files)
            shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more (all in metrics.jsonl)" if len(files) > 5
                                            else "")
            metrics.say(f"hvrep train: data.on_error=skip leaves out {len(files)} bad {split} image(s): {shown}")


def _run_fit(cfg: configs.RunConfig, repl: Any, resume: bool, steps_per_epoch: int, train_images: int,
             val_images: int, binding: cores.Binding, moved: Path | None,
             skipped: dict[str, list[str]] | None, budget: cores.Budget,
             listeners: list[Any]) -> dict[str, Any]:
    """``train.loop=fit``: the same model, optimizer, data and evaluation, trained by Keras' fit."""
    import tensorflow as tf

    from hvrep import kernels
    from hvrep.train import fitloop
    from hvrep.train.metrics import MetricsWriter

    n, gb, out = repl.num_replicas, cfg.train.global_batch, Path(cfg.output_dir)
    metrics = MetricsWriter(out, repl.is_chief, listeners)
    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": cfg.train.threads,
           "cores": list(binding.cores), "bound_here": binding.bound_here, "cpu_budget": budget.why,
           "gpus": [d.name for d in tf.config.list_logical_devices("GPU")], "tensorflow": tf.__version__}
    fast_path = {"precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile, "input": cfg.data.backend,
                 "loop": "fit", "kernels": kernels.status().describe()}

    def started(optimizer: Any, epochs: int, restored: Path | None) -> None:
        metrics.write("config", config=configs.to_dict(cfg), replicas=n, backend=repl.backend, fast_path=fast_path,
                      env=env, optimizer=type(optimizer).__name__, optimizer_config=optimizer.get_config(),
                      epochs=epochs, steps_per_epoch=steps_per_epoch, train_images=train_images,
                      val_images=val_images, resumed_from=str(restored) if restored else None)
        metrics.say(f"hvrep train: {cfg.name} on {n} replica(s) ({repl.backend}) with model.fit, global batch {gb}, "
                    f"{epochs} epochs x {steps_per_epoch} steps" + (f", resumed from {restored}" if restored else ""))
        _say_start(metrics, moved, skipped)

    from hvrep.replica import watchdog
    from hvrep.train.checkpoint import CheckpointManager

    # A reader of the folder fitloop's manager writes, for the watchdog's last words (it saves nothing).
    reader = CheckpointManager(out / "checkpoints", is_chief=False, step=tf.Variable(0, dtype=tf.int64))
    _last_words(watchdog.current(), metrics, reader.latest)
    result = fitloop.run_fit(cfg, repl, lambda: _model(cfg), train_images=train_images, val_images=val_images,
                             metrics=metrics, resume=resume, started=started)
    rates = result["images_per_sec"]
    summary = {k: result[k] for k in ("stopped", "time_to_accuracy_sec") if k in result}
    summary.update(step=result["step"], epoch=result["epoch"], top1=result["top1"], top5=result["top5"],
                   images_per_sec=sorted(rates)[len(rates) // 2] if rates else None, replicas=n,
                   wall_sec=result["wall_sec"], output_dir=str(out), checkpoint=result["checkpoint"])
    return _finish(summary, metrics, n)


def main(argv: list[str] | None = None) -> int:
    """``hvrep train``. Flags and the configuration are checked before TensorFlow is imported (3-4 s), so
    ``--help`` and a mistyped setting answer at once."""
    parser = argparse.ArgumentParser(
        prog="hvrep train", description="Train a ResNet on every rank.",
        epilog="Exit codes: 0 finished, or stopped by SIGTERM/SIGUSR1/Ctrl-C after saving (continue with --resume); "
               "2 a setting, data set or output folder to fix (the message says how); 74 the output file system is "
               "full (free space, then --resume); 75 a collective timed out "
               "(comm.timeout_s). Under horovodrun, Ctrl-C may end in horovodrun's own exit code 1 after hvrep's "
               "ranks saved (docs/training-app.md, 'Stopping a run with Ctrl-C').")
    parser.add_argument("--config", default="resnet50_imagenet",
                        help="preset (resnet50_imagenet, demo) or a JSON file of settings")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output_dir that holds checkpoints; the old run is moved to "
                        "OUTPUT_DIR.old-<UTC time> (nothing is deleted)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser.add_argument("--verbose", action="store_true", help="keep TensorFlow's start-up and C++ log messages")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error hvrep explains")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.global_batch=4096")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    try:
        cfg = configs.build(args.config, args.overrides)
        if args.print_config:
            print(json.dumps(configs.to_dict(cfg), indent=2))
            return EXIT_OK.code
        _warn_elastic_settings(cfg)
        rundir.check_data_dir(cfg.data)
        rundir.check_output_dir(cfg.output_dir, args.resume, args.overwrite)
        mlperf.log_path(cfg, args.resume, args.overwrite)
        if not args.verbose:
            from hvrep.compat.quiet import import_tensorflow_quietly

            import_tensorflow_quietly()
        run(cfg, resume=args.resume, overwrite=args.overwrite)
    except Exception as e:
        # A full output file system is neither a setting to fix nor transient: its own code, which
        # slurm/preemptible.sbatch does not requeue (a requeue would fill it again); free space, then --resume.
        # It may come from any writer: metrics.jsonl (OSError), a checkpoint or TensorBoard's event file
        # (a TensorFlow error that carries ENOSPC in its message only).
        if _no_space(e):
            if args.debug:
                raise
            print(f"hvrep train: error: the output file system is full: {_first_line(e)} (exit {EXIT_NO_SPACE.code}: "
                  "free space, then continue with --resume; the checkpoints completed before are intact)",
                  file=sys.stderr)
            return EXIT_NO_SPACE.code
        if args.debug or not isinstance(e, HvrepError):
            raise
        print(f"hvrep train: error: {e}", file=sys.stderr)
        return EXIT_USAGE.code
    except KeyboardInterrupt:  # before the loop took over Ctrl-C, or a second Ctrl-C
        if args.debug:
            raise
        print("hvrep train: interrupted (Ctrl-C) before training started or a second time: nothing new was "
              "saved (the checkpoints already in output_dir stay)", file=sys.stderr)
        return EXIT_INTERRUPTED.code
    return EXIT_OK.code
