"""Bytes on the wire per step of local SGD (H = 1, 4, 16) against synchronous SGD, on one machine's loopback.

Two ranks under ``horovodrun --gloo`` (Gloo's collectives go over TCP, so over ``lo``) inside a network
namespace of their own, where nothing else touches ``lo``: the loopback's transmitted bytes are then this job's
wire bytes (each byte a rank sends crosses ``lo`` once). Each case trains ``hvrep train --config demo``'s model
(the small ResNet, width 16: 312,168 bytes of fp32 weights, 2,688 bytes of batch-norm statistics) through
``Replicator.wrap_optimizer(opt, model=model)`` on random 32x32 images, 32 per rank, for ``--steps`` steps
(a multiple of 16) after a warm-up of 16 steps, between two barriers.

Horovod's own traffic (its background thread's negotiation every cycle, whatever the step does) is measured
apart, by a baseline case that trains the same steps without ever synchronising (H longer than the run), and
subtracted per step (it varies with the load: 340-550 kB/s idle in two runs on a shared 2-core machine, so an
idle interval is a poor baseline). The rest, per step, is compared with the cost model's payload: a ring
all-reduce of S bytes on N ranks sends 2(N-1)/N x S from each rank, N x that in all
(``hvrep.perf.costmodel.local_sgd_bytes_per_step`` gives S). What is left above it is TCP/IP and Gloo's framing.

Usage (root, or a user allowed to create namespaces):
    unshare -n sh -c 'ip link set lo up && horovodrun -np 2 -H localhost:2 --gloo \\
        python benchmarks/local_sgd_bytes.py --out local_sgd_bytes.jsonl'

Rank 0 appends one JSON line per case to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# The baseline's H is longer than the run: it never synchronises, so its wire bytes are Horovod's own traffic
# while steps run (its background thread negotiates every cycle, busy or not).
NEVER = 10**9
CASES = (("no sync", NEVER), ("synchronous", None), ("local H=1", 1), ("local H=4", 4), ("local H=16", 16))
WARMUP = 16


def lo_tx_bytes() -> int:
    """Bytes transmitted on the loopback interface of this network namespace (``/proc/net/dev``)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.steps % 16:
        parser.error(f"--steps={args.steps} must be a multiple of 16 (every case ends on a synchronisation).")

    import keras
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep import models
    from hvrep.perf.costmodel import local_sgd_bytes_per_step
    from hvrep.replica.localsgd import averaged_state

    first = hvrep.Replicator("horovod")
    n = first.num_replicas
    rng = np.random.default_rng(first.rank)
    baseline = 0.0
    x = tf.constant(rng.normal(size=(32, 32, 32, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, size=(32,)).astype(np.int32))
    lines = []
    for name, h in CASES:
        repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_steps=h))
        with repl.scope():
            keras.utils.set_random_seed(0)
            model = models.small_resnet(10, (32, 32, 3), "channels_last", width=16)
            opt = repl.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9), model=model)

        def step(model=model, opt=opt) -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        for _ in range(WARMUP):
            repl.run(step)
        repl.reduce(tf.constant(0), "sum")
        before, t0 = lo_tx_bytes(), time.perf_counter()
        for _ in range(args.steps):
            loss = repl.run(step)
        repl.reduce(loss, "mean")
        wire, seconds = lo_tx_bytes() - before, time.perf_counter() - t0
        weights = sum(v.numpy().nbytes for v in model.trainable_variables)
        stats = sum(v.numpy().nbytes for v in averaged_state(model.non_trainable_variables))
        repl.close()
        if h == NEVER:
            baseline = wire / args.steps
            continue
        payload = local_sgd_bytes_per_step(weights, h, stats)
        predicted = n * 2 * (n - 1) / n * payload  # every rank's ring traffic
        measured = wire / args.steps - baseline
        lines.append({"case": name, "local_steps": h, "ranks": n, "steps": args.steps, "seconds": seconds,
                      "wire_bytes_per_step": wire / args.steps, "horovod_bytes_per_step": baseline,
                      "measured_bytes_per_step": measured, "payload_bytes_per_step": payload,
                      "predicted_ring_bytes_per_step": predicted, "measured_over_predicted": measured / predicted})
    if first.is_chief:
        print(f"{'case':<12} {'payload S':>10} {'ring 2(N-1)S':>12} {'measured':>10} {'ratio':>6} "
              f"{'all wire':>10}  (bytes per step; Horovod's own while training: {baseline:,.0f})")
        for r in lines:
            print(f"{r['case']:<12} {r['payload_bytes_per_step']:>10,.0f} {r['predicted_ring_bytes_per_step']:>12,.0f} "
                  f"{r['measured_bytes_per_step']:>10,.0f} {r['measured_over_predicted']:>6.2f} "
                  f"{r['wire_bytes_per_step']:>10,.0f}")
        if args.out:
            with args.out.open("a") as f:
                for r in lines:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
