"""Train the class-conditional SN-GAN on any number of ranks; the same command on one process.

    python -m examples.sngan.train                                   # the shipped digits, one process
    horovodrun -np 2 -H localhost:2 --gloo python -m examples.sngan.train output_dir=runs/sngan steps=1500
    mpirun -np 2 python -m examples.sngan.train global_batch=128 gan.n_dis=2
    python -m examples.sngan.train --resume output_dir=runs/sngan   # continue from the newest checkpoint

Settings are ``key=value`` (``gan.key=value`` for the model's, see :class:`AppConfig` and
``examples.sngan.gan.GANConfig``). The step is the app's (``gan.py``); the loop's cadence, checkpoints (atomic,
chief-written, restored on every rank), ``metrics.jsonl`` / TensorBoard and the stop on SIGTERM / SIGUSR1 /
Ctrl-C are ``hvrep train``'s (``hvrep.train.loop``). Outputs in ``output_dir``: ``metrics.jsonl`` (``train``
lines with both losses, ``eval`` lines with the Fréchet distance and class accuracy, a ``reference`` line with
the real held-out images' and the class-mean baseline's figures), ``tensorboard/`` (scalars and a per-class
image grid), ``samples/step-<N>.png`` and ``checkpoints/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from examples.sngan.gan import GANConfig
from hvrep.errors import ConfigError
from hvrep.train.settings import app_main, apply_settings, check_ranges


@dataclasses.dataclass(frozen=True)
class AppConfig:
    """One run.

    Attributes:
      output_dir: metrics, samples and checkpoints go here.
      data_dir: a TFRecord folder written by ``hvrep data prepare`` (or ``hvrep data demo``); "" = the
        shipped digits, written to hvrep's cache on first use.
      global_batch: images per discriminator or generator update, over all replicas (divisible by them).
      steps: generator updates (each after ``gan.n_dis`` discriminator updates).
      steps_per_loop: steps between host round-trips (a ``train`` line, the stop agreement).
      eval_every: steps between quality measurements (0: only at the end).
      checkpoint_every: steps between checkpoints (0: only at the end and on a stop).
      quality: measure the Fréchet distance and class accuracy (trains the cached classifier once).
      threads: each rank's TensorFlow and tf.data threads (None: its share of the node's cores).
      gan: the model and optimisation.
    """

    output_dir: str = "runs/sngan"
    data_dir: str = ""
    global_batch: int = 64
    steps: int = 1500
    steps_per_loop: int = 25
    eval_every: int = 500
    checkpoint_every: int = 500
    quality: bool = True
    threads: int | None = None
    gan: GANConfig = dataclasses.field(default_factory=GANConfig)

    def __post_init__(self) -> None:
        check_ranges(self, {"global_batch": "[1, inf)", "steps": "[1, inf)", "steps_per_loop": "[1, inf)",
                            "eval_every": "[0, inf)", "checkpoint_every": "[0, inf)", "threads": "[1, inf)"})


def config(overrides: Sequence[str]) -> AppConfig:
    """``AppConfig`` with ``key=value`` / ``gan.key=value`` overrides applied.

    Raises:
      hvrep.errors.ConfigError: an unknown key or a value of the wrong type.
    """
    return apply_settings(AppConfig(), overrides, section="gan")


def data_config(data_dir: str) -> Any:
    """The input pipeline's settings for the GAN: whole 32x32 images (no crop, no flip) scaled to [-1, 1]."""
    from hvrep.data import DataConfig

    return DataConfig(data_dir=data_dir, format="tfrecord", image_size=32, resize_size=32, crop_scale=(1.0, 1.0),
                      crop_ratio=(1.0, 1.0), flip=False, mean=(127.5,) * 3, std=(127.5,) * 3)


class _App:
    """What ``hvrep.train.loop.run_loop`` drives: ``train(n)`` runs n GAN steps, ``evaluate`` scores samples."""

    def __init__(self, cfg: AppConfig, repl: Any, gan: Any, data: Any, judge: Any, metrics: Any, step: int,
                 out: Path) -> None:
        self.cfg, self.repl, self.gan, self.data, self.judge, self.metrics = cfg, repl, gan, data, judge, metrics
        self.step, self.out = step, out
        self._batches = self._stream(epoch=step)

    def _stream(self, epoch: int) -> Iterator[Any]:
        """Batches of ``n_dis`` x global_batch images forever, a new shuffle each pass over the data."""
        from hvrep.data import make_dataset

        per_step = self.cfg.gan.n_dis * self.cfg.global_batch
        while True:
            data = dataclasses.replace(self.data, seed=self.data.seed + epoch)
            yield from self.repl.distribute_dataset(
                lambda ctx, data=data: make_dataset(data, "train", ctx, threads=self.cfg.threads), per_step)
            epoch += 1

    def train(self, steps: int) -> dict[str, float]:
        t0 = time.perf_counter()
        outs = []
        for _ in range(steps):
            x, y = next(self._batches)
            outs.append(self.gan.train_step(x, y, self.step))
            self.step += 1
        losses = self.repl.reduce(outs, "mean")  # reading waits for the last step
        seconds = time.perf_counter() - t0
        return {"d_loss": float(sum(o["d_loss"] for o in losses) / steps),
                "g_loss": float(sum(o["g_loss"] for o in losses) / steps),
                "images_per_sec": steps * self.cfg.global_batch * (self.cfg.gan.n_dis + 1) / seconds}

    def evaluate(self, step: int) -> dict[str, Any]:
        """The chief scores the EMA generator's samples (the other ranks go on to their next collective)."""
        if self.judge is None:
            return {}
        import numpy as np
        import tensorflow as tf

        labels = self.judge.requested_labels()
        x = self.gan.sample(tf.constant(labels)).numpy()
        figures = self.judge.score(x, labels)
        per_class = self.judge.per_class
        picture = quality_grid(x, labels, self.judge.num_classes, min(per_class, 10))
        self.metrics.image("samples", step, picture)
        path = self.out / "samples" / f"step-{step:06d}.png"
        _write_png(picture, path)
        return {**figures, "images": len(labels), "png": str(path),
                "per_class_accuracy": [round(a, 4) for a in np.asarray(figures["per_class_accuracy"]).tolist()]}


def quality_grid(x: Any, labels: Any, num_classes: int, cols: int) -> Any:
    """One row per class, ``cols`` samples each, as a uint8 picture."""
    import numpy as np

    from examples.sngan.quality import grid

    rows = [x[labels == c][:cols] for c in range(num_classes)]
    return grid(np.concatenate(rows), num_classes)


def _write_png(picture: Any, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=path.parent)
    os.close(fd)
    Image.fromarray(picture).save(tmp, format="PNG")
    os.replace(tmp, path)


def run(cfg: AppConfig, resume: bool = False) -> dict[str, Any]:
    """Trains on every rank; returns the summary (the chief's has the last evaluation)."""
    from hvrep import _env
    from hvrep.replica import cores
    from hvrep.train import rundir

    rundir.check_output_dir(cfg.output_dir, resume, overwrite=False)
    _env.quiet_tensorflow_logs()
    import tensorflow as tf

    import hvrep

    # threads=None: the Replicator's default CPU budget (each rank's share of its node's cores) applies.
    if cfg.threads:
        cores.set_pools(cfg.threads, f"threads={cfg.threads}")

    from examples.sngan.gan import SNGAN
    from hvrep.data import write_demo
    from hvrep.train import resume as resuming
    from hvrep.train.checkpoint import CheckpointManager
    from hvrep.train.loop import LoopConfig, run_loop
    from hvrep.train.metrics import MetricsWriter

    repl = hvrep.Replicator("auto")
    if cfg.threads is None and repl.cpu_budget is not None:  # the data pipeline's pool gets the same share
        cfg = dataclasses.replace(cfg, threads=repl.cpu_budget.threads)
    n, chief, out = repl.num_replicas, repl.is_chief, Path(cfg.output_dir)
    if cfg.global_batch % n:
        raise ConfigError(f"global_batch={cfg.global_batch} must divide by the {n} replicas. Fix: "
                          f"global_batch={max(1, cfg.global_batch // n) * n}.")
    data_dir = cfg.data_dir or str(_env.cache_dir() / "demo-data" / "tfrecord")
    if chief and not cfg.data_dir:
        write_demo(Path(data_dir).parent)  # once; every rank waits below
    data = data_config(data_dir)
    metrics = MetricsWriter(out, chief)
    judge = None
    if chief and cfg.quality:
        from examples.sngan.quality import Judge

        judge = Judge(data, say=metrics.say)
        refs = judge.references()
        metrics.write("reference", classifier=str(judge.path), images=len(judge.requested_labels()), **refs)
        for name, r in refs.items():
            metrics.say(f"sngan: {name}: Fréchet distance {r['fid']:.2f}, class accuracy {r['class_accuracy']:.3f}")
    repl.reduce(tf.constant(0), "sum")  # every rank waits for the chief's data and classifier

    gan = SNGAN(repl, cfg.gan)
    with repl.scope():
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    ckpt = CheckpointManager(out / "checkpoints", is_chief=chief, keep=2, step=step, **gan.checkpoint_items())
    resumed = resuming.restore(repl, ckpt) if resume else None
    budget = repl.cpu_budget.why if repl.cpu_budget else f"threads={cfg.threads}"
    metrics.write("config", config=dataclasses.asdict(cfg), replicas=n, backend=repl.backend,
                  data_dir=data_dir, resumed_from=str(resumed.folder) if resumed else None, cpu_budget=budget)
    metrics.say(f"sngan: {n} replica(s) ({repl.backend}), global batch {cfg.global_batch} per update, "
                f"{cfg.gan.n_dis} D updates per G update, {cfg.steps} G updates"
                + (f", resumed from {resumed.folder} at step {int(step.numpy())}" if resumed else ""))
    app = _App(cfg, repl, gan, data, judge, metrics, int(step.numpy()), out)
    loop = LoopConfig(max_steps=cfg.steps, steps_per_loop=cfg.steps_per_loop, eval_every=cfg.eval_every,
                      checkpoint_every=cfg.checkpoint_every)
    result = run_loop(app, loop, repl=repl, step=step, checkpoints=ckpt, metrics=metrics,
                      metadata=lambda: {"world_size": n, "global_batch": cfg.global_batch})
    summary = {"stopped": result["stopped"], "step": result["step"], "wall_sec": result["wall_sec"],
               "replicas": n, "output_dir": str(out), **{k: result["eval"][k] for k in ("fid", "class_accuracy")
                                                          if k in result["eval"]}}
    metrics.write("final", result["step"], **{k: v for k, v in summary.items() if k != "step"})
    metrics.close()
    metrics.say(f"sngan: {summary['stopped']} at step {summary['step']} in {summary['wall_sec']:.0f} s: "
                + json.dumps({k: summary[k] for k in ("fid", "class_accuracy") if k in summary}))
    repl.close()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return app_main("sngan", config, run, argv)


if __name__ == "__main__":
    sys.exit(main())
