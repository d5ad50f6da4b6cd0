"""The training loop's overhead over the bare step: ``hvrep train``'s controller vs a plain loop, same step.

    python benchmarks/loop_overhead.py --config demo train.threads=1 --out results/loop_overhead.jsonl
    mpirun -np 2 python -m mpi4py benchmarks/loop_overhead.py --config demo train.threads=1

The run is assembled as ``hvrep train`` assembles it (configuration, preset
and ``section.key=value`` overrides; model, optimizer, ``Runner``); both
contenders then call the same compiled step ``Runner.train`` on the same
synthetic batches (one random batch per replica, repeated: no files, no
decode), through the same ``Replicator.distribute_dataset``:

* ``bare``: ``for x, y in dataset: runner.train(x, y)`` over an epoch's steps,
  then one read of the device-side totals (the only wait on the device);
* ``loop``: one epoch of ``hvrep.train.controller.Controller`` with that
  dataset: progress output, the loss/accuracy read and the stop agreement once
  per ``train.steps_per_loop`` steps (and at ``log_every`` boundaries), the
  metrics line. Its time is the epoch's, as the controller measures it for
  its ``images_per_sec`` (from the dataset's creation to the epoch's last
  read); the epoch plan before it and the evaluation and checkpoint after it
  are not in it (they are per epoch, not per step).

Each round runs both once, the order swapped every round, after one untimed
round (tracing). ``overhead = 1 - loop / bare`` of the median images/s; per
round too. One JSON line per round and a summary line go to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl
from _common import environment as common_environment
from _common import run_id as new_run_id


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo", help="preset or JSON file, as hvrep train's (default demo)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, each one epoch of each (default 5)")
    p.add_argument("--out", type=Path, default=Path("results/loop_overhead.jsonl"))
    p.add_argument("overrides", nargs="*", help="section.key=value, as hvrep train's")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from hvrep.train import config as configs

    # Evaluation only when the controller ends (its last epoch); checkpoints into a scratch folder.
    scratch = Path(tempfile.mkdtemp(prefix="hvrep-loop-overhead-"))
    cfg = configs.build(args.config, [*args.overrides, f"output_dir={scratch}", "train.eval_every=1000000"])

    import keras
    import tensorflow as tf

    import hvrep
    from hvrep import _env
    from hvrep.data import num_examples, synthetic_dataset, write_demo
    from hvrep.replica import cores
    from hvrep.train import main as train_main
    from hvrep.train import optim as optimizers
    from hvrep.train.checkpoint import CheckpointManager
    from hvrep.train.controller import Controller, LoopState
    from hvrep.train.metrics import MetricsWriter
    from hvrep.train.position import SchedulePosition
    from hvrep.train.steps import Runner

    if cfg.train.threads is not None:
        cores.set_pools(cfg.train.threads, f"train.threads={cfg.train.threads}")
    repl = hvrep.Replicator("auto", config=cfg.comm)
    demo_root = _env.cache_dir() / "demo-data"
    if repl.is_chief and Path(cfg.data.data_dir).parent == demo_root:
        write_demo(demo_root)
    repl.reduce(tf.constant(0), "sum")
    n, gb = repl.num_replicas, cfg.train.global_batch
    train_images = num_examples(cfg.data, "train")
    steps = train_images // gb
    keras.utils.set_random_seed(cfg.train.seed)
    with repl.scope():
        model = train_main._model(cfg)
        optim = optimizers.build(cfg, train_images)
        optimizer, smoothing = optim.optimizer, optim.label_smoothing
        if cfg.train.precision == "fp16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        state = LoopState(*(tf.Variable(0, dtype=tf.int64, trainable=False, name=k)
                            for k in ("step", "epoch", "position")))
    schedule = SchedulePosition(optim.schedule, optimizer, gb * cfg.comm.accumulation_steps)
    runner = Runner(repl, model, optimizer, num_classes=cfg.model.num_classes, label_smoothing=smoothing,
                    fp16=cfg.train.precision == "fp16", jit_compile=cfg.train.jit_compile)
    ckpt = CheckpointManager(scratch / "checkpoints", is_chief=repl.is_chief, keep=1, model=model,
                             optimizer=optimizer, step=state.step, epoch=state.epoch, position=state.position)
    val_images = num_examples(cfg.data, "val")
    metrics = MetricsWriter(scratch, repl.is_chief)

    def synthetic(config: Any, split: str, ctx: Any, **_: Any) -> tf.data.Dataset:
        # One epoch of this replica's steps, the same random batch each step.
        return synthetic_dataset(config, ctx, num_classes=cfg.model.num_classes).take(steps)

    def bare() -> float:
        start = time.perf_counter()
        for x, y in repl.distribute_dataset(lambda ctx: synthetic(cfg.data, "train", ctx), global_batch_size=gb):
            runner.train(x, y)
        runner.totals().numpy()  # the only wait on the device
        return steps * gb / (time.perf_counter() - start)

    epochs_done = 0

    def loop() -> float:
        nonlocal epochs_done
        epochs_done += 1
        result = Controller(cfg, runner, state, ckpt, metrics, epochs=epochs_done, steps_per_epoch=steps,
                            val_images=val_images, schedule=schedule, train_dataset=synthetic).run()
        return result["images_per_sec"][-1]

    contenders = {"bare": bare, "loop": loop}
    bare(), loop()  # untimed: tracing, the first iterators
    rid, rows = new_run_id(), []
    for r in range(args.rounds):
        order = ["bare", "loop"] if r % 2 == 0 else ["loop", "bare"]
        rates = {name: contenders[name]() for name in order}
        # The job's rate is the slowest rank's: every rank's timing, reduced to the minimum.
        rates = {k: float(-repl.reduce(tf.constant(-v, tf.float64), "max")) if n > 1 else v
                 for k, v in rates.items()}
        rows.append({"benchmark": "loop_overhead", "record": "round", "run_id": rid, "round": r, "order": order,
                     "images_per_sec": rates, "overhead": 1 - rates["loop"] / rates["bare"]})
    if not repl.is_chief:
        return 0
    med = {k: statistics.median(row["images_per_sec"][k] for row in rows) for k in contenders}
    per_round = [row["overhead"] for row in rows]
    summary = {
        "benchmark": "loop_overhead", "record": "summary", "run_id": rid, "replicas": n, "backend": repl.backend,
        "global_batch": gb, "steps_per_epoch": steps, "steps_per_loop": cfg.train.steps_per_loop,
        "log_every": cfg.train.log_every, "threads": cfg.train.threads,
        "images_per_sec_median": med, "overhead_of_medians": 1 - med["loop"] / med["bare"],
        "overhead_per_round": {"median": statistics.median(per_round), "min": min(per_round),
                               "max": max(per_round)},
        "config": configs.to_dict(cfg), "env": common_environment(),
    }
    append_jsonl(args.out, [*rows, summary])
    print(f"loop_overhead {rid}: {cfg.name}, {n} replica(s) ({repl.backend}), global batch {gb}, {steps} steps per "
          f"epoch, steps_per_loop {cfg.train.steps_per_loop}, threads {cfg.train.threads}")
    for row in rows:
        ips = row["images_per_sec"]
        print(f"  round {row['round'] + 1} ({' then '.join(row['order'])}): bare {ips['bare']:,.1f}  loop "
              f"{ips['loop']:,.1f} images/s  overhead {row['overhead']:+.1%}")
    print(f"median: bare {med['bare']:,.1f}, loop {med['loop']:,.1f} images/s; overhead "
          f"{summary['overhead_of_medians']:+.1%} of the medians [per round {min(per_round):+.1%} to "
          f"{max(per_round):+.1%}]; appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
