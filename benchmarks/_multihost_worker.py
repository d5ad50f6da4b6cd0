"""One launch of benchmarks/multihost.py, on every rank; rank 0 writes the results to ``--out`` (one JSON object).

    python _multihost_worker.py allreduce --sizes 524288,2097152,8388608 --counts 1,32 --out F.json
    python _multihost_worker.py train --thresholds 0,26214400 --compressions none,fp16 --overlap off,on --out F.json
    python _multihost_worker.py train --thresholds "" --schemes fp32,fp16,powersgd:4,local:4 --out F.json

``allreduce``: ``hvrep.all_reduce`` (mean) of k fp32 tensors holding S bytes
in all, one collective per tensor (``fusion_threshold_bytes=0``), for every
(S, k); the calibration points of the cost model.

``train``: the replica-API training step of a small ResNet on one synthetic
batch, timed for every setting (hvrep fusion threshold x compression x
overlap) and without any all-reduce ("compute": forward, backward and update
alone, every rank at once, so the compute time is the one of N ranks sharing
the machine). ``--schemes`` adds one case per communication scheme trained as
a user trains (``Replicator.wrap_optimizer`` on hvrep's default buckets, each
scheme its own model from the same seed): fp32, fp16, powersgd:R (rank R) and
local:H (local SGD; one timed call is H steps, ending on the synchronisation,
and its ``steps_per_call`` is H). All cases are timed round-robin, one step of each per round,
so a slow spell on the shared machine hits them alike.

Timing, both modes: the ranks meet at a barrier (outside the timer) before each
timed call; a call is timed to completion (the result read back); a round's
time is the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _words(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--sizes", type=_ints, required=True, help="bytes per call, comma-separated")
    a.add_argument("--counts", type=_ints, required=True, help="tensors (collectives) per call")
    t = sub.add_parser("train")
    t.add_argument("--width", type=int, default=32)
    t.add_argument("--batch", type=int, default=16, help="per-rank batch")
    t.add_argument("--image-size", type=int, default=32)
    t.add_argument("--thresholds", type=_ints, default=[25 * 1024 * 1024])
    t.add_argument("--compressions", type=_words, default=["none"])
    t.add_argument("--overlap", type=_words, default=["off"])
    t.add_argument("--schemes", type=_words, default=[], help="fp32, fp16, powersgd:R, local:H (wrap_optimizer)")
    for s in (a, t):
        s.add_argument("--warmup", type=int, default=2)
        s.add_argument("--repeats", type=int, default=8)
        s.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep import compat

    # The first Replicator starts Horovod: its own wire fusion stays at Horovod's default for the whole job.
    first = hvrep.Replicator("horovod", config=hvrep.CommConfig(fusion_threshold_bytes=0))
    hvd = compat.import_horovod()
    rank, size = int(hvd.rank()), int(hvd.size())
    one = tf.constant(0.0)

    def barrier() -> None:
        if size > 1:
            hvd.allreduce(one, op=hvd.Sum, name="multihost.barrier").numpy()

    cases: list[tuple[dict[str, Any], Any]] = []  # (description, call)
    if args.mode == "allreduce":
        for nbytes in args.sizes:
            for k in args.counts:
                n = max(1, nbytes // 4 // k)
                tensors = [tf.fill([n], float(rank + 1)) for _ in range(k)]
                scope = f"ar_{nbytes}_{k}"

                def fn(ts: list[tf.Tensor], scope: str = scope) -> list[tf.Tensor]:
                    with tf.name_scope(scope):
                        return hvrep.all_reduce(ts, "mean", compress=True)  # gradient-like: as configured

                def call(ts: list[tf.Tensor] = tensors, fn: Any = fn) -> None:
                    out = first.run(fn, args=(ts,))
                    out[0][0].numpy()
                    out[-1][0].numpy()

                cases.append(({"bytes": 4 * n * k, "collectives": k, "ranks": size}, call))
    else:
        cases = _train_cases(args, first, hvd, rank, size)

    for _, call in cases:
        for _ in range(args.warmup):
            barrier()
            call()
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.repeats):
        for i, (_, call) in enumerate(cases):
            barrier()
            t0 = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - t0)
    per_rank = hvd.allgather_object(times, name="multihost.times") if size > 1 else [times]
    if rank == 0:
        out = []
        for i, (desc, _) in enumerate(cases):
            rounds = [max(r[i][j] for r in per_rank) for j in range(args.repeats)]
            out.append({**desc, "seconds": rounds, "median_s": float(np.median(rounds))})
        args.out.write_text(json.dumps({"mode": args.mode, "ranks": size, "cases": out,
                                        "loadavg": list(os.getloadavg())}))
    return 0


def _train_cases(args: argparse.Namespace, first: Any, hvd: Any, rank: int, size: int) -> list:
    import keras
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep import models

    keras.utils.set_random_seed(0)
    with first.scope():
        model = models.small_resnet(10, (args.image_size, args.image_size, 3), width=args.width)
        opt = keras.optimizers.SGD(0.001, momentum=0.9)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables
    grad_bytes = 4 * sum(int(np.prod(v.shape)) for v in variables)
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.standard_normal((args.batch, args.image_size, args.image_size, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch).astype(np.int32))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_step(reduce: bool, overlap: bool, scope: str):
        def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            with tf.name_scope(scope):
                with tf.GradientTape() as tape:
                    loss = loss_fn(yb, model(xb, training=True))
                grads = tape.gradient(loss, variables)
                if reduce:
                    if not overlap:
                        # Overlap off: no bucket may leave before the whole backward pass is done, as in a step
                        # that reduces after backward; the alpha-beta model with overlap 0 describes this one.
                        with tf.control_dependencies(grads):
                            grads = [tf.identity(g) for g in grads]
                    grads = hvrep.all_reduce(grads, "mean", compress=True)
                opt.apply_gradients(zip(grads, variables, strict=True))
                return loss
        return step

    cases = []

    def add(desc: dict[str, Any], repl: Any, step: Any) -> None:
        def call() -> None:
            before = repl.collective_calls
            repl.run(step, args=(x, y)).numpy()
            desc["collectives"] = repl.collective_calls - before or desc.get("collectives", 0)
        cases.append((desc, call))

    common = {"ranks": size, "grad_bytes": grad_bytes, "tensors": len(variables), "batch": args.batch,
              "width": args.width, "image_size": args.image_size}
    add({**common, "case": "compute", "collectives": 0}, first, make_step(False, False, "compute"))
    if size > 1:
        for threshold in args.thresholds:
            for compression in args.compressions:
                repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(fusion_threshold_bytes=threshold,
                                                                           compression=compression))
                for overlap in args.overlap:
                    scope = f"step_T{threshold}_{compression}_{overlap}"
                    add({**common, "case": "step", "fusion_threshold_bytes": threshold, "compression": compression,
                         "overlap": overlap == "on"}, repl, make_step(True, overlap == "on", scope))
        for scheme in args.schemes:
            cases.append(_scheme_case(args, scheme, common, x, y, loss_fn))
    return cases


def scheme_config(scheme: str) -> tuple[dict[str, Any], int]:
    """CommConfig fields and steps per timed call for ``fp32``, ``fp16``, ``powersgd:R``, ``local:H``."""
    kind, _, arg = scheme.partition(":")
    if kind == "fp32" and not arg:
        return {}, 1
    if kind == "fp16" and not arg:
        return {"compression": "fp16"}, 1
    if kind == "powersgd" and arg.isdigit() and int(arg) >= 1:
        return {"compression": "powersgd", "powersgd_rank": int(arg)}, 1
    if kind == "local" and arg.isdigit() and int(arg) >= 1:
        return {"local_steps": int(arg)}, int(arg)
    raise SystemExit(f"--schemes: {scheme!r} is not fp32, fp16, powersgd:R or local:H")


def _scheme_case(args: argparse.Namespace, scheme: str, common: dict[str, Any], x: Any, y: Any,
                 loss_fn: Any) -> tuple[dict[str, Any], Any]:
    import keras
    import tensorflow as tf

    import hvrep
    from hvrep import models

    fields, per_call = scheme_config(scheme)
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(**fields))
    with repl.scope():
        keras.utils.set_random_seed(0)
        model = models.small_resnet(10, (args.image_size, args.image_size, 3), width=args.width)
        opt = repl.wrap_optimizer(keras.optimizers.SGD(0.001, momentum=0.9),
                                  model=model if "local_steps" in fields else None)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables

    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.name_scope(f"scheme_{scheme.replace(':', '_')}"):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables, strict=True))
            return loss

    desc = {**common, "case": "scheme", "scheme": scheme, "steps_per_call": per_call, "config": fields}

    def call() -> None:
        before = repl.collective_calls
        for _ in range(per_call):  # local SGD: H steps, the last one synchronising
            repl.run(step, args=(x, y)).numpy()
        # Counted when the step is traced (the first call): keep that count.
        desc["collectives"] = repl.collective_calls - before or desc.get("collectives", 0)
    return desc, call


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
