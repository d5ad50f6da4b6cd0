"""The smallest real multi-rank training run, until the training app lands.

Trains a small ResNet on scikit-learn's handwritten digits (1,797 real 8×8
images that ship inside the package: nothing is downloaded), written once as
JPEG TFRecord shards by ``hvrep data demo`` and read through the same
pipeline as ImageNet (tf.data or DALI), with the replica API on every rank of
a ``horovodrun``/``mpirun``/``srun`` job (or on this machine's devices when
run alone): weights made identical by ``repl.scope()``, gradients averaged
with a fused all-reduce each step, and exact global validation accuracy from
summed counts (padding never counts). It ends by checking that every replica
holds bit-identical weights.

    horovodrun -np 2 -H localhost:2 --gloo python -m hvrep.demo
    mpirun -np 2 python -m mpi4py -m hvrep.demo
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hvrep demo: data-parallel CNN on the digits data set")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="per-replica batch size")
    parser.add_argument("--data-dir", default=None,
                        help="where the demo data set is written once (default: ~/.cache/hvrep/demo-data)")
    parser.add_argument("--backend", choices=("tfdata", "dali"), default="tfdata", help="input pipeline")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate at one replica (scaled linearly)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import hvrep
    from hvrep import _env
    from hvrep.data import DataConfig, data_errors, make_dataset, write_demo
    from hvrep.data.demo import TRAIN_IMAGES, VAL_IMAGES

    repl = hvrep.Replicator("auto")
    n = repl.num_replicas
    data_dir = Path(args.data_dir) if args.data_dir else _env.cache_dir() / "demo-data"
    if repl.is_chief:
        write_demo(data_dir)  # once; later runs reuse it
    repl.reduce(tf.constant(0), "sum")  # the others wait until the chief has written it
    # The digits go through the same JPEG readers and decoders as ImageNet. Their
    # augmentation is milder (no flips: a mirrored 3 is not a 3) at 32 pixels.
    config = DataConfig(str(data_dir / "tfrecord"), format="tfrecord", backend=args.backend, image_size=32,
                        resize_size=32, crop_scale=(0.8, 1.0), crop_ratio=(0.9, 1.1), flip=False, seed=args.seed)
    # A different seed on each process on purpose: scope() must make them agree.
    keras.utils.set_random_seed(args.seed + hvrep.resolve_placement().rank)
    with repl.scope():
        # No batch norm: then every variable, not only the trainable ones, must end identical.
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        # Linear scaling rule (the global batch grows with the replicas), with a
        # 2-epoch gradual warmup and cosine decay: the large-batch recipe in miniature.
        steps_per_epoch = TRAIN_IMAGES // (args.batch * n)
        schedule = hvrep.schedules.CosineDecayWithWarmup(
            hvrep.schedules.linear_scaling(args.lr, args.batch * n, base_batch=args.batch),
            total_steps=args.epochs * steps_per_epoch, warmup_steps=2 * steps_per_epoch)
        optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    epoch_config = config  # a new seed each epoch: new shuffle and augmentation, the same on every replica

    def train_input(ctx: hvrep.InputContext) -> tf.data.Dataset:
        return make_dataset(epoch_config, "train", ctx)

    def val_input(ctx: hvrep.InputContext) -> tf.data.Dataset:
        return make_dataset(config, "val", ctx, batch_size=args.batch)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(hvrep.all_reduce(grads, "mean"), model.trainable_variables, strict=True))
        return loss

    def correct(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        pred = tf.argmax(model(x, training=False), axis=-1, output_type=tf.int32)
        # Padding rows (label -1) make every replica's batches equal; they never count.
        return tf.reduce_sum(tf.cast(tf.logical_and(tf.equal(pred, y), y >= 0), tf.int64))

    def drift() -> tf.Tensor:
        # Every replica compares its weights with replica 0's copy.
        flat = tf.concat([tf.reshape(v.value, [-1]) for v in model.variables], 0)
        return tf.reduce_max(tf.abs(flat - hvrep.broadcast(flat, root=0)))

    global_batch = args.batch * n
    if repl.is_chief:
        print(f"hvrep demo: {n} replica(s) ({repl.backend}), {TRAIN_IMAGES} train / {VAL_IMAGES} val digit JPEGs "
              f"via {args.backend}, global batch {global_batch}", flush=True)
    accuracy = 0.0
    for epoch in range(args.epochs):
        epoch_config = dataclasses.replace(config, seed=args.seed + epoch)
        t0, steps = time.perf_counter(), 0
        with data_errors(epoch_config, "train"):
            for x, y in repl.distribute_dataset(train_input, global_batch_size=global_batch):
                loss = repl.run(train_step, args=(x, y))
                steps += 1
        dt = time.perf_counter() - t0
        hits = sum(int(repl.reduce(repl.run(correct, args=(x, y)), "sum"))
                   for x, y in repl.distribute_dataset(val_input))
        accuracy = hits / VAL_IMAGES
        mean_loss = float(repl.reduce(loss, "mean"))
        if repl.is_chief:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  val top-1 {hits}/{VAL_IMAGES} = "
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
