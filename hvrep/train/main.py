"""``hvrep train`` / ``python -m hvrep.train``: ResNet training on every rank, with the fast path.

    horovodrun -np 8 hvrep train --config resnet50_imagenet data.data_dir=/data/imagenet-tfr
    hvrep train --config demo                      # the embedded digits, one process
    hvrep train --config demo --resume             # continue from the last checkpoint

The loop owns what TF-Replicator's users wrote by hand: the replicated step
(``hvrep.Replicator``), the input pipeline (``hvrep.data``), the large-batch
recipe, exact global evaluation (top-1/top-5 over all replicas, padding
excluded), a target accuracy that stops the run, atomic checkpoints of model,
optimizer, step, epoch and position in the epoch, and a clean stop on SIGTERM /
SIGUSR1 that every rank agrees on. Only the chief prints, writes TensorBoard
summaries and ``metrics.jsonl``, and saves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from hvrep import kernels
from hvrep.errors import HvrepError
from hvrep.train import config as configs


class _Metrics:
    """metrics.jsonl and TensorBoard, chief only (other ranks get a no-op)."""

    def __init__(self, output_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        if enabled:
            import tensorflow as tf

            output_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(output_dir / "metrics.jsonl", "a")
            self._tb = tf.summary.create_file_writer(str(output_dir / "tensorboard"))

    def write(self, event: str, step: int | None = None, **values: Any) -> None:
        if not self.enabled or self._file is None:
            return
        record = {"event": event, "time": time.time(), **({"step": step} if step is not None else {}), **values}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        if self._tb is not None and step is not None:
            import tensorflow as tf

            with self._tb.as_default(step=step):
                for k, v in values.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        tf.summary.scalar(f"{event}/{k}", v)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.flush()


def _optimizer(cfg: configs.RunConfig, steps_per_epoch: int, train_images: int) -> tuple[Any, int, float]:
    """(optimizer, epochs, label smoothing) from the recipe or the explicit settings."""
    from hvrep import recipes, schedules
    from hvrep.optimizers import LARS, MomentumSGD

    o, t = cfg.optim, cfg.train
    exclude = None if o.exclude_bn_and_bias else []  # None: the optimizers' defaults (BN and biases)
    if o.optimizer == "recipe":
        recipe = recipes.imagenet_resnet50(t.global_batch, t.epochs, train_images=train_images,
                                           label_smoothing=o.label_smoothing,
                                           exclude_bn_and_bias_from_weight_decay=o.exclude_bn_and_bias)
        return recipe.optimizer, recipe.epochs, recipe.label_smoothing
    epochs = t.epochs or 90
    total = epochs * steps_per_epoch
    warmup = round(o.warmup_epochs * steps_per_epoch)
    kwargs: dict[str, Any] = {"peak_lr": o.peak_lr, "total_steps": total, "warmup_steps": warmup}
    if o.decay == "step":  # Goyal's 30/60/80 of 90 epochs, scaled to this run
        kwargs["boundaries"] = [max(warmup + 1, round(total * f)) for f in (30 / 90, 60 / 90, 80 / 90)]
    schedule = schedules.warmup_schedule(o.decay, **kwargs)
    if o.optimizer == "lars":
        opt = LARS(schedule, momentum=o.momentum, weight_decay=o.weight_decay, exclude_from_weight_decay=exclude,
                   exclude_from_layer_adaptation=exclude)
    else:
        opt = MomentumSGD(schedule, momentum=o.momentum, weight_decay=o.weight_decay,
                          exclude_from_weight_decay=exclude)
    return opt, epochs, o.label_smoothing or 0.0


def _model(cfg: configs.RunConfig) -> Any:
    from hvrep import models

    m, size = cfg.model, cfg.data.image_size
    shape = (size, size, 3) if m.data_format == "channels_last" else (3, size, size)
    if m.name == "resnet50":
        return models.resnet50(m.num_classes, shape, m.data_format, m.zero_init_residual)
    return models.small_resnet(m.num_classes, shape, m.data_format, width=m.width,
                               zero_init_residual=m.zero_init_residual)


def run(cfg: configs.RunConfig, resume: bool = False) -> dict[str, Any]:
    """Trains; returns the final summary (the same on every rank)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf
    from tqdm import tqdm

    import hvrep
    from hvrep import _env
    from hvrep.data import data_errors, make_dataset, num_examples, write_demo
    from hvrep.train.checkpoint import CheckpointManager
    from hvrep.train.preemption import stop_on_signals

    if not cfg.data.data_dir:
        raise HvrepError("data.data_dir is empty. Fix: pass data.data_dir=/path/to/imagenet (folder or TFRecords).")
    if cfg.train.precision != "fp32":
        keras.mixed_precision.set_global_policy("mixed_float16" if cfg.train.precision == "fp16" else "mixed_bfloat16")
    repl = hvrep.Replicator("auto", config=cfg.comm)
    chief, n = repl.is_chief, repl.num_replicas
    out = Path(cfg.output_dir)
    demo_root = _env.cache_dir() / "demo-data"
    if chief and Path(cfg.data.data_dir).parent == demo_root:
        write_demo(demo_root)  # once; every rank waits below
    repl.reduce(tf.constant(0), "sum")

    gb = cfg.train.global_batch
    if gb % n:
        raise HvrepError(f"train.global_batch={gb} must divide by the {n} replicas. Fix: use {max(1, gb // n) * n}.")
    train_images = num_examples(cfg.data, "train")
    val_images = num_examples(cfg.data, "val")
    steps_per_epoch = train_images // gb
    if steps_per_epoch == 0:
        raise HvrepError(f"{train_images} training images cannot fill one global batch of {gb}.")

    keras.utils.set_random_seed(cfg.train.seed)
    with repl.scope():
        model = _model(cfg)
        optimizer, epochs, smoothing = _optimizer(cfg, steps_per_epoch, train_images)
        if cfg.train.precision == "fp16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        position_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="position")
    ckpt = CheckpointManager(out / "checkpoints", is_chief=chief, keep=cfg.checkpoint.keep, model=model,
                             optimizer=optimizer, step=step_var, epoch=epoch_var, position=position_var)
    restored = ckpt.restore() if resume else None

    metrics = _Metrics(out, chief)
    fast_path = {"precision": cfg.train.precision, "jit_compile": cfg.train.jit_compile,
                 "input": cfg.data.backend, "compression": cfg.comm.compression,
                 "fusion_threshold_bytes": cfg.comm.fusion_threshold_bytes, "num_groups": cfg.comm.num_groups,
                 "kernels": kernels.status().describe()}
    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
           "gpus": [d.name for d in tf.config.list_logical_devices("GPU")], "tensorflow": tf.__version__}
    metrics.write("config", config=configs.to_dict(cfg), replicas=n, backend=repl.backend, fast_path=fast_path, env=env,
                  optimizer=type(getattr(optimizer, "inner_optimizer", optimizer)).__name__, epochs=epochs,
                  steps_per_epoch=steps_per_epoch, resumed_from=str(restored) if restored else None)
    if chief:
        print(f"hvrep train: {cfg.name} on {n} replica(s) ({repl.backend}), global batch {gb}, {epochs} epochs x "
              f"{steps_per_epoch} steps, fast path {fast_path}" + (f", resumed from {restored}" if restored else ""),
              flush=True)

    num_classes = cfg.model.num_classes
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=smoothing)
    fp16 = cfg.train.precision == "fp16"

    def forward_backward(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]:
        with tf.GradientTape() as tape:
            logits = tf.cast(model(x, training=True), tf.float32)
            loss = loss_fn(tf.one_hot(y, num_classes), logits)
            scaled = optimizer.scale_loss(loss) if fp16 else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.int32))
        return loss, grads, correct

    # XLA compiles the compute; Horovod's collectives stay outside it (no XLA CPU kernels).
    compute = tf.function(forward_backward, jit_compile=True) if cfg.train.jit_compile else forward_backward

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        loss, grads, correct = compute(x, y)
        grads = hvrep.all_reduce(grads, "mean")
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss, correct

    def eval_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        logits = tf.cast(model(x, training=False), tf.float32)
        valid = y >= 0  # padding rows: every image counts exactly once over the replicas
        top1 = tf.logical_and(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), valid)
        top5 = tf.logical_and(tf.reduce_any(tf.equal(tf.math.top_k(logits, min(5, num_classes)).indices,
                                                     y[:, None]), -1), valid)
        return tf.stack([tf.reduce_sum(tf.cast(top1, tf.int64)), tf.reduce_sum(tf.cast(top5, tf.int64))])

    def evaluate(epoch: int) -> tuple[float, float]:
        cfg_val = cfg.data
        totals = [0, 0]
        with data_errors(cfg_val, "val"):
            for x, y in repl.distribute_dataset(lambda ctx: make_dataset(cfg_val, "val", ctx, batch_size=gb // n)):
                counts = repl.reduce(repl.run(eval_step, args=(x, y)), "sum")
                totals[0] += int(counts[0])
                totals[1] += int(counts[1])
        return totals[0] / val_images, totals[1] / val_images

    start_time = time.time()
    summary: dict[str, Any] = {"stopped": "completed"}
    top1 = top5 = float("nan")
    images_per_sec: list[float] = []
    with stop_on_signals() as stop:
        epoch = int(epoch_var.numpy())
        while epoch < epochs:
            position = int(position_var.numpy())
            epoch_cfg = dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000 + epoch)

            def train_input(ctx: Any, epoch_cfg: Any = epoch_cfg, position: int = position) -> Any:
                # Resuming mid-epoch skips the batches already trained on: the same data in the same order.
                return make_dataset(epoch_cfg, "train", ctx).skip(position)

            bar = tqdm(total=steps_per_epoch, initial=position, desc=f"epoch {epoch + 1}/{epochs}", unit="step",
                       disable=not chief, file=sys.stderr, leave=False)
            t0, steps_done, loss_sum, correct_sum = time.perf_counter(), 0, 0.0, 0
            with data_errors(epoch_cfg, "train"):
                for x, y in repl.distribute_dataset(train_input, global_batch_size=gb):
                    loss, correct = repl.run(train_step, args=(x, y))
                    step_var.assign_add(1)
                    position_var.assign_add(1)
                    steps_done += 1
                    step = int(step_var.numpy())
                    # Agree on stopping: a signal may have reached only some ranks.
                    flags = repl.reduce({"stop": tf.constant(int(stop.requested)), "loss": loss,
                                         "correct": correct}, "sum")
                    loss_sum += float(flags["loss"]) / n
                    correct_sum += int(flags["correct"])
                    elapsed = time.perf_counter() - t0
                    ips = steps_done * gb / max(elapsed, 1e-9)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss_sum / steps_done:.3f}", img_s=f"{ips:,.0f}")
                    if step % cfg.train.log_every == 0:
                        lr = float(tf.convert_to_tensor(optimizer.learning_rate))
                        metrics.write("train", step, epoch=epoch, loss=loss_sum / steps_done, lr=lr,
                                      images_per_sec=ips, train_top1=correct_sum / (steps_done * gb))
                    if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                        ckpt.save(step, metadata={"epoch": epoch, "position": int(position_var.numpy())})
                    if int(flags["stop"]) > 0:
                        summary["stopped"] = "signal"
                        break
                    if cfg.train.max_steps and step >= cfg.train.max_steps:
                        summary["stopped"] = "max_steps"
                        break
            bar.close()
            elapsed = time.perf_counter() - t0
            if steps_done:
                images_per_sec.append(steps_done * gb / elapsed)
            if summary["stopped"] in ("signal", "max_steps"):
                break
            epoch += 1
            epoch_var.assign(epoch)
            position_var.assign(0)
            line = {"epoch": epoch, "loss": loss_sum / max(steps_done, 1), "images_per_sec": images_per_sec[-1],
                    "train_top1": correct_sum / max(steps_done * gb, 1)}
            if epoch % cfg.train.eval_every == 0 or epoch == epochs:
                top1, top5 = evaluate(epoch)
                line.update(top1=top1, top5=top5)
            metrics.write("epoch", int(step_var.numpy()), **line)
            if chief:
                acc = f"  val top-1 {top1:.4f} top-5 {top5:.4f}" if "top1" in line else ""
                print(f"epoch {epoch}/{epochs}  loss {line['loss']:.4f}  {line['images_per_sec']:,.0f} images/s{acc}",
                      flush=True)
            if epoch % cfg.checkpoint.every_epochs == 0 or epoch == epochs:
                ckpt.save(int(step_var.numpy()), metadata={"epoch": epoch, "position": 0})
            target = cfg.train.target_accuracy
            if target is not None and "top1" in line and top1 >= target:
                summary["stopped"] = "target_accuracy"
                summary["time_to_accuracy_sec"] = time.time() - start_time
                break
        if summary["stopped"] in ("signal", "max_steps"):
            ckpt.save(int(step_var.numpy()), metadata={"epoch": int(epoch_var.numpy()),
                                                       "position": int(position_var.numpy())})
    summary.update(step=int(step_var.numpy()), epoch=int(epoch_var.numpy()), top1=top1, top5=top5,
                   images_per_sec=(sorted(images_per_sec)[len(images_per_sec) // 2] if images_per_sec else None),
                   replicas=n, wall_sec=time.time() - start_time, output_dir=str(out),
                   checkpoint=str(ckpt.latest()) if ckpt.latest() else None)
    metrics.write("final", summary["step"], **{k: v for k, v in summary.items() if k != "step"})
    metrics.close()
    if chief:
        accuracy = "" if math.isnan(top1) else f"val top-1 {top1:.4f}, top-5 {top5:.4f}, "
        print(f"hvrep train: {summary['stopped']} at step {summary['step']}: {accuracy}median "
              f"{summary['images_per_sec'] or 0:,.0f} images/s on {n} replica(s). Outputs in {out}/ "
              "(metrics.jsonl, tensorboard/, checkpoints/)", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvrep train", description="Train a ResNet on every rank.")
    parser.add_argument("--config", default="resnet50_imagenet",
                        help="preset (resnet50_imagenet, demo) or a JSON file of settings")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.global_batch=4096")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    try:
        cfg = configs.build(args.config, args.overrides)
        if args.print_config:
            print(json.dumps(configs.to_dict(cfg), indent=2))
            return 0
        run(cfg, resume=args.resume)
    except HvrepError as e:
        print(f"hvrep train: error: {e}", file=sys.stderr)
        return 2
    return 0
