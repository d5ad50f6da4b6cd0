"""The smallest real multi-rank training run, until the training app lands.

Trains a small CNN on scikit-learn's handwritten digits (1,797 real 8×8
images that ship inside the package: nothing is downloaded) through the
replica API on every rank of a ``horovodrun``/``mpirun``/``srun`` job (or on
this machine's devices when run alone): weights made identical by
``repl.scope()``, gradients averaged with a fused all-reduce each step, and
exact global validation accuracy from summed counts (padding never counts).
It ends by checking that every replica holds bit-identical weights.

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
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="per-replica batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="base learning rate at one replica")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import hvrep

    repl = hvrep.Replicator("auto")
    n = repl.num_replicas
    x_train, y_train, x_val, y_val = _data(args.seed)
    # A different seed on each process on purpose: scope() must make them agree.
    keras.utils.set_random_seed(args.seed + hvrep.resolve_placement().rank)
    with repl.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        # Linear scaling rule: the global batch grows with the replicas.
        optimizer = keras.optimizers.SGD(learning_rate=args.lr * n, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_input(ctx: hvrep.InputContext) -> tf.data.Dataset:
        data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        # Same shuffle order everywhere, then each replica keeps its shard:
        # every sample once per epoch, the same number of steps on every replica.
        data = data.shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True)
        return ctx.shard(data).batch(ctx.per_replica_batch_size, drop_remainder=True)

    def val_input(ctx: hvrep.InputContext) -> tf.data.Dataset:
        # Pad to a multiple of the replicas; padded rows carry label -1 and never count.
        pad = (-len(x_val)) % n
        xv = np.concatenate([x_val, np.zeros((pad, *x_val.shape[1:]), x_val.dtype)])
        yv = np.concatenate([y_val, -np.ones(pad, y_val.dtype)])
        return ctx.shard(tf.data.Dataset.from_tensor_slices((xv, yv))).batch(len(xv) // n)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(hvrep.all_reduce(grads, "mean"), model.trainable_variables, strict=True))
        return loss

    def correct(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        pred = tf.argmax(model(x, training=False), axis=-1, output_type=tf.int64)
        return tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.int64))

    def drift() -> tf.Tensor:
        # Every replica compares its weights with replica 0's copy.
        flat = tf.concat([tf.reshape(v.value, [-1]) for v in model.variables], 0)
        return tf.reduce_max(tf.abs(flat - hvrep.broadcast(flat, root=0)))

    global_batch = args.batch * n
    if repl.is_chief:
        print(f"hvrep demo: {n} replica(s) ({repl.backend}), {len(x_train)} train / {len(x_val)} val digits, "
              f"global batch {global_batch}", flush=True)
    accuracy = 0.0
    for epoch in range(args.epochs):
        t0, steps = time.perf_counter(), 0
        for x, y in repl.distribute_dataset(train_input, global_batch_size=global_batch):
            loss = repl.run(train_step, args=(x, y))
            steps += 1
        dt = time.perf_counter() - t0
        hits = sum(int(repl.reduce(repl.run(correct, args=(x, y)), "sum"))
                   for x, y in repl.distribute_dataset(val_input))
        accuracy = hits / len(x_val)
        mean_loss = float(repl.reduce(loss, "mean"))
        if repl.is_chief:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  val top-1 {hits}/{len(x_val)} = "
                  f"{accuracy:.3f}  {steps * global_batch / dt:,.0f} images/s", flush=True)

    max_drift = float(repl.reduce(repl.run(drift), "max"))
    if repl.is_chief:
        print(f"weights identical on all {n} replicas: {max_drift == 0.0} (max difference {max_drift:g})")
    ok = max_drift == 0.0 and accuracy > 0.9
    if repl.is_chief and not ok:
        print("hvrep demo: FAILED (replicas diverged or accuracy <= 0.9)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
