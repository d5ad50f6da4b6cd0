"""A model split in two stages across each replica's two devices, data-parallel across replicas.

    python examples/model_parallel.py                                  # local: 2 replicas x 2 devices
    horovodrun -np 2 --gloo python examples/model_parallel.py          # 2 ranks x 2 devices each
    mpirun -np 2 python -m mpi4py examples/model_parallel.py

Stage 1 (a tanh layer) runs on the replica's first device, stage 2 (the output layer and the loss) on its
second; each stage's backward pass runs where its forward pass ran. On a machine without GPUs the devices are
logical CPU devices (this script makes them), so the split runs anywhere; with GPUs each replica takes two of
the node's GPUs. docs/model-parallel.md explains what runs where.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hvrep

STAGES = 2
FEATURES = 8
HIDDEN = 32


def make_cpu_devices(per_process: int) -> None:
    """Splits the CPU into ``per_process`` logical devices when there is no GPU (before TensorFlow starts)."""
    if not tf.config.list_physical_devices("GPU"):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * per_process)


def build_stages(devices: Sequence[str], seed: int = 0) -> list[keras.Model]:
    """The two stages, each built (its variables created) on its own device. Call inside ``repl.scope()``."""
    keras.utils.set_random_seed(seed)
    with tf.device(devices[0]):
        stage1 = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh")])
    with tf.device(devices[1]):
        stage2 = keras.Sequential([keras.Input((HIDDEN,)), keras.layers.Dense(1)])
    return [stage1, stage2]


def make_step(stages: Sequence[keras.Model], optimizer: keras.optimizers.Optimizer) -> Callable[..., Any]:
    """One replica's step: forward stage by stage, backward stage by stage, gradients averaged across replicas.

    ``tf.GradientTape`` puts every gradient op in the device scope that is current when ``tape.gradient`` is
    called, so each stage's backward pass is asked for under its own device: stage 2's gives the gradient at
    the stage boundary, which stage 1's backward pass takes as its ``output_gradients``.
    """
    stage1, stage2 = stages

    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        first, second = hvrep.replica_devices()
        with tf.GradientTape(persistent=True) as tape:
            with tf.device(first):
                h = stage1(x)
            with tf.device(second):
                loss = tf.reduce_mean(tf.square(stage2(h) - y))
        with tf.device(second):
            g_h, *g2 = tape.gradient(loss, [h, *stage2.trainable_variables])
        with tf.device(first):
            g1 = tape.gradient(h, stage1.trainable_variables, output_gradients=g_h)
        variables = [*stage1.trainable_variables, *stage2.trainable_variables]
        grads = hvrep.all_reduce([*g1, *g2], "mean", compress=True)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    return step


def global_data(global_batch: int, steps: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` global batches of a fixed regression problem: x [steps*global_batch, FEATURES], y [..., 1]."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch, FEATURES)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(FEATURES, 1))).astype(np.float32)
    return x, y


def input_fn_for(x: np.ndarray, y: np.ndarray, global_batch: int) -> Callable[[hvrep.InputContext], tf.data.Dataset]:
    """Each replica's slice of every global batch (replica i takes rows i*b ... i*b+b-1)."""

    def input_fn(ctx: hvrep.InputContext) -> tf.data.Dataset:
        b = ctx.per_replica_batch_size
        lo = ctx.replica_id * b
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).map(
            lambda xb, yb: (xb[lo:lo + b], yb[lo:lo + b]))

    return input_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args()

    # One replica per rank under a launcher, two replicas in one process otherwise.
    per_process = STAGES if hvrep.resolve_placement().size > 1 else 2 * STAGES
    make_cpu_devices(per_process)
    repl = hvrep.Replicator(devices_per_replica=STAGES)
    with repl.scope():
        stages = build_stages(hvrep.replica_devices())
        optimizer = keras.optimizers.SGD(args.learning_rate)
    step = make_step(stages, optimizer)
    x, y = global_data(args.global_batch, args.steps)
    for i, (xb, yb) in enumerate(repl.distribute_dataset(input_fn_for(x, y, args.global_batch), args.global_batch)):
        loss = repl.reduce(repl.run(step, args=(xb, yb)), "mean")
        if repl.is_chief and i % 5 == 0:
            print(f"step {i}: loss {float(loss):.4f} ({repl.num_replicas} replicas x {STAGES} devices)", flush=True)
    repl.close()


if __name__ == "__main__":
    main()
