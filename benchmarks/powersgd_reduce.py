"""The gradient reduction of one ResNet-50 step, timed per scheme: fp32, fp16, PowerSGD at r = 1 and 4.

Each scheme is a ``Replicator("horovod", config=CommConfig(compression=...))`` running
``hvrep.all_reduce(grads, "mean", compress=True[, powersgd=state])`` on random gradients of
ResNet-50's 161 trainable shapes (PowerSGD's state built for the model's variables, default minimum
compression rate 2). It measures what PowerSGD costs and saves on THIS machine's link: the factors'
matmuls and Gram-Schmidt against the bytes not sent. On one host (loopback) the link is fast, so this
shows PowerSGD's compute overhead; over a slow link (benchmarks/slow_links.py on the namespace bed) the
bytes dominate.

Every scheme is warmed up (traced), then the schemes are timed round-robin, one call each per round;
before each timed call the ranks meet (outside the timer), the timer stops once this rank holds the
result, and a round's time is the slowest rank's. Payload: the bytes the backend was asked to reduce per
step (``Replicator.collective_bytes`` across the trace), next to ``hvrep.perf.costmodel.payload_bytes``.

Usage:
    horovodrun -np 2 --gloo python benchmarks/powersgd_reduce.py [--repeats N] [--out FILE]
    mpirun -np 2 python -m mpi4py benchmarks/powersgd_reduce.py [...]

Rank 0 prints one JSON line per scheme (and appends them to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SCHEMES = (("fp32", "none", 0), ("fp16", "fp16", 0), ("powersgd_r1", "powersgd", 1), ("powersgd_r4", "powersgd", 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep.perf import costmodel
    from hvrep.replica.powersgd import PowerSGDState

    model = hvrep.models.resnet50(num_classes=1000)
    variables = model.trainable_variables
    shapes = [tuple(v.shape) for v in variables]
    rng = np.random.default_rng(hvrep.resolve_placement().rank)
    grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]

    cases = []
    for name, compression, rank in SCHEMES:
        config = hvrep.CommConfig(compression=compression, powersgd_rank=max(rank, 1))
        repl = hvrep.Replicator("horovod", config=config)
        state = PowerSGDState(variables, config, repl.num_replicas) if compression == "powersgd" else None

        def step(gs, state=state):
            out = hvrep.all_reduce(list(gs), "mean", compress=True, powersgd=state)
            return out[-1][:1]

        before = repl.collective_bytes
        repl.run(step, args=(grads,)).numpy()  # traces
        payload = repl.collective_bytes - before
        predicted = costmodel.payload_bytes(shapes, "powersgd" if rank else name, powersgd_rank=max(rank, 1))
        cases.append({"name": name, "repl": repl, "step": step, "payload": payload, "predicted": predicted,
                      "times": []})

    for _ in range(1 + args.repeats):  # round 0: warm-up, not kept
        for case in cases:
            repl = case["repl"]
            repl.reduce(np.zeros(1), "sum")  # the ranks meet
            t0 = time.perf_counter()
            repl.run(case["step"], args=(grads,)).numpy()
            case["times"].append(float(repl.reduce(np.array(time.perf_counter() - t0), "max")))

    if hvrep.resolve_placement().rank == 0:
        for case in cases:
            times = case["times"][1:]
            record = {"benchmark": "powersgd_reduce", "scheme": case["name"], "ranks": case["repl"].num_replicas,
                      "payload_bytes": case["payload"], "cost_model_bytes": case["predicted"],
                      "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                      "repeats": len(times)}
            print(json.dumps(record))
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    for case in cases:
        case["repl"].close()


if __name__ == "__main__":
    main()
