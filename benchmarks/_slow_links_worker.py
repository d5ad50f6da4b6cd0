"""One launch of benchmarks/slow_links.py (one seed at one link rate), on every rank of ``horovodrun --gloo``.

    python _slow_links_worker.py --seed 0 --schemes sync_fp32,powersgd_r1 --steps 384 --out F.jsonl

Trains the workload (a wide MLP on a synthetic Gaussian-mixture task, see
:func:`make_task`) once per scheme, in the order given, from the same initial
weights and the same batches (both set by ``--seed``), and evaluates it on the
whole validation set every ``--eval-every`` steps (a multiple of every H, so
local SGD is evaluated right after a synchronisation, when every replica holds
the same model). Rank 0 appends JSON lines to ``--out`` as it goes (a launch
cut short keeps what it finished):

* ``kind: "nosync"``, right before each scheme: the step with no communication
  at all (local SGD whose H is longer than the run): the compute time per step,
  both ranks computing at once, and Horovod's own bytes per second on the links
  (its background thread negotiates every cycle whatever the step does).
* ``kind: "curve"``: one line per evaluation: step, wall_s (training seconds
  since the start, evaluation and the first, tracing, step left out), val_acc,
  and the interval's step-time breakdown.
* ``kind: "run"``: one line per scheme: final accuracy, step-time breakdown,
  bytes on the links (counted by the kernel on each host's ``hv0`` veth, the
  counters ``NetBed.counters()`` reads) against the cost model's payload.
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

# The outer optimizer of the DiLoCo-style schemes. Not DiLoCo's own outer_lr 0.7, momentum 0.9: those were tuned
# for H = 500 inner (AdamW) steps. At H = 4 or 16 the outer step comes every few steps, on top of the inner SGD's
# own momentum 0.9 and a learning rate tuned for synchronous SGD, and Nesterov momentum 0.9 with lr 0.7 applies a
# steady delta 0.7 / (1 - 0.9) = 7 times: on this workload (seed 0) H = 4 diverged to chance and H = 16 fell to
# 0.78. outer_lr / (1 - outer_momentum) = 1 applies a steady delta once, as plain averaging does, and lets the
# momentum smooth the rounds' deltas: 0.5 / 0.5 and 0.3 / 0.7 both ended at 0.92-0.93, 1.0 / 0.5 (twice the
# step) plateaued at 0.89 (one tuning launch each, seed 0 at 1 Gbit/s; docs/slow-links.md).
OUTER = {"outer_optimizer": "nesterov", "outer_lr": 0.5, "outer_momentum": 0.5}
# name -> CommConfig fields; the eight schemes of issue 38.
SCHEMES: dict[str, dict[str, Any]] = {
    "sync_fp32": {},
    "sync_fp16": {"compression": "fp16"},
    "powersgd_r1": {"compression": "powersgd", "powersgd_rank": 1},
    "powersgd_r4": {"compression": "powersgd", "powersgd_rank": 4},
    "local_h4": {"local_steps": 4},
    "local_h4_nesterov": {"local_steps": 4, **OUTER},
    "local_h16": {"local_steps": 16},
    "local_h16_nesterov": {"local_steps": 16, **OUTER},
}
NEVER = 10**9  # the no-sync case's H: longer than any run
# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the headers each packet counted on a veth carries. A veth
# counts a GSO super-packet (up to 64 KiB) once, with one set of headers, as it passes it on whole.
HEADER_BYTES = 66
IFACE_STATS = Path("/sys/class/net/hv0/statistics")


def make_task(seed: int, train: int, val: int, dim: int = 128, classes: int = 10, modes: int = 3,
              separation: float = 4.0) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """A learnable, not linearly separable task: ``classes`` classes, each a mixture of ``modes`` Gaussians.

    Centres ~ N(0, separation^2 / dim) per coordinate, noise N(0, 1): overlapping clusters, so accuracy
    plateaus below 100% (about 92.5% for the MLP here). Returns float32 [n, dim] inputs and int32 labels,
    the same for a given seed on every rank.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, modes, dim)).astype(np.float32) * separation / np.sqrt(dim)

    def draw(n: int) -> tuple[Any, Any]:
        y = rng.integers(0, classes, n)
        x = centres[y, rng.integers(0, modes, n)] + rng.normal(size=(n, dim)).astype(np.float32)
        return x.astype(np.float32), y.astype(np.int32)

    return draw(train), draw(val)


def link_counters() -> list[int]:
    """This host's hv0 [tx_bytes, tx_packets, rx_bytes, rx_packets] (the rank runs in its host's namespace)."""
    return [int((IFACE_STATS / k).read_text()) for k in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--schemes", required=True, help="comma-separated names of SCHEMES, run in this order")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--max-train-s", type=float, required=True, help="stop at the first evaluation past this")
    p.add_argument("--batch", type=int, required=True, help="per-rank batch")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--train-examples", type=int, required=True)
    p.add_argument("--val-examples", type=int, required=True)
    p.add_argument("--nosync-steps", type=int, required=True)
    p.add_argument("--data-seed", type=int, required=True)
    p.add_argument("--outer-lr", type=float, default=OUTER["outer_lr"])
    p.add_argument("--outer-momentum", type=float, default=OUTER["outer_momentum"])
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep.perf import costmodel

    first = hvrep.Replicator("horovod")
    rank, n = first.rank, first.num_replicas
    (x, y), (xv, yv) = make_task(args.data_seed, args.train_examples, args.val_examples)
    xv_mine, yv_mine = tf.constant(xv[rank::n]), tf.constant(yv[rank::n])
    # The seed's batches: one permutation per epoch; global batch i is perm[i*B*n:(i+1)*B*n], rank r takes its
    # r-th slice, so every scheme sees the same examples in the same order.
    order = np.concatenate([np.random.default_rng((args.seed, e)).permutation(len(x))
                            for e in range(-(-args.steps * args.batch * n // len(x)))])

    def emit(record: dict[str, Any]) -> None:
        if rank == 0:
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def build(repl: Any, local: bool) -> tuple[Any, Any]:
        with repl.scope():
            keras.utils.set_random_seed(args.seed)
            model = keras.Sequential([keras.Input((x.shape[1],)),
                                      keras.layers.Dense(args.width, activation="relu"),
                                      keras.layers.Dense(args.width, activation="relu"),
                                      keras.layers.Dense(int(y.max()) + 1)])
            opt = repl.wrap_optimizer(keras.optimizers.SGD(args.lr, momentum=0.9), model=model if local else None)
            opt.build(model.trainable_variables)
        return model, opt

    def train(name: str, fields: dict[str, Any], steps: int, evaluate: bool) -> dict[str, Any]:
        repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(**fields))
        model, opt = build(repl, "local_steps" in fields)

        @tf.function
        def correct() -> tf.Tensor:
            logits = model(xv_mine, training=False)
            return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), yv_mine), tf.int64))

        def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = model(xb, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        def batch(s: int) -> tuple[tf.Tensor, tf.Tensor]:
            lo = (s - 1) * args.batch * n + rank * args.batch
            idx = order[lo:lo + args.batch]
            return tf.constant(x[idx]), tf.constant(y[idx])

        def accuracy(stop: bool) -> tuple[float, bool]:
            got = repl.reduce(np.array([int(correct()), int(stop)], np.int64), "sum")
            return float(got[0]) / len(yv), bool(got[1])

        curve = []
        if evaluate:
            acc, _ = accuracy(False)
            curve.append({"step": 0, "wall_s": 0.0, "val_acc": acc})
        first.reduce(np.zeros(1), "sum")  # both ranks start together
        counters0, elapsed0 = link_counters(), time.perf_counter()
        train_s, interval_s, interval_steps, step_times, s = 0.0, 0.0, 0, [], 0
        for s in range(1, steps + 1):
            xb, yb = batch(s)
            t0 = time.perf_counter()
            repl.run(step, args=(xb, yb)).numpy()
            dt = time.perf_counter() - t0
            if s > 1:  # the first step traces and compiles: left out of every time
                train_s += dt
                interval_s += dt
                interval_steps += 1
                step_times.append(dt)
            if evaluate and s % args.eval_every == 0:
                acc, stop = accuracy(train_s > args.max_train_s)  # every rank stops if one is past the cap
                curve.append({"step": s, "wall_s": train_s, "val_acc": acc,
                              "interval_step_s": interval_s / max(1, interval_steps)})
                interval_s, interval_steps = 0.0, 0
                if stop:
                    break
        elapsed = time.perf_counter() - elapsed0
        counters = np.array(link_counters(), np.float64) - np.array(counters0, np.float64)
        counters = repl.reduce(counters, "sum")  # both hosts' links
        shapes = [tuple(v.shape) for v in model.trainable_variables]
        weights = 4 * sum(int(np.prod(sh)) for sh in shapes)
        if "local_steps" in fields:
            payload = costmodel.local_sgd_bytes_per_step(weights, fields["local_steps"])
        else:
            cfg = repl.config
            scheme = {"none": "fp32"}.get(cfg.compression, cfg.compression)
            payload = costmodel.payload_bytes(shapes, scheme, powersgd_rank=cfg.powersgd_rank,
                                              powersgd_min_compression_rate=cfg.powersgd_min_compression_rate)
        repl.close()
        return {"scheme": name, "steps": s, "train_s": train_s, "elapsed_s": elapsed, "curve": curve,
                "step_s": float(np.median(step_times)) if step_times else None,
                "step_s_mean": train_s / max(1, len(step_times)),
                "tx_bytes": counters[0], "tx_packets": counters[1], "rx_bytes": counters[2],
                "rx_packets": counters[3], "weight_bytes": weights, "shapes": [list(sh) for sh in shapes],
                "payload_bytes_per_step": payload,
                "predicted_ring_bytes_per_step": n * costmodel.ring_wire_bytes(n, payload)}

    common = {"benchmark": "slow_links", "seed": args.seed, "ranks": n, "ok": True}
    for name in args.schemes.split(","):
        # Right before each scheme (the shared machine's load drifts within minutes): the step with no collective,
        # for the scheme's compute time, and Horovod's own bytes while training without any collective, headers
        # apart, per second (its background thread cycles on time, not per step).
        nosync = train("nosync", {"local_steps": NEVER}, args.nosync_steps, evaluate=False)
        horovod_Bps = (nosync["tx_bytes"] - HEADER_BYTES * nosync["tx_packets"]) / nosync["elapsed_s"]
        compute_s = nosync["step_s"]
        emit({**common, "kind": "nosync", "before": name, "steps": nosync["steps"], "compute_s": compute_s,
              "horovod_bytes_per_s": horovod_Bps, "tcpip_bytes_per_s": HEADER_BYTES * nosync["tx_packets"]
              / nosync["elapsed_s"], "tx_bytes": nosync["tx_bytes"], "elapsed_s": nosync["elapsed_s"],
              "weight_bytes": nosync["weight_bytes"], "loadavg": list(os.getloadavg())})
        fields = dict(SCHEMES[name])
        if "outer_optimizer" in fields:
            fields.update(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
        r = train(name, fields, args.steps, evaluate=True)
        for point in r["curve"]:
            step_s = point.get("interval_step_s")
            emit({**common, "kind": "curve", "scheme": name, **point, "compute_s": compute_s,
                  "comm_s": None if step_s is None else max(0.0, step_s - compute_s)})
        tcpip = HEADER_BYTES * r["tx_packets"]
        horovod = horovod_Bps * r["elapsed_s"]
        measured = (r["tx_bytes"] - tcpip - horovod) / r["steps"]
        step_s = r["step_s_mean"]
        emit({**common, "kind": "run", "scheme": name, "config": fields, "steps": r["steps"],
              "wall_s": r["train_s"], "final_val_acc": r["curve"][-1]["val_acc"],
              "step_s": step_s, "step_s_median": r["step_s"], "compute_s": compute_s,
              "comm_s": max(0.0, step_s - compute_s), "comm_share": max(0.0, step_s - compute_s) / step_s,
              "payload_bytes_per_step": r["payload_bytes_per_step"],
              "predicted_ring_bytes_per_step": r["predicted_ring_bytes_per_step"],
              "wire_bytes_per_step": r["tx_bytes"] / r["steps"], "tcpip_bytes_per_step": tcpip / r["steps"],
              "horovod_bytes_per_step": horovod / r["steps"], "measured_payload_bytes_per_step": measured,
              "measured_over_predicted": measured / r["predicted_ring_bytes_per_step"],
              "weight_bytes": r["weight_bytes"], "elapsed_s": r["elapsed_s"], "loadavg": list(os.getloadavg())})
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
