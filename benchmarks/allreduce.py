"""All-reduce (mean) ResNet-50's 161 fp32 gradients every way that matters, timed side by side.

Cases, all in one launch so that their ratios compare calls made seconds apart:

* hvrep, fused: ``Replicator("horovod", config=CommConfig(fusion_threshold_bytes=T,
  compression=C))`` running ``hvrep.all_reduce(grads, "mean")``, for T in
  {0 (one collective per tensor), 1, 4, 16, 64, 128 MiB (the default)} and C in
  {none, fp16}; C = bf16 is refused by the horovod backend (documented) and is
  recorded as a case that carries the refusal.
* plain Horovod: ``hvd.allreduce`` of each tensor inside one ``tf.function``
  (161 collectives), and one ``hvd.grouped_allreduce`` of all 161.
* the practical limit: ONE ``MPI.COMM_WORLD.Allreduce`` (sum) of a contiguous
  NumPy buffer of the same bytes through mpi4py. Only under an MPI launcher;
  under ``horovodrun --gloo`` it is recorded as not applicable. It runs in a
  process where Horovod is initialised, whose background thread wakes every
  ``HOROVOD_CYCLE_TIME`` (1 ms) for its own small MPI calls and shares the
  rank's core (mpirun binds each of 2 ranks to one core): the limit within a
  Horovod job, which an idle process beats (on the 2-core VM this was written
  on, 102 MB took ~150 ms without Horovod loaded, ~200-300 ms with it).

Every case is warmed up (the first call traces, negotiates and is checked for
correctness: the result must equal the mean of the ranks' values within fp32
or fp16 tolerance), then the cases are timed round-robin, one call of each per
round. Before each timed call the ranks meet at a barrier (outside the timer);
the timer stops once this rank holds the result (one element read back with
``.numpy()``). A round's time is the slowest rank's: the collective is done
when every rank has its result.

Bandwidths follow nccl-tests: algbw = payload bytes / time, with the payload
the fp32 gradients (102 MB) for every case, fp16 ones included (so compression
shows up as a higher effective algbw); busbw = algbw x 2(N-1)/N, the rate each
rank's link carries in a ring all-reduce.

Horovod reads its own fusion threshold (``HOROVOD_FUSION_THRESHOLD``) once,
at ``hvd.init()``, for the whole process; hvrep hands it the first
Replicator's threshold unless the variable was exported. The default
Replicator is created first, so Horovod runs with hvrep's default (128 MiB)
unless you export another value (``mpirun -x HOROVOD_FUSION_THRESHOLD=0``);
the value in effect is recorded. With it above zero Horovod may fuse the
separate collectives of the unfused cases again, on the wire.

Usage:
    mpirun -np 2 python -m mpi4py benchmarks/allreduce.py [--repeats N] [--warmup N] [--out FILE] [--quick] [--shrink N]
    horovodrun -np 2 --gloo python benchmarks/allreduce.py [...]

Rank 0 appends one JSON line per case to ``--out``, all lines of a run sharing
one ``run_id``, and prints a table. A failure on any rank ends the whole job
(``python -m mpi4py`` aborts it; horovodrun stops the others) rather than
leaving the other ranks waiting in a collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import hvrep
from hvrep import _env, compat
from hvrep.errors import ConfigError
from hvrep.models import resnet50_variable_shapes

# Benchmarks run as scripts (also under `python -m mpi4py`): their folder holds the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    add_shrink_flag,
    append_jsonl,
    fmt_ratio,
    parse_timing_args,
    percentiles,
    ratio,
    shrink_shapes,
    timing_parser,
)
from _common import environment as common_environment
from _common import run_id as new_run_id

MiB = 1024 * 1024
THRESHOLDS = (0, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB)
DEFAULT_THRESHOLD = 128 * MiB  # hvrep's fused path at its in-graph default bucket size
COMPRESSIONS = ("none", "fp16")
REFUSED_COMPRESSION = "bf16"  # the support table refuses it with the horovod backend, at construction
WIRE_ITEMSIZE = {"none": 4, "fp16": 2}

KIND_HVREP = "hvrep"
KIND_HVD_PER_TENSOR = "hvd.allreduce"
KIND_HVD_GROUPED = "hvd.grouped_allreduce"
KIND_MPI = "mpi4py.Allreduce"

# Gradient-sized values (std 1e-2); rank r holds (1 + r) x base, so the mean is
# (N + 1) / 2 x base and every rank's contribution shows in the result.
GRAD_SCALE = 1e-2

QUICK_WARMUP, QUICK_REPEATS = 1, 3


def _tolerance(wire: str, num_ranks: int) -> tuple[float, float]:
    """(rtol, atol) of the mean: one rounding per add (N - 1), plus the prescale and the casts.

    fp16 has an 11-bit significand (2^-11 relative) and subnormals spaced
    2^-24 apart below 6.1e-5, where gradient values of this scale often fall.
    """
    if wire == "fp16":
        return (num_ranks + 2) * 2.0**-11, 2.0**-23
    return (num_ranks + 2) * 2.0**-24, 1e-12


def _fmt_bytes(n: int) -> str:
    return f"{n // MiB}MiB" if n and n % MiB == 0 else str(n)


@dataclass
class _Case:
    name: str
    kind: str
    fusion_threshold_bytes: int | None
    compression: str
    wire_bytes: int
    call: Callable[[], Any] | None = None  # one all-reduce; returns its result
    sync: Callable[[Any], None] | None = None  # blocks until this rank holds the result
    to_mean: Callable[[Any], list[np.ndarray]] | None = None  # the result as per-tensor means, for the check
    collectives: int | None = None
    collectives_source: str = ""
    error: str | None = None
    expected_error: bool = False
    not_applicable: bool = False
    check: dict[str, Any] | None = None
    timings_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return self.call is not None


def _read_first(t: tf.Tensor) -> float:
    return float(t[(0,) * t.shape.rank].numpy())


def _sync_outputs(outs: Sequence[tf.Tensor]) -> None:
    """Reads one element of the first and the last reduced tensor back to the host.

    On the CPU a ``tf.function`` returns once every output exists, so this
    costs tens of microseconds; on a GPU it waits for the work queued before
    those two outputs on the device's stream.
    """
    _read_first(outs[0])
    _read_first(outs[-1])


def _check(means: Sequence[np.ndarray], bases: Sequence[np.ndarray], factor: float, rtol: float,
           atol: float) -> dict[str, Any]:
    """Compares this rank's result with factor x base, tensor by tensor (in float64)."""
    worst_abs, bad = 0.0, 0
    for got, base in zip(means, bases, strict=True):
        expected = base.astype(np.float64) * factor
        err = np.abs(np.asarray(got, np.float64).reshape(expected.shape) - expected)
        tol = atol + rtol * np.abs(expected)
        worst_abs = max(worst_abs, float(err.max()))
        bad += int((err > tol).sum())
    return {"ok": bad == 0, "max_abs_err": worst_abs, "elements_out_of_tolerance": bad,
            "rtol": rtol, "atol": atol}






def _make_replicator(threshold: int, compression: str) -> hvrep.Replicator | ConfigError:
    """The Replicator of one hvrep case, or the refusal of the compression the horovod backend refuses."""
    try:
        return hvrep.Replicator("horovod", config=hvrep.CommConfig(fusion_threshold_bytes=threshold,
                                                                   compression=compression))
    except ConfigError as e:  # the support table's refusal (hvrep.replica.support)
        if compression != REFUSED_COMPRESSION:
            raise
        return e


def _hvrep_case(repl: hvrep.Replicator | ConfigError, threshold: int, compression: str,
                grads: list[tf.Tensor], num_params: int) -> _Case:
    name = f"hvrep T={_fmt_bytes(threshold)} {compression}"
    case = _Case(name, KIND_HVREP, threshold, compression, num_params * WIRE_ITEMSIZE.get(compression, 4),
                 collectives_source="repl.collective_calls delta over the warm-up (counted when traced)")
    if isinstance(repl, ConfigError):
        case.error, case.expected_error = f"{type(repl).__name__}: {repl}", True
        return case
    # A name scope per case: Horovod matches tensors across ranks, and caches
    # their negotiation, by op name; without it every case would name its
    # buffers "concat", "Reshape"... and each round would invalidate the
    # previous case's cache entries, a cost a training job with one step never pays.
    scope = f"hvrep_T{threshold}_{compression}"

    def step(gs: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.name_scope(scope):
            return hvrep.all_reduce(gs, "mean", compress=True)  # gradients: compressed as configured

    def call() -> list[tf.Tensor]:
        before = repl.collective_calls
        out = repl.run(step, args=(grads,))
        case.collectives = (case.collectives or 0) + repl.collective_calls - before
        return out

    case.call, case.sync = call, _sync_outputs
    case.to_mean = lambda outs: [o.numpy() for o in outs]
    return case


def _horovod_cases(hvd: Any, grads: list[tf.Tensor], num_params: int) -> list[_Case]:
    @tf.function
    def per_tensor(gs: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.name_scope("hvd_per_tensor"):
            return [hvd.allreduce(g, op=hvd.Average) for g in gs]

    @tf.function
    def grouped(gs: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.name_scope("hvd_grouped"):
            return hvd.grouped_allreduce(gs, op=hvd.Average)

    cases = []
    for kind, fn, count in ((KIND_HVD_PER_TENSOR, per_tensor, len(grads)), (KIND_HVD_GROUPED, grouped, 1)):
        name = f"{kind} x{len(grads)}" if count > 1 else kind
        cases.append(_Case(name, kind, None, "none", num_params * 4, call=lambda fn=fn: fn(grads),
                           sync=_sync_outputs, to_mean=lambda outs: [o.numpy() for o in outs],
                           collectives=count, collectives_source="by construction"))
    return cases


def _mpi_case(comm: Any, bases: list[np.ndarray], num_params: int, num_ranks: int, rank: int) -> _Case:
    case = _Case(KIND_MPI, KIND_MPI, None, "none", num_params * 4, collectives_source="by construction")
    if comm is None:
        case.not_applicable = True
        case.error = ("not applicable: mpi4py needs an MPI launcher (mpirun); this job was started by "
                      f"{hvrep.resolve_placement().launcher!r}.")
        return case
    from mpi4py import MPI

    send = np.concatenate([(b * np.float32(1 + rank)).reshape(-1) for b in bases])
    recv = np.empty_like(send)
    sizes = [b.size for b in bases]

    def call() -> np.ndarray:
        comm.Allreduce(send, recv, op=MPI.SUM)  # blocking: this rank holds the sum on return
        return recv

    def to_mean(buf: np.ndarray) -> list[np.ndarray]:
        return np.split(buf / np.float32(num_ranks), np.cumsum(sizes)[:-1])

    case.call, case.sync, case.to_mean, case.collectives = call, lambda _: None, to_mean, 1
    return case


def _timed(case: _Case, barrier: Callable[[], None]) -> tuple[float, Any]:
    assert case.call is not None and case.sync is not None
    barrier()
    start = time.perf_counter()
    out = case.call()
    case.sync(out)
    return (time.perf_counter() - start) * 1e3, out


def _environment(hvd: Any, comm: Any) -> dict[str, Any]:
    mpi_library = None
    if comm is not None:
        from mpi4py import MPI

        mpi_library = MPI.Get_library_version().strip().splitlines()[0]
    return {
        **common_environment(),
        "horovod": {
            "mpi_built": bool(hvd.mpi_built()),
            "gloo_built": bool(hvd.gloo_built()),
            "controller": "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "unknown",
            # Read by Horovod once, at hvd.init(), for the whole process.
            "fusion_threshold_bytes": os.environ.get(_env.HOROVOD_FUSION_THRESHOLD),
            "cycle_time_ms": os.environ.get(_env.HOROVOD_CYCLE_TIME),
        },
        # Read by Open MPI once, when MPI starts (here mpi4py starts it, before any Replicator could set it).
        "mpi_yield_when_idle": os.environ.get(_env.OMPI_MCA_MPI_YIELD_WHEN_IDLE),
        "mpi_library": mpi_library,
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, "results/allreduce.jsonl", "case", "gradients", QUICK_WARMUP, QUICK_REPEATS)
    add_shrink_flag(p)
    return parse_timing_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    placement = hvrep.resolve_placement()
    # mpi4py only under an MPI launcher: elsewhere importing it would start a
    # singleton MPI beside Gloo.
    comm = None
    if placement.launcher in ("openmpi", "pmi"):
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

    shapes = shrink_shapes(resnet50_variable_shapes(), args.shrink)
    num_params = sum(math.prod(s) for _, s in shapes)
    payload_bytes = 4 * num_params
    rng = np.random.default_rng(args.seed)
    bases = [(GRAD_SCALE * rng.standard_normal(s)).astype(np.float32) for _, s in shapes]

    # The default Replicator first: it runs hvd.init(), which reads Horovod's
    # own knobs once for the process, so they are hvrep's defaults.
    keys = [(t, c) for c in COMPRESSIONS for t in THRESHOLDS]
    keys.sort(key=lambda k: k != (DEFAULT_THRESHOLD, "none"))
    repls = {k: _make_replicator(*k) for k in [*keys, (DEFAULT_THRESHOLD, REFUSED_COMPRESSION)]}
    hvd = compat.import_horovod()
    rank, num_ranks = int(hvd.rank()), int(hvd.size())
    # Arguments, not captures, so that no graph can constant-fold them.
    grads = [tf.constant(b * np.float32(1 + rank)) for b in bases]
    cases = [
        _mpi_case(comm, bases, num_params, num_ranks, rank),
        *_horovod_cases(hvd, grads, num_params),
        *(_hvrep_case(repls[t, c], t, c, grads, num_params) for c in COMPRESSIONS for t in THRESHOLDS),
        _hvrep_case(repls[DEFAULT_THRESHOLD, REFUSED_COMPRESSION], DEFAULT_THRESHOLD, REFUSED_COMPRESSION,
                    grads, num_params),
    ]
    chief = rank == 0

    one = tf.constant(0.0)

    def barrier() -> None:
        if comm is not None:
            comm.Barrier()
        else:
            hvd.allreduce(one, op=hvd.Sum, name="allreduce_bench.barrier").numpy()

    load_before = os.getloadavg()
    factor = (num_ranks + 1) / 2
    for case in cases:
        if not case.runnable:
            continue
        for i in range(args.warmup):
            ms, out = _timed(case, barrier)
            case.warmup_ms.append(ms)
            if i == 0:
                assert case.to_mean is not None
                rtol, atol = _tolerance(case.compression, num_ranks)
                case.check = _check(case.to_mean(out), bases, factor, rtol, atol)
            del out

    for _ in range(args.repeats):
        for case in cases:
            if case.runnable:
                ms, out = _timed(case, barrier)
                case.timings_ms.append(ms)
                del out
    load_after = os.getloadavg()

    mine = {"timings_ms": [c.timings_ms for c in cases], "warmup_ms": [c.warmup_ms for c in cases],
            "checks": [c.check for c in cases], "collectives": [c.collectives for c in cases]}
    per_rank = hvd.allgather_object(mine, name="allreduce_bench.results")
    if not chief:
        return 0

    env = _environment(hvd, comm)
    env["loadavg_before"], env["loadavg_after"] = list(load_before), list(load_after)
    run_id = new_run_id()
    config = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "seed": args.seed,
        "shrink": args.shrink,
        "model": "resnet50_variable_shapes()",
        "num_tensors": len(shapes),
        "num_params": num_params,
        "dtype": "float32",
        "payload_bytes": payload_bytes,
        "op": "mean",
        "ranks": num_ranks,
        "launcher": placement.launcher,
        "placement": dataclasses.asdict(placement),
        "thresholds_bytes": list(THRESHOLDS),
        "compressions": [*COMPRESSIONS, REFUSED_COMPRESSION],
        "values": f"rank r holds (1 + r) x base, base ~ {GRAD_SCALE} x N(0, 1); expected mean (N + 1) / 2 x base",
        "schedule": "all cases warmed up, then timed round-robin (one call of each case per round)",
        "timing": "barrier before each call (outside the timer); the timer stops when this rank holds the "
                  "result (one element read back with .numpy()); a round's time is the slowest rank's",
        "bandwidth": "algbw = payload_bytes (fp32) / time; busbw = algbw * 2(N-1)/N (nccl-tests)",
        "mpi4py_case": "Allreduce(SUM) of one contiguous float32 NumPy buffer, Horovod's background thread "
                       "running beside it; the division by N is not timed",
    }
    limit = next(c for c in cases if c.kind == KIND_MPI)
    reference = next(c for c in cases if c.kind == KIND_HVD_PER_TENSOR)
    job_times = {c.name: [max(r["timings_ms"][i][k] for r in per_rank) for k in range(len(c.timings_ms))]
                 for i, c in enumerate(cases)}
    bus_factor = 2 * (num_ranks - 1) / num_ranks

    records = []
    for i, case in enumerate(cases):
        times = job_times[case.name]
        checks = [r["checks"][i] for r in per_rank]
        counts = {r["collectives"][i] for r in per_rank}
        summary = None
        if case.runnable:
            summary = percentiles(times)
            seconds = summary["median_ms"] * 1e-3
            summary["algbw_gbps"] = payload_bytes / seconds / 1e9
            summary["busbw_gbps"] = summary["algbw_gbps"] * bus_factor
            summary["wire_busbw_gbps"] = case.wire_bytes / seconds / 1e9 * bus_factor
            summary["vs_mpi4py_contiguous"] = ratio(times, job_times[limit.name])
            summary["vs_hvd_allreduce_per_tensor"] = ratio(times, job_times[reference.name])
        records.append({
            "benchmark": "allreduce",
            "run_id": run_id,
            "case": case.name,
            "kind": case.kind,
            "fusion_threshold_bytes": case.fusion_threshold_bytes,
            "compression": case.compression,
            "ok": case.runnable,
            "error": case.error,
            "expected_error": case.expected_error,
            "not_applicable": case.not_applicable,
            "collectives": counts.pop() if len(counts) == 1 else sorted(counts, key=str),
            "collectives_source": case.collectives_source,
            "payload_bytes": payload_bytes,
            "wire_bytes": case.wire_bytes if case.runnable else None,
            "correct": all(c["ok"] for c in checks) if case.runnable else None,
            "check_per_rank": checks if case.runnable else None,
            "config": config,
            "env": env,
            "timings_ms": times,
            "timings_ms_per_rank": [r["timings_ms"][i] for r in per_rank],
            "warmup_ms_per_rank": [r["warmup_ms"][i] for r in per_rank],
            "summary": summary,
        })

    append_jsonl(args.out, records)
    _print_table(records, config, env, args.out)
    return 0




def _print_table(records: list[dict[str, Any]], config: dict[str, Any], env: dict[str, Any], out: Path) -> None:
    hv = env["horovod"]
    print(f"all-reduce (mean), ResNet-50 gradients: {config['num_tensors']} fp32 tensors, {config['num_params']:,} "
          f"floats = {config['payload_bytes'] / 1e6:.1f} MB; {config['ranks']} ranks via {config['launcher']}, "
          f"Horovod controller {hv['controller']}, Horovod's own fusion threshold {hv['fusion_threshold_bytes']} B")
    print(f"warm-up {config['warmup']}, repeats {config['repeats']} (round-robin); TF {env['tensorflow']}, "
          f"{env['cpu_count']} CPUs ({env['cpus_usable']} usable by rank 0), {env['hostname']}; "
          f"load average {env['loadavg_before'][0]:.2f} -> {env['loadavg_after'][0]:.2f}")
    header = (f"{'case':<26} {'coll':>5} {'wire MB':>8} {'median ms':>10} {'p10':>8} {'p90':>8} {'algbw':>6} "
              f"{'busbw':>6}  {'vs mpi4py limit':<19} {'vs hvd.allreduce':<19} {'correct':<7}")
    print(header)
    print("-" * len(header))
    for r in records:
        s = r["summary"]
        if s is None:
            label = "n/a" if r["not_applicable"] else "REFUSED" if r["expected_error"] else "FAILED"
            print(f"{r['case']:<26} {label}: {r['error'][:150]}")
            continue
        print(f"{r['case']:<26} {r['collectives']!s:>5} {r['wire_bytes'] / 1e6:>8.1f} {s['median_ms']:>10.2f} "
              f"{s['p10_ms']:>8.2f} {s['p90_ms']:>8.2f} {s['algbw_gbps']:>6.2f} {s['busbw_gbps']:>6.2f}  "
              f"{fmt_ratio(s['vs_mpi4py_contiguous']):<19} {fmt_ratio(s['vs_hvd_allreduce_per_tensor']):<19} "
              f"{'yes' if r['correct'] else 'NO':<7}")
    print("coll: collectives issued (hvrep: repl.collective_calls); algbw/busbw in GB/s of fp32 payload, "
          "busbw = algbw x 2(N-1)/N;")
    print("ratios: of medians [p10-p90 of per-round ratios], >1 is slower; times are the slowest rank's per round.")
    print(f"appended {len(records)} lines to {out}")


if __name__ == "__main__":
    sys.exit(main())
