"""Where a one-tensor all-reduce's cost lies under ``mpirun``: hvrep, plain Horovod and MPI floors side by side.

    python benchmarks/allreduce_parts.py --out results/allreduce_parts.jsonl            # 4 MB, ~1 min
    python benchmarks/allreduce_parts.py --bytes 262144 --rounds 3 --inner 5 --out "$(mktemp -d)/x.jsonl"

2 ranks under ``mpirun``, each pinned to the core of its local rank, one TensorFlow thread each (as
``benchmarks/step_overhead.py``). One tensor of ``--bytes`` of fp32, every contender once per round, a sample
being ``--inner`` back-to-back calls after a barrier, the slowest rank's:

* ``hvrep_sum``, ``hvrep_mean``: ``Replicator.run`` of ``hvrep.all_reduce([tf.identity(x)], op)``;
  ``hvrep_without``: the same step returning ``tf.identity(x)`` (their difference is hvrep's cost).
* ``horovod_cycle``: plain ``hvd.allreduce(x)`` in a ``tf.function``, as Horovod's own examples call it (its
  background thread waits a cycle, ``HOROVOD_CYCLE_TIME``, before negotiating); ``horovod_flush``: the same op
  named with hvrep's flush marker (hvrep's Horovod build starts the cycle at once, as it does for hvrep's
  reductions); ``horovod_flush_postscale``: that with Horovod's ``postscale_factor=0.5`` (Horovod scales the
  result in place); ``horovod_without``: the ``tf.function`` returning ``tf.identity(x)``.
* ``scale``: a ``tf.function`` of ``x * 0.5`` alone (what a mean's scaling pass costs).
* floors: ``mpi4py`` ``Allreduce`` of the same bytes on buffers of 4 KB pages (TensorFlow's allocator does
  not ask for transparent huge pages): ``floor_fixed`` on one send and one receive buffer, every call (hot in
  the caches), ``floor_rotating`` cycling over 4 pairs of them, as a step's freshly allocated tensors cycle
  over the allocator's blocks.

JSON lines, ``"benchmark": "allreduce_parts"``: ``check`` (every contender's sum checked once: 1 + 2 on the two
ranks), ``sample`` (contender, bytes, per-round µs, median), ``cost`` (contender minus its without-step, per round,
median) and ``run`` (load average, the command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BENCHMARK = "allreduce_parts"
PREFIX = "ALLREDUCE_PARTS "
# contender -> the step it is measured against (its cost is the difference)
BASELINE = {"hvrep_sum": "hvrep_without", "hvrep_mean": "hvrep_without", "horovod_cycle": "horovod_without",
            "horovod_flush": "horovod_without", "horovod_flush_postscale": "horovod_without"}


def _worker(args: argparse.Namespace) -> int:
    import _common

    _common.pin_to_local_core()  # before numpy and TensorFlow size their thread pools
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    import hvrep
    from hvrep import compat
    from hvrep.compat import horovod_patches

    repl = hvrep.Replicator("horovod")
    hvd = compat.import_horovod()
    values = args.bytes // 4
    x = tf.constant(np.full(values, 1.0 + repl.rank, np.float32))
    pairs = _common.small_page_pairs(values, 1.0 + repl.rank, 4)  # 4 KB pages, like TensorFlow's buffers
    turn = itertools.cycle(range(len(pairs)))
    flush = horovod_patches.FLUSH_NAME
    comm = MPI.COMM_WORLD

    def plain(**kw: Any) -> Any:
        return tf.function(lambda v: hvd.allreduce(v, op=hvd.Sum, **kw))

    def rotating() -> None:
        send, recv = pairs[next(turn)]
        comm.Allreduce(send, recv, op=MPI.SUM)

    horovod = {"horovod_cycle": plain(), "horovod_flush": plain(name=f"HorovodAllreduce_{flush}_parts"),
               "horovod_flush_postscale": plain(name=f"HorovodAllreduce_{flush}_parts_post", postscale_factor=0.5),
               "horovod_without": tf.function(tf.identity), "scale": tf.function(lambda v: v * 0.5)}
    calls = {
        "hvrep_without": lambda: repl.run(lambda v: [tf.identity(v)], args=(x,)),
        "hvrep_sum": lambda: repl.run(lambda v: hvrep.all_reduce([tf.identity(v)], "sum"), args=(x,)),
        "hvrep_mean": lambda: repl.run(lambda v: hvrep.all_reduce([tf.identity(v)], "mean"), args=(x,)),
        **{name: (lambda f=f: f(x)) for name, f in horovod.items()},
        "floor_fixed": lambda: comm.Allreduce(pairs[0][0], pairs[0][1], op=MPI.SUM),
        "floor_rotating": rotating,
    }
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    # Every contender sums ranks' 1 and 2 to 3 (hvrep's mean to 1.5, the post-scaled op to 1.5): checked once.
    expect = {"hvrep_sum": 3.0, "hvrep_mean": 1.5, "horovod_cycle": 3.0, "horovod_flush": 3.0,
              "horovod_flush_postscale": 1.5}
    got = {name: float(tf.reshape(tf.nest.flatten(calls[name]())[0], [-1])[-1]) for name in expect}
    calls["floor_fixed"]()
    got["floor_fixed"], expect["floor_fixed"] = float(pairs[0][1][-1]), 3.0
    checked = all(got[k] == v for k, v in expect.items())
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.inner):
                out = call()
            for t in tf.nest.flatten(out):  # an eager result is computed when returned; read one value anyway
                if hasattr(t, "numpy"):
                    tf.reshape(t, [-1])[:1].numpy()
            mine = (time.perf_counter() - t0) / args.inner * 1e6
            samples[name].append(comm.allreduce(mine, op=MPI.MAX))
    if repl.rank == 0:
        base = {"benchmark": BENCHMARK, "run_id": args.run_id, "bytes": args.bytes, "launcher": "mpirun"}
        print(PREFIX + json.dumps({**base, "kind": "check", "results_checked": checked, "got": got}), flush=True)
        for name, us in samples.items():
            print(PREFIX + json.dumps({**base, "kind": "sample", "contender": name, "us": us,
                                       "median_us": statistics.median(us)}), flush=True)
        for name, without in BASELINE.items():
            cost = [a - b for a, b in zip(samples[name], samples[without], strict=True)]
            print(PREFIX + json.dumps({**base, "kind": "cost", "contender": name, "against": without,
                                       "cost_us": cost, "median_us": statistics.median(cost)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4 << 20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--inner", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bytes < 4 or args.bytes % 4:
        parser.error(f"--bytes must be a positive multiple of 4 (fp32 values), got {args.bytes}")
    if args.worker:
        return _worker(args)
    from _common import append_jsonl, launch_env, run_id, two_rank_command

    rid = run_id()
    command = "python benchmarks/allreduce_parts.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = [round(os.getloadavg()[0], 2)]
    worker = ["--worker", "--run-id", rid, "--bytes", str(args.bytes), "--rounds", str(args.rounds), "--inner",
              str(args.inner), "--warmup", str(args.warmup)]
    cmd = two_rank_command("mpirun", __file__, worker)
    proc = subprocess.run(cmd, env=launch_env(ROOT), cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    records = [json.loads(line.split(PREFIX, 1)[1]) for line in proc.stdout.splitlines() if PREFIX in line]
    if proc.returncode != 0 or not records:
        print(f"allreduce_parts: mpirun exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}",
              file=sys.stderr)
        return 1
    load.append(round(os.getloadavg()[0], 2))
    records.append({"benchmark": BENCHMARK, "run_id": rid, "kind": "run", "load_1min": load, "command": command,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())})
    check = next(r for r in records if r["kind"] == "check")
    print(f"{args.bytes:,} B, one tensor, 2 ranks under mpirun; µs per call, median of {args.rounds} rounds "
          f"(load {load[0]} -> {load[1]}); results {'checked' if check['results_checked'] else 'WRONG'}: "
          f"{check['got']}")
    for r in records:
        if r["kind"] == "sample":
            print(f"  {r['contender']:24s} {r['median_us']:9.0f}   [{min(r['us']):.0f}-{max(r['us']):.0f}]")
    for r in records:
        if r["kind"] == "cost":
            print(f"  cost {r['contender']:19s} {r['median_us']:9.0f}   (minus {r['against']})")
    if args.out:
        append_jsonl(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
