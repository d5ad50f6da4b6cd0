"""One process, one thread: what batch norm costs a ResNet-50 step on Keras 3, fused and not, and on tf_keras.

    python benchmarks/batch_norm.py --rounds 3 --out results/batch_norm.jsonl

The compute side of ``benchmarks/vs_horovod.py`` without communication:
the same ``keras.applications.ResNet50`` (224 px, batch 8, SGD with momentum,
synthetic input), one process per launch, one TensorFlow thread, so a step's
time is its arithmetic. Variants, launched alternately (round r rotates the
order by r):

* ``tf_keras``: legacy Keras (``TF_USE_LEGACY_KERAS=1``, tf_keras, in
  ``vs_horovod``'s legacy-Keras venv), a plain ``tf.function`` step: what
  Horovod's examples compute. tf_keras trains BatchNormalization with
  ``FusedBatchNormV3``.
* ``keras``: Keras 3, a plain ``tf.function`` step: Keras 3's own batch-norm
  ops (moments, then normalise).
* ``replicator``: Keras 3, the step run by ``hvrep.Replicator("local").run``
  with its default ``batch_norm="fused"``.
* ``replicator-keras``: the same with ``Replicator(batch_norm="keras")``.

Each launch: one untimed tracing step, ``--warmup`` untimed steps, then
``--steps`` timed steps (each until the loss is on the host). One JSON line
per launch (with the batch-norm ops its step traced), then one per variant with its median step and the per-round ratio
of tf_keras' median step to the variant's (above 1: faster than tf_keras).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

VARIANTS = ("tf_keras", "keras", "replicator", "replicator-keras")
RESULT_PREFIX = "BATCH_NORM_RESULT "


# --- the worker: one variant, in its own process ---------------------------------------------------

def _worker(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.worker == "tf_keras":
        keras = tf.keras
        assert keras.optimizers.SGD.__module__.startswith("tf_keras"), keras.optimizers.SGD.__module__
    else:
        import keras
    shape = (args.image_size, args.image_size, 3)
    if args.model == "resnet50":
        make = lambda: keras.applications.ResNet50(weights=None, input_shape=shape, classes=1000)  # noqa: E731
    else:  # a 3-convolution CNN with batch norms, for smoke tests
        make = lambda: keras.Sequential([  # noqa: E731
            keras.Input(shape), keras.layers.Conv2D(16, 3, use_bias=False), keras.layers.BatchNormalization(),
            keras.layers.ReLU(), keras.layers.Conv2D(32, 3, strides=2, use_bias=False),
            keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1000, activation="softmax")])
    repl = None
    if args.worker.startswith("replicator"):
        import hvrep

        repl = hvrep.Replicator("local", batch_norm="keras" if args.worker == "replicator-keras" else "fused")
        scope = repl.scope()
    else:
        scope = tf.distribute.get_strategy().scope()
    with scope:
        keras.utils.set_random_seed(args.seed)
        model = make()
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()  # ResNet50 ends in a softmax, as in vs_horovod
    rng = tf.random.Generator.from_seed(args.seed)
    x = rng.uniform((args.batch, *shape))
    y = rng.uniform((args.batch,), maxval=1000, dtype=tf.int64)

    traced: dict[str, int] = {}

    def step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        # What the trace built (the default graph is the step's own): which batch-norm arithmetic ran.
        ops = [op.type for op in tf.compat.v1.get_default_graph().get_operations()]
        traced.update({k: ops.count(k) for k in ("FusedBatchNormV3", "SquaredDifference")})
        return loss

    if repl is not None:
        run = lambda: repl.run(step, args=(x, y))  # noqa: E731
    else:
        compiled = tf.function(step)
        run = lambda: compiled(x, y)  # noqa: E731
    for _ in range(1 + args.warmup):
        run().numpy()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        run().numpy()
        times.append(time.perf_counter() - start)
    import importlib.metadata

    framework = "tf_keras" if args.worker == "tf_keras" else "keras"
    print(RESULT_PREFIX + json.dumps({"variant": args.worker, "step_s": times, "tensorflow": tf.__version__,
                                      "traced_batch_norm_ops": traced,
                                      "keras": f"{framework} {importlib.metadata.version(framework)}"}),
          flush=True)


# --- the driver ------------------------------------------------------------------------------------

def _python(variant: str) -> str:
    if variant != "tf_keras":
        return sys.executable
    from vs_horovod import _tensorflow_version, legacy_keras_python

    return str(legacy_keras_python(_tensorflow_version()))


def _launch(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["TF_NUM_INTRAOP_THREADS"] = env["TF_NUM_INTEROP_THREADS"] = str(args.threads)
    if variant == "tf_keras":
        env["TF_USE_LEGACY_KERAS"] = "1"
    argv = [_python(variant), str(Path(__file__).resolve()), "--worker", variant, "--model", args.model,
            "--batch", str(args.batch), "--image-size", str(args.image_size), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--threads", str(args.threads), "--seed", str(args.seed)]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if res.returncode != 0 or not lines:
        return {"variant": variant, "ok": False, "error": (res.stdout + res.stderr)[-3000:]}
    return {**json.loads(lines[-1][len(RESULT_PREFIX):]), "ok": True, "error": None}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=3, help="every variant once per round (default 3)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per launch (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the tracing one (default 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=None, help="pixels (default: 224 for resnet50, 32 for small)")
    p.add_argument("--model", choices=("resnet50", "small"), default="resnet50")
    p.add_argument("--threads", type=int, default=1, help="TF intra- and inter-op threads (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/batch_norm.jsonl"))
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.image_size is None:
        args.image_size = 224 if args.model == "resnet50" else 32
    if args.worker:
        _worker(args)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        p.error(f"--variants {args.variants!r}: {unknown or 'none given'} not in {', '.join(VARIANTS)}.")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import append_jsonl, environment, run_id

    rid, records = run_id(), []
    medians: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for i in range(len(variants)):
            variant = variants[(r + i) % len(variants)]
            launch = _launch(variant, args)
            launch.update(record="launch", run_id=rid, round=r, position=i, model=args.model, batch=args.batch,
                          threads=args.threads)
            if launch["ok"]:
                medians[variant].append(statistics.median(launch["step_s"]))
                print(f"round {r} {variant:17s} median step {medians[variant][-1]:.3f} s "
                      f"({', '.join(f'{t:.3f}' for t in launch['step_s'])})", flush=True)
            else:
                print(f"round {r} {variant}: FAILED\n{launch['error']}", flush=True)
            records.append(launch)
    env = environment()
    for variant in variants:
        m = medians[variant]
        summary: dict[str, Any] = {"record": "summary", "run_id": rid, "variant": variant, "launches_ok": len(m),
                                   "median_step_s": statistics.median(m) if m else None,
                                   "min_step_s": min(m) if m else None, "max_step_s": max(m) if m else None,
                                   "environment": env}
        base = medians.get("tf_keras", [])
        if variant != "tf_keras" and base and len(base) == len(m):
            per_round = [b / v for b, v in zip(base, m, strict=True)]
            summary["tf_keras_over_this"] = {"median": statistics.median(per_round), "per_round": per_round}
            print(f"{variant:17s} median {summary['median_step_s']:.3f} s, tf_keras / this: "
                  f"{statistics.median(per_round):.2f} [{min(per_round):.2f}-{max(per_round):.2f}]", flush=True)
        records.append(summary)
    append_jsonl(args.out, records)
    failed = [r for r in records if r.get("record") == "launch" and not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
