"""Records the tf.data TFRecord reader reads per record a replica uses, when R does not divide the shard count.

The epoch plan (``hvrep.data.plan``) deals the records of each group of
shards to R replicas by the strided rule when R does not divide the shard
count (ImageNet's 1,024 shards on 3, 6, 24 or 40 ranks: what a requeue with
``--nodes=2-4`` produces). Reading whole groups, every replica read every
shard and kept 1/R: R times the I/O. The reader now reads each planned record
by its byte offset from the shard's DALI index. This script measures both on
synthetic shards (``--shards`` shards of ``--records`` records of
``--record-bytes`` bytes, DALI indexes as ``hvrep data prepare`` writes them,
``--group`` shards per group as ImageNet's 10,000-record shuffle buffer makes
of its ~1,250-record shards):

- ``indexed``: ``tfdata._planned_records`` (the reader hvrep uses);
- ``whole groups``: ``tfdata._whole_group_records`` (the reader before, and
  still the fallback for shards without an index).

For each R in ``--replicas`` and each variant, it iterates every replica's
share of one epoch and counts the bytes this process read meanwhile (the
kernel's count, ``rchar`` of ``/proc/self/io``: every read and pread of every
thread, so nothing is estimated from the code), as records of the synthetic
size. ``reads_per_used`` is records read / records used (the target: at most
1.25); ``same_samples`` that both variants yield exactly the plan's ids, in
the plan's order, with the same bytes. The reads before iteration (listing,
index files) are reported apart (``setup_bytes``). Wall time per variant is
recorded too (``--rounds`` passes each, round-robin, min and max), from the
page cache: the figure is about reads, not about a disk.

    python benchmarks/tfrecord_reads.py --replicas 3,6,24 --out results/tfrecord_reads.jsonl

Writes one JSON line per (R, variant).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import append_jsonl
from _common import environment as common_environment
from _common import run_id as new_run_id

FRAMING = 16  # a TFRecord record's bytes besides its data: length (8), its CRC (4), data CRC (4)
VARIANTS = ("indexed", "whole groups")


def bytes_read() -> int:
    """Bytes this process (all its threads) has read so far: ``rchar`` of /proc/self/io."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line: this benchmark needs Linux")


def write_shards(root: Path, shards: int, records: int, record_bytes: int, seed: int) -> None:
    """``shards`` TFRecord shards of ``records`` records each (``record_bytes`` random bytes) with DALI indexes."""
    from hvrep.data.files import shard_name
    from hvrep.data.prepare import _write_shard

    (root / "idx").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k in range(shards):
        name = shard_name("train", k, shards)
        if (root / name).is_file():
            continue
        data = [rng.bytes(record_bytes) for _ in range(records)]
        _write_shard(root / name, root / "idx" / f"{name}.idx", data)


def measure(root: Path, replicas: int, batch: int, group: int, record_bytes: int, seed: int,
            variant: str) -> dict[str, Any]:
    """One epoch of every replica's share through ``variant``: records used and read, and the samples."""
    from hvrep.data import tfdata
    from hvrep.data.files import list_shards
    from hvrep.data.plan import EpochPlan

    listing = list_shards(root, "train")
    plan = EpochPlan(listing.counts, seed, group=group)
    reader = tfdata._planned_records if variant == "indexed" else tfdata._whole_group_records
    used = read = setup = 0
    samples = []
    start = time.perf_counter()
    for r in range(replicas):
        share = plan.share(r, replicas, batch)
        before = bytes_read()
        ds, _ = reader(listing, plan, share, 0)
        it = iter(ds)
        mid = bytes_read()
        ids, data = [], []
        for record, i in it:
            ids.append(int(i))
            data.append(record.numpy())
        read += bytes_read() - mid
        setup += mid - before
        used += len(share.ids)
        samples.append((np.asarray(ids), share.ids, data))
        del it, ds
    seconds = time.perf_counter() - start
    return {"used": used, "read_bytes": read, "setup_bytes": setup, "seconds": seconds, "samples": samples,
            "rule": plan.rule(replicas), "record_bytes": record_bytes}


def _same(a: list, b: list, truth: dict[int, bytes]) -> bool:
    """Both variants yielded the plan's ids in its order, each with its record's bytes."""
    for (ids_a, plan_ids, data_a), (ids_b, _, data_b) in zip(a, b, strict=True):
        if not (np.array_equal(ids_a, plan_ids) and np.array_equal(ids_b, plan_ids)):
            return False
        if data_a != data_b or any(truth[int(i)] != d for i, d in zip(plan_ids, data_a, strict=True)):
            return False
    return True


def _truth(root: Path) -> dict[int, bytes]:
    """Every record's bytes by sample id, read sequentially (shards in order, records in file order)."""
    import tensorflow as tf

    from hvrep.data.files import list_shards

    listing = list_shards(root, "train")
    return dict(enumerate(r.numpy() for r in tf.data.TFRecordDataset(list(listing.shards))))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--replicas", default="3,6,24", help="comma-separated world sizes R (default 3,6,24)")
    p.add_argument("--shards", type=int, default=1024, help="TFRecord shards (default 1024, ImageNet's)")
    p.add_argument("--records", type=int, default=40, help="records per shard (default 40; ImageNet ~1,250)")
    p.add_argument("--record-bytes", type=int, default=1000, help="bytes of data per record (default 1000)")
    p.add_argument("--group", type=int, default=8, help="shards per group (default 8: ImageNet's)")
    p.add_argument("--batch", type=int, default=4, help="per-replica batch (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="passes of each variant, round-robin (default 2)")
    p.add_argument("--seed", type=int, default=0, help="the epoch's seed and the data's (default 0)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the synthetic shards are written (reused when there); default: a temporary folder")
    p.add_argument("--out", type=Path, default=Path("results/tfrecord_reads.jsonl"),
                   help="JSON lines file to append to (default results/tfrecord_reads.jsonl)")
    args = p.parse_args(argv)
    try:
        args.replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    except ValueError:
        p.error(f"--replicas must be comma-separated integers, got {args.replicas!r}.")
    for name in ("shards", "records", "record_bytes", "group", "batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not args.replicas or min(args.replicas) < 1:
        p.error(f"--replicas must name world sizes >= 1, got {args.replicas}.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvrep-tfrecord-reads-") as tmp:
        root = args.data_dir or Path(tmp)
        root = root / f"s{args.shards}-r{args.records}-b{args.record_bytes}-seed{args.seed}"
        write_shards(root, args.shards, args.records, args.record_bytes, args.seed)
        truth = _truth(root)
        run_id, env, records = new_run_id(), common_environment(), []
        record_size = args.record_bytes + FRAMING
        failed = False
        for replicas in args.replicas:
            results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    results[variant].append(measure(root, replicas, args.batch, args.group, args.record_bytes,
                                                     args.seed, variant))
            same = _same(results["indexed"][0]["samples"], results["whole groups"][0]["samples"], truth)
            for variant in VARIANTS:
                runs = results[variant]
                first = runs[0]
                records_read = first["read_bytes"] / record_size
                ratio = records_read / first["used"]
                rec = {
                    "benchmark": "tfrecord_reads", "run_id": run_id, "replicas": replicas, "variant": variant,
                    "rule": first["rule"], "shards": args.shards, "records_per_shard": args.records,
                    "record_bytes": args.record_bytes, "group": args.group, "batch": args.batch,
                    "records_used": first["used"], "bytes_read": first["read_bytes"],
                    "records_read": round(records_read, 1), "reads_per_used": round(ratio, 3),
                    "setup_bytes": first["setup_bytes"], "same_samples": same,
                    "bytes_read_per_round": [r["read_bytes"] for r in runs],
                    "seconds_min": round(min(r["seconds"] for r in runs), 3),
                    "seconds_max": round(max(r["seconds"] for r in runs), 3),
                    "environment": env,
                }
                records.append(rec)
                print(f"R={replicas:<3} {first['rule']:<8} {variant:<13} used {first['used']:>7,}  read "
                      f"{records_read:>10,.0f} records  = {ratio:5.2f}x  setup {first['setup_bytes']:>9,} B  "
                      f"{rec['seconds_min']:.2f}-{rec['seconds_max']:.2f} s  same samples: {same}")
            failed |= not same
        append_jsonl(args.out, records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
