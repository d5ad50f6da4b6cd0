"""The SN-GAN app's step on 2 replicas x B against 1 replica x 2B: every weight after a few SGD steps.

    mpirun -np 2 python -m mpi4py tests/multirank/sngan_worker.py --out DIR     # horovod 2 x B vs local 1 x 2B
    horovodrun -np 2 --gloo python tests/multirank/sngan_worker.py --out DIR    # the same under Gloo
    python tests/multirank/sngan_worker.py --out DIR --ingraph                  # local 2 x B vs horovod 1 x 2B

make test runs the last (test_sngan.py); the launched check runs as cases_sngan.py in the apps' shared launch,
with this file's ``_train``. The first two commands reproduce it on their own.

Each process trains the reference (one replica on the global batch of 2B) and the replicated run (its replica's
B of each update) from the same initial weights, then writes ``DIR/<mode>-rank<R>.json``: the largest
difference of every generator, discriminator and EMA-generator variable (trainable and not: spectral norm's
u, batch norm's moving statistics).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

STEPS, N_DIS, B, TOL = 3, 2, 4, 1e-4


def _data(num_replicas: int, replica: int) -> list[tuple]:
    """Per step: (images (N_DIS * b, 32, 32, 3), labels) of ``replica`` when the global batch 2B is dealt to
    ``num_replicas`` (each update's rows split in replica order)."""
    import numpy as np

    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, size=(STEPS, N_DIS, 2 * B, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=(STEPS, N_DIS, 2 * B)).astype(np.int32)
    b = 2 * B // num_replicas
    part = slice(replica * b, (replica + 1) * b)
    return [(x[s, :, part].reshape(N_DIS * b, 32, 32, 3), y[s, :, part].reshape(N_DIS * b)) for s in range(STEPS)]


def _train(repl) -> dict:
    import tensorflow as tf

    from examples.sngan.gan import SNGAN, GANConfig

    gan = SNGAN(repl, GANConfig(optimizer="sgd", lr_g=0.05, lr_d=0.05, n_dis=N_DIS, ema_decay=0.5))
    n = repl.num_replicas

    def input_fn(ctx):
        steps = _data(n, ctx.replica_id)
        xs = tf.constant([s[0] for s in steps])
        ys = tf.constant([s[1] for s in steps])
        return tf.data.Dataset.from_tensor_slices((xs, ys))

    for step, (x, y) in enumerate(repl.distribute_dataset(input_fn)):
        repl.reduce(gan.train_step(x, y, step), "mean")
    # Keyed by network and position: layer names get process-wide counters, which differ between the two runs.
    return {f"{label}[{i}] {v.path.split('/', 1)[-1]}": v.numpy()
            for label, net in (("G", gan.generator), ("D", gan.discriminator), ("G_ema", gan.ema))
            for i, v in enumerate(net.weights)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ingraph", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if args.ingraph:  # two logical CPU devices: the local backend's two in-graph replicas
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np

    import hvrep

    mode, record = "ingraph" if args.ingraph else "horovod", {}
    try:
        # In-graph: the reference is Horovod on this one process; launched: the local backend on one device.
        ref_repl = hvrep.Replicator("horovod" if args.ingraph else "local")
        dist_repl = hvrep.Replicator("local" if args.ingraph else "horovod")
        rank = dist_repl.rank
        assert ref_repl.num_replicas == 1 and dist_repl.num_replicas == 2, (ref_repl.num_replicas,
                                                                            dist_repl.num_replicas)
        want, got = _train(ref_repl), _train(dist_repl)
        assert len(want) == len(got), (len(want), len(got))
        diffs = {k: float(np.max(np.abs(w - g))) for (k, w), g in zip(want.items(), got.values(), strict=True)}
        moved = {k: float(np.max(np.abs(want[k]))) for k in want}
        record = {"mode": mode, "rank": rank, "backend": dist_repl.backend, "variables": len(diffs),
                  "max_diff": max(diffs.values()), "worst": max(diffs, key=diffs.get),
                  "bad": {k: d for k, d in diffs.items() if d > TOL}, "nonzero": sum(m > 0 for m in moved.values())}
    except Exception:  # the record says why; the test fails on it
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
        record = {"mode": mode, "rank": rank, "error": traceback.format_exc(limit=6)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{mode}-rank{record['rank']}.json").write_text(json.dumps(record))
    return 0 if "error" not in record else 1


if __name__ == "__main__":
    sys.exit(main())
