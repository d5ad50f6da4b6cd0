"""Gloo's ring against its halving-doubling all-reduce, inside Horovod, sizes from 16 KB to 32 MB.

    python benchmarks/gloo_algorithms.py                     # ~1 min: 2 ranks, 5 rounds
    python benchmarks/gloo_algorithms.py --np 3 --rounds 7

One ``horovodrun --gloo`` launch; each rank pinned to the core of its local rank, TensorFlow's pools one thread
each. Per size, in each round both algorithms in turn (the order alternating round by round): ``--calls``
traced ``hvd.allreduce`` calls (a name with hvrep's flush marker, so Horovod's fusion window does not add its
cycle; hvrep/compat/horovod_patches.py) after 3 untimed ones, the algorithm switched between them by
``HVREP_GLOO_BCUBE_BYTES`` (read by hvrep's Horovod build at each all-reduce: 0 = the ring, 2**40 =
halving-doubling). Rank 0 appends one JSON line per size and algorithm (median, p10, p90 µs per call over
rounds) and one ``ratio`` line per size (ring over halving-doubling, per round), and prints them. hvrep's build
picks halving-doubling up to ``GLOO_BCUBE_BYTES`` (1 MiB) from this benchmark's results (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCHMARK = "gloo_algorithms"
PREFIX = "GLOO_ALGORITHMS "
SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20)
ALGORITHMS = {"ring": "0", "halving_doubling": str(1 << 40)}  # HVREP_GLOO_BCUBE_BYTES


def _worker(args: argparse.Namespace) -> int:
    local = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[local % len(cores)]})
    import numpy as np
    import tensorflow as tf

    from hvrep import compat
    from hvrep.compat import horovod_patches

    hvd = compat.import_horovod()
    hvd.init()
    samples: dict[tuple[int, str], list[float]] = {}
    for nbytes in args.sizes:
        x = tf.constant(np.ones(nbytes // 4, np.float32))
        step = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"{horovod_patches.FLUSH_NAME}_bench"))
        calls = max(3, args.calls * (256 << 10) // max(nbytes, 256 << 10))
        for setting in ALGORITHMS.values():
            os.environ["HVREP_GLOO_BCUBE_BYTES"] = setting
            for _ in range(3):
                y = step(x)
            assert float(y[0]) == hvd.size(), float(y[0])
        for rnd in range(args.rounds):
            order = list(ALGORITHMS) if rnd % 2 == 0 else list(reversed(ALGORITHMS))
            for name in order:
                os.environ["HVREP_GLOO_BCUBE_BYTES"] = ALGORITHMS[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    y = step(x)
                y.numpy()
                samples.setdefault((nbytes, name), []).append((time.perf_counter() - t0) / calls * 1e6)
    if hvd.rank() == 0:
        print(PREFIX + json.dumps([[n, a, us] for (n, a), us in samples.items()]), flush=True)
    hvd.shutdown()
    return 0


def _records(samples: list, size: int, base: dict) -> list[dict]:
    import _common

    by = {(n, a): us for n, a, us in samples}
    out = []
    for nbytes in sorted({n for n, _ in by}):
        for name in ALGORITHMS:
            us = by[(nbytes, name)]
            p = _common.percentiles(us)  # the unit is the samples': µs here
            out.append({**base, "kind": "allreduce", "bytes": nbytes, "algorithm": name, "ranks": size,
                        "us_median": round(p["median_ms"], 1), "us_p10": round(p["p10_ms"], 1),
                        "us_p90": round(p["p90_ms"], 1), "us": [round(u, 1) for u in us]})
        per_round = [r / h for r, h in zip(by[(nbytes, "ring")], by[(nbytes, "halving_doubling")], strict=True)]
        out.append({**base, "kind": "ratio", "bytes": nbytes, "ranks": size, "ring_over_halving_doubling":
                    [round(q, 3) for q in per_round], "median": round(statistics.median(per_round), 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40, help="calls per sample at 256 KB and below (fewer above)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="payloads in bytes")
    p.add_argument("--out", default="results/gloo_algorithms.jsonl")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    import _common

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "HOROVOD_"))}
    env.update(TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable,
           __file__, "--worker", "--rounds", str(args.rounds), "--calls", str(args.calls),
           "--sizes", *map(str, args.sizes)]
    load0 = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    lines = [ln.split(PREFIX, 1)[1] for ln in proc.stdout.splitlines() if PREFIX in ln]
    if proc.returncode != 0 or not lines:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
        return proc.returncode or 1
    base = {"benchmark": BENCHMARK, "run_id": _common.run_id(), "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)], "rounds": args.rounds,
            "command": "python benchmarks/gloo_algorithms.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            **_common.environment()}
    records = _records(json.loads(lines[-1]), args.np, base)
    _common.append_jsonl(Path(args.out), records)
    for r in records:
        if r["kind"] == "allreduce":
            spread = f"[{r['us_p10']:.0f}-{r['us_p90']:.0f}]"
            print(f"{r['bytes']:>9d} B {r['algorithm']:17s} {r['us_median']:9.1f} us {spread}")
        else:
            print(f"{r['bytes']:>9d} B ring / halving-doubling: median {r['median']:.2f}, per round "
                  f"{r['ring_over_halving_doubling']}")
    print(f"wrote {len(records)} line(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
