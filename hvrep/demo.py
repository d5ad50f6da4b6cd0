"""The smallest real multi-rank training run, until the training app lands.

Trains a small CNN on scikit-learn's handwritten digits (1,797 real 8×8
images that ship inside the package: nothing is downloaded) on every rank of a
``horovodrun``/``mpirun``/``srun`` job, data-parallel over Horovod's core ops:
initial weights broadcast from rank 0, gradients averaged with one grouped
all-reduce per step, and exact global validation accuracy from summed counts.
It ends by checking that every rank holds bit-identical weights.

    horovodrun -np 2 -H localhost:2 --gloo python -m hvrep.demo
    mpirun -np 2 python -m mpi4py -m hvrep.demo
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def _data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_val = 297
    return x[n_val:], y[n_val:], x[:n_val], y[:n_val]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hvrep demo: data-parallel CNN on the digits data set")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="per-replica batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="base learning rate at one replica")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    from hvrep import compat

    hvd = compat.import_horovod()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    chief = rank == 0

    x_train, y_train, x_val, y_val = _data(args.seed)
    # Each replica reads its own shard: every sample once per epoch.
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]
    xv_mine, yv_mine = x_val[rank::size], y_val[rank::size]

    keras.utils.set_random_seed(args.seed + rank)  # different on purpose: the broadcast must fix it
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    # Linear scaling rule: the global batch grows with the replicas.
    optimizer = keras.optimizers.SGD(learning_rate=args.lr * size, momentum=0.9)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    for i, v in enumerate(model.variables):
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"demo.init.{i}"))

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return hvd.allreduce(loss, op=hvd.Average, name="demo.loss")

    @tf.function
    def correct(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        pred = tf.argmax(model(x, training=False), axis=-1)
        return tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.int64))

    # Same number of steps on every rank, or the all-reduces would wait forever.
    steps = min(hvd.allgather(tf.constant([len(x_mine) // args.batch])).numpy())
    if chief:
        print(f"hvrep demo: {size} replica(s), {len(x_train)} train / {len(x_val)} val digits, "
              f"global batch {args.batch * size}, {steps} steps/epoch", flush=True)
    rng = np.random.default_rng(args.seed + 1000 * rank)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_mine))
        t0 = time.perf_counter()
        for s in range(steps):
            idx = order[s * args.batch:(s + 1) * args.batch]
            loss = train_step(tf.constant(x_mine[idx]), tf.constant(y_mine[idx]))
        dt = time.perf_counter() - t0
        hits = hvd.allreduce(correct(tf.constant(xv_mine), tf.constant(yv_mine)), op=hvd.Sum,
                             name=f"demo.hits.{epoch}")
        if chief:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {float(loss):.4f}  "
                  f"val top-1 {int(hits)}/{len(x_val)} = {int(hits) / len(x_val):.3f}  "
                  f"{steps * args.batch * size / dt:,.0f} images/s", flush=True)

    # Replicas must end bit-identical: compare with the chief's copy.
    drift = max(
        float(tf.reduce_max(tf.abs(v.value - hvd.broadcast(v.value, 0, name=f"demo.check.{i}"))))
        for i, v in enumerate(model.variables)
    )
    drift = float(hvd.allreduce(tf.constant(drift), op=hvd.Max, name="demo.drift"))
    accuracy = int(hits) / len(x_val)
    if chief:
        print(f"weights identical on all {size} replicas: {drift == 0.0} (max difference {drift:g})")
    ok = drift == 0.0 and accuracy > 0.9
    if chief and not ok:
        print("hvrep demo: FAILED (replicas diverged or accuracy <= 0.9)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
