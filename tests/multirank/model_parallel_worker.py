"""Trains examples/model_parallel.py's two-stage model and records what test_model_parallel.py checks.

    python tests/multirank/model_parallel_worker.py --out DIR                    # local: 2 replicas x 2 CPUs
    horovodrun -np 2 --gloo python tests/multirank/model_parallel_worker.py --out DIR

Writes DIR/rank<R>.json: the largest difference between every replica's trained weights (and the step losses)
and one device trained on the whole batch, each replica's devices (from ``hvrep.replica_devices()`` inside the
step and from ``InputContext.devices``), the devices the variables live on, and, from TensorFlow's run metadata
of one step, the op types each device's partition graph executed; and how ``devices_per_replica=3`` was refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
GLOBAL_BATCH = 16
LR = 0.1


def _example():
    spec = importlib.util.spec_from_file_location("model_parallel", ROOT / "examples" / "model_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _short(device: str) -> str:
    return device.rpartition("device:")[2]  # "/job:localhost/replica:0/task:0/device:CPU:1" -> "CPU:1"


def _parts(variable) -> list:
    """Every device copy of a Keras variable's tf.Variable (one on horovod, one per replica in-graph)."""
    v = variable.value
    return list(getattr(v, "values", [v]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    ex = _example()

    import hvrep

    launched = hvrep.resolve_placement().size > 1
    ex.make_cpu_devices(2 if launched else 4)

    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.eager import context as tf_context

    # Three devices per replica: a rank's process has 2 (refused), the local backend's 4 do not divide by 3.
    try:
        hvrep.Replicator(devices_per_replica=3)
        refusal = None
    except hvrep.errors.HvrepError as e:
        refusal = {"type": type(e).__name__, "message": str(e)}
    repl = hvrep.Replicator(devices_per_replica=2)
    with repl.scope():
        stages = ex.build_stages(hvrep.replica_devices(), seed=repl.rank)  # ranks differ: scope() broadcasts
        optimizer = keras.optimizers.SGD(LR)
    variables = [v for s in stages for v in s.trainable_variables]
    start = [v.numpy().copy() for v in variables]
    variable_devices = {name: sorted({_short(p.device) for v in s.trainable_variables for p in _parts(v)})
                        for name, s in zip(("stage1", "stage2"), stages, strict=True)}

    seen_devices: list = []
    input_devices: list = []
    step = ex.make_step(stages, optimizer)

    def recording_step(x, y):
        seen_devices.append(list(hvrep.replica_devices()))  # at trace time, once per replica
        return step(x, y)

    x, y = ex.global_data(GLOBAL_BATCH, STEPS)
    input_fn = ex.input_fn_for(x, y, GLOBAL_BATCH)

    def recording_input_fn(ctx):
        input_devices.append(list(ctx.devices))
        return input_fn(ctx)

    losses = []
    executed: dict[str, set[str]] = {}
    for i, (xb, yb) in enumerate(repl.distribute_dataset(recording_input_fn, GLOBAL_BATCH)):
        if i == 0:  # TensorFlow records a function's partition graphs when it first instantiates it
            tf_context.enable_run_metadata()
        out = repl.run(recording_step, args=(xb, yb))
        if i == 0:
            metadata = tf_context.export_run_metadata()
            tf_context.disable_run_metadata()
            for fg in metadata.function_graphs:
                for pg in fg.partition_graphs:
                    for node in pg.node:
                        executed.setdefault(_short(node.device), set()).add(node.op)
        losses.append(float(repl.reduce(out, "mean")))

    # One device, the whole batch, the same start, plain TensorFlow.
    with tf.device("/device:CPU:0"):
        ref = [tf.Variable(w) for w in start]
        ref_losses = []
        for i in range(STEPS):
            xb, yb = x[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH], y[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]
            with tf.GradientTape() as tape:
                h = tf.tanh(xb @ ref[0] + ref[1])
                loss = tf.reduce_mean(tf.square(h @ ref[2] + ref[3] - yb))
            for v, g in zip(ref, tape.gradient(loss, ref), strict=True):
                v.assign_sub(LR * g)
            ref_losses.append(float(loss))
    got = [[p.numpy() for p in _parts(v)] for v in variables]
    record = {
        "num_replicas": repl.num_replicas,
        "steps": len(losses),
        "max_difference": max(float(np.max(np.abs(c - r.numpy()))) for cs, r in zip(got, ref, strict=True)
                              for c in cs),
        "loss_difference": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "weights_moved": max(float(np.max(np.abs(r.numpy() - s))) for r, s in zip(ref, start, strict=True)),
        "replica_devices": sorted(map(list, {tuple(d) for d in seen_devices})),
        "input_devices": sorted(input_devices),
        "variable_devices": variable_devices,
        "refusal": refusal,
        "executed": {d: sorted(ops) for d, ops in executed.items()},
    }
    (args.out / f"rank{repl.rank}.json").write_text(json.dumps(record, indent=1))
    repl.close()


if __name__ == "__main__":
    main()
