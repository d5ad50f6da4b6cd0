"""What starting an epoch's training input costs: the part of a short epoch that does not shrink with ranks.

`hvrep train` builds each epoch's tf.data pipeline anew (its own order and seed, ``hvrep.data.make_dataset``),
after the previous epoch's last step. This times, for the demo's training split on one core (the process
pinned, ``threads=1``: one rank of the 2-rank demo), per epoch after the first:

  build       make_dataset: the plan, the dataset's graph and tracing its functions (Python)
  iterator    iter(): TensorFlow instantiates the pipeline (its graph rewrites and functions)
  first       the first batch
  per_batch   each later batch, the iterator drained (the steady cost a rank pays beside its steps)

Epoch e's pipeline is built as the controller builds it (``data.seed`` + ``train.seed`` x 1000 + e), global
batch 32 on one replica. JSON lines, one per epoch, and a median summary.

    python benchmarks/epoch_start.py --epochs 6        # appends to benchmarks/results/epoch_start.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, run_id

PARTS = ("build_ms", "iterator_ms", "first_ms", "per_batch_ms")


def measure(data_dir: str, epochs: int, batch: int, threads: int) -> list[dict[str, float]]:
    from hvrep.data import make_dataset
    from hvrep.train.config import preset

    cfg = preset("demo")
    data = dataclasses.replace(cfg.data, data_dir=data_dir)
    rows = []
    for epoch in range(epochs):
        epoch_cfg = dataclasses.replace(data, seed=data.seed + cfg.train.seed * 1000 + epoch)
        t0 = time.perf_counter()
        ds = make_dataset(epoch_cfg, "train", None, batch, threads=threads)
        t1 = time.perf_counter()
        it = iter(ds)
        t2 = time.perf_counter()
        next(it)
        t3 = time.perf_counter()
        rest = sum(1 for _ in it)
        t4 = time.perf_counter()
        rows.append({"epoch": epoch, "build_ms": 1e3 * (t1 - t0), "iterator_ms": 1e3 * (t2 - t1),
                     "first_ms": 1e3 * (t3 - t2), "per_batch_ms": 1e3 * (t4 - t3) / max(rest, 1),
                     "batches": rest + 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=6, help="epochs built (the first, which warms up, not counted)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="train.threads (tf.data's private pool)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    p.add_argument("--data-dir", default=None, help="the demo's TFRecords (default: written to a temporary folder)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "epoch_start.jsonl"))
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch warms up and is not counted")
    core = None
    if not args.no_pin:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
    rid = run_id()
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = args.data_dir
        if data_dir is None:
            from hvrep.data import write_demo

            write_demo(Path(scratch))
            data_dir = str(Path(scratch) / "tfrecord")
        rows = measure(data_dir, args.epochs, args.batch, args.threads)
    common = {"run_id": rid, "benchmark": "epoch_start", "batch": args.batch, "threads": args.threads, "core": core}
    append_jsonl(Path(args.out), [{**common, **row} for row in rows])
    counted = rows[1:]
    summary = {part: statistics.median(r[part] for r in counted) for part in PARTS}
    append_jsonl(Path(args.out), [{**common, "summary": True, "epochs_counted": len(counted), **summary}])
    for row in counted:
        print(f"epoch {row['epoch']}: " + ", ".join(f"{part[:-3]} {row[part]:.1f} ms" for part in PARTS))
    start = summary["build_ms"] + summary["iterator_ms"] + summary["first_ms"]
    print(f"median: build {summary['build_ms']:.1f} + iterator {summary['iterator_ms']:.1f} + first batch "
          f"{summary['first_ms']:.1f} = {start:.1f} ms to start an epoch; then "
          f"{summary['per_batch_ms']:.2f} ms a batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
