"""One training step (forward, backward, all-reduce, update) per shape, in child processes that may crash.

A native crash (SIGSEGV, heap corruption: docs/troubleshooting.md, "Known issues") kills the process it
happens in, so each group of shapes runs in a child: ``python -m tests.shape_sweep --threads T --replicas R``
reads one shape per line (JSON) on stdin and prints one result per line; :func:`sweep` feeds a child all of
its group's shapes and, when the child dies, records the shape it was running as crashed (with the signal)
and starts another child on the rest. Used by tests/unit/known_issues/test_shape_sweep.py (make test) and
benchmarks/shape_sweep.py (wider).

A shape is ``{"model": "demo" | "stem", "width": W, "batch": B, "image": H}``: "demo" is
``hvrep.models.small_resnet(width=W)`` on H x H x 3 images (``hvrep train --config demo``'s model), "stem"
is ResNet-50's stem (conv1 7x7/2, bn_conv1, pool1) from ``hvrep.models.resnet50`` with a classifier on its
pooled output. B is the global batch: with R in-graph replicas (``Replicator("local")`` on R logical CPUs)
replica i gets B // R, plus one for i < B % R, so a B that does not divide by R gives unequal replicas.
The step is ``hvrep train``'s (``hvrep.train.steps.Runner``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Result:
    shape: dict
    threads: int
    replicas: int
    status: str  # "ok", "crashed: SIGSEGV" (the signal, or "exit N"), "error: ..." (a Python exception)
    loss: float | None = None

    def __str__(self) -> str:
        return f"{describe(self.shape)} threads={self.threads} replicas={self.replicas}: {self.status}"


def describe(shape: dict) -> str:
    width = f" width={shape['width']}" if shape["model"] == "demo" else ""
    return f"{shape['model']}{width} batch={shape['batch']} image={shape['image']}"


def sweep(shapes: Sequence[dict], threads: int, replicas: int, timeout: float = 600.0) -> list[Result]:
    """Each shape's result, in order: one child for all of them, another for the rest after each crash."""
    results: dict[int, Result] = {}
    todo = list(range(len(shapes)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    while todo:
        lines = "".join(json.dumps({"index": i, **shapes[i]}) + "\n" for i in todo)
        proc = subprocess.run([sys.executable, "-m", "tests.shape_sweep", "--threads", str(threads), "--replicas",
                               str(replicas)], input=lines, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec["event"] == "start":
                started = rec["index"]
            else:
                results[rec["index"]] = Result(shapes[rec["index"]], threads, replicas, rec["status"], rec.get("loss"))
        todo = [i for i in todo if i not in results]
        if not todo:
            break
        if proc.returncode == 0 or started is None or started in results:
            # The child ended without a shape in flight: setting up failed; say why for every shape left.
            tail = (proc.stderr or proc.stdout)[-2000:]
            for i in todo:
                results[i] = Result(shapes[i], threads, replicas, f"error: child exited {proc.returncode}: {tail}")
            break
        rc = proc.returncode
        why = f"crashed: {signal.Signals(-rc).name}" if rc < 0 else f"crashed: exit {rc}"
        tail = proc.stderr.strip().splitlines()[-1:]  # e.g. "free(): invalid size"
        tail = tail[0][:200] if tail else ""
        results[started] = Result(shapes[started], threads, replicas, f"{why} ({tail})" if tail else why)
        todo = [i for i in todo if i != started]
    return [results[i] for i in range(len(shapes))]


def _worker(threads: int, replicas: int, lines: Iterable[str]) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)

    import keras

    import hvrep
    from hvrep.models import resnet50, small_resnet
    from hvrep.train.steps import Runner

    repl = hvrep.Replicator("local")
    runners: dict[tuple, Runner] = {}
    for line in lines:
        shape = json.loads(line)
        index = shape.pop("index")
        print(json.dumps({"event": "start", "index": index}), flush=True)
        try:
            key = (shape["model"], shape.get("width"), shape["image"])
            if key not in runners:
                with repl.scope():
                    if shape["model"] == "demo":
                        model = small_resnet(input_shape=(shape["image"], shape["image"], 3), width=shape["width"])
                    else:
                        full = resnet50(input_shape=(shape["image"], shape["image"], 3))
                        pooled = keras.layers.GlobalAveragePooling2D()(full.get_layer("pool1").output)
                        model = keras.Model(full.input, keras.layers.Dense(10)(pooled))
                    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
                    optimizer.build(model.trainable_variables)
                runners[key] = Runner(repl, model, optimizer, num_classes=10, label_smoothing=0.0, fp16=False,
                                      jit_compile=False)
            runner = runners[key]
            batch, image = shape["batch"], shape["image"]

            def input_fn(ctx, batch=batch, image=image):
                n = batch // ctx.num_replicas + (ctx.replica_id < batch % ctx.num_replicas)
                x = tf.random.stateless_uniform([n, image, image, 3], seed=[ctx.replica_id, 1])
                y = tf.random.stateless_uniform([n], seed=[ctx.replica_id, 2], maxval=10, dtype=tf.int32)
                return tf.data.Dataset.from_tensors((x, y))

            x, y = next(iter(repl.distribute_dataset(input_fn)))
            loss, _ = runner.train(x, y)
            value = float(repl.reduce(loss, "mean"))
            print(json.dumps({"event": "end", "index": index, "status": "ok", "loss": value}), flush=True)
        except Exception as e:  # reported per shape; the sweep goes on with the next
            print(json.dumps({"event": "end", "index": index, "status": f"error: {type(e).__name__}: {e}"}),
                  flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    args = parser.parse_args()
    _worker(args.threads, args.replicas, sys.stdin)
