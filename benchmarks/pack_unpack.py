"""Time ``hvrep.kernels.pack`` / ``unpack`` (fused ops) against their pure-TF references over ResNet-50's gradients.

What the fused all-reduce (``hvrep.replica.fusion``) does around each collective:
pack a bucket of gradients into one rank-1 buffer (scaled, cast to the wire
dtype), and unpack the reduced buffer back into tensors of the gradients'
shapes and dtype. Cases, each over the 161 float32 gradient shapes of
ResNet-50 (25.6 M elements, 102 MB):

* ``pack f32->f32``: scale 1, the plain concatenation;
* ``pack f32->f16 x1/8``: scale 1/8 then cast to float16, the compression +
  pre-divide case (``CommConfig(compression="fp16")``, a mean over 8 replicas);
* ``unpack f32->f32``: the float32 buffer back to 161 tensors;
* ``unpack f16->f32``: the float16 buffer back to float32 tensors (scale 1,
  as ``hvrep.replica.fusion`` unpacks: the pre-divided sum is already the mean).

Each runs two ways inside one ``tf.function``: ``fused`` (``use_kernel=True``:
the C++ op, or an error, never the reference under the fused name) and
``reference`` (``use_kernel=False``: ``reference_pack`` / ``reference_unpack``,
a cast, multiply and reshape per tensor and one ``concat`` / ``split``). The
inputs are arguments of the ``tf.function`` (not captured constants, which
graph optimisation could fold), and every output is returned to Python, so
both ways pay the same cost of handing back 161 tensors for unpack.

Before timing, each fused case's output is compared with its reference's,
bit for bit (float16 by its 16-bit patterns): a fast kernel that computes a
different result is a bug, not a result. ``bit_identical`` is recorded.

Every case is warmed up (the first call traces), then all are timed
round-robin, one call of each per round, so that load drift hits all alike and
the fused/reference ratios compare calls made side by side. A call is timed
until one element of its last output is read back to the host (``.numpy()``),
which waits for the op to finish on any device. Effective bandwidth counts
bytes read + written once (f32->f32: 8 bytes/element, f32<->f16: 6).

Usage:
    python benchmarks/pack_unpack.py [--repeats N] [--warmup N] [--out FILE] [--quick]

One JSON line per (case, way) is appended to ``--out``, all lines of a run
sharing one ``run_id``; a readable table goes to stdout.
"""

from __future__ import annotations

import argparse
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

from hvrep import kernels
from hvrep.models import resnet50_variable_shapes

# Benchmarks run as scripts (also under `python -m mpi4py`): their folder holds the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, fmt_ratio, parse_timing_args, percentiles, ratio, timing_parser, warm_up
from _common import environment as common_environment
from _common import run_id as new_run_id

WAYS = ("fused", "reference")
QUICK_WARMUP, QUICK_REPEATS = 2, 5
# Gradient values: N(0, GRAD_STD). Small enough that after x1/8 some land in
# float16's subnormal range (< 6.1e-5), so the check covers that rounding too.
GRAD_STD = 1e-2
PRE_DIVIDE = 8  # the replicas of the compression + pre-divide case


@dataclass(frozen=True)
class _Spec:
    """One benchmarked conversion: operation, buffer dtype and scale."""

    name: str
    operation: str  # "pack" or "unpack"
    buffer_dtype: tf.DType  # the packed buffer's dtype (the output of pack, the input of unpack)
    scale: float


SPECS = (
    _Spec("pack f32->f32", "pack", tf.float32, 1.0),
    _Spec(f"pack f32->f16 x1/{PRE_DIVIDE}", "pack", tf.float16, 1.0 / PRE_DIVIDE),
    _Spec("unpack f32->f32", "unpack", tf.float32, 1.0),
    _Spec("unpack f16->f32", "unpack", tf.float16, 1.0),
)


def _bytes_per_call(spec: _Spec, num_elements: int) -> int:
    # Read once + written once: 4 bytes per float32 element, 2 (or 4) per buffer element.
    return num_elements * (4 + spec.buffer_dtype.size)


def _make_fn(spec: _Spec, shapes: list[tuple[int, ...]], use_kernel: bool) -> Callable[[Any], Any]:
    if spec.operation == "pack":
        def run(tensors: list[tf.Tensor]) -> tf.Tensor:
            return kernels.pack(tensors, spec.buffer_dtype, spec.scale, use_kernel=use_kernel)
    else:
        def run(buffer: tf.Tensor) -> list[tf.Tensor]:
            return kernels.unpack(buffer, shapes, tf.float32, spec.scale, use_kernel=use_kernel)
    return tf.function(run)


def _bits(t: tf.Tensor) -> np.ndarray:
    """The raw bit patterns, so that -0.0 != 0.0 and NaNs compare by payload."""
    a = t.numpy()
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _bit_identical(a: Any, b: Any) -> bool:
    xs = a if isinstance(a, list | tuple) else [a]
    ys = b if isinstance(b, list | tuple) else [b]
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(_bits(x), _bits(y))
        for x, y in zip(xs, ys, strict=True))


def _last_element(out: Any) -> float:
    """Reads one element of the last output back to the host: returns once the op is done."""
    t = out[-1] if isinstance(out, list | tuple) else out
    return float(tf.reshape(t, [-1])[-1].numpy())


@dataclass
class _Case:
    spec: _Spec
    way: str
    fn: Any  # the tf.function
    arg: Any
    timings_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)
    error: str | None = None
    output: Any = None  # the warm-up's last output, for the bit-for-bit check

    def timed_call(self) -> float:
        start = time.perf_counter()
        out = self.fn(self.arg)
        _last_element(out)
        elapsed = (time.perf_counter() - start) * 1e3
        self.output = out
        return elapsed


def _kernels_record() -> dict[str, Any]:
    st = kernels.status()
    return {"status": st.describe(), "path": st.path, "devices": list(st.devices), "reason": st.reason,
            "library": st.library, "build_key": st.build.get("key"), "built_at": st.build.get("built_at")}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, "results/pack_unpack.jsonl", "(case, way)", "gradients", QUICK_WARMUP,
                      QUICK_REPEATS)
    return parse_timing_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    shapes = [s for _, s in resnet50_variable_shapes()]
    num_elements = sum(math.prod(s) for s in shapes)
    rng = np.random.default_rng(args.seed)
    grads = [tf.constant((GRAD_STD * rng.standard_normal(s)).astype(np.float32)) for s in shapes]
    # The buffers unpack reads, made once by the reference (the fused pack is checked against it below).
    buffers = {dt: kernels.pack(grads, dt, 1.0 / PRE_DIVIDE if dt == tf.float16 else 1.0, use_kernel=False)
               for dt in {s.buffer_dtype for s in SPECS}}

    st = kernels.status()
    fused_problem = None if st.path == "fused" and "CPU" in st.devices else (
        f"the fused kernels are not available ({st.describe()}); not timed on the reference")
    cases: list[_Case] = []
    for spec in SPECS:
        arg = grads if spec.operation == "pack" else buffers[spec.buffer_dtype]
        for way in WAYS:
            case = _Case(spec, way, _make_fn(spec, shapes, use_kernel=way == "fused"), arg)
            if way == "fused" and fused_problem is not None:
                case.error = fused_problem
            cases.append(case)

    load_before = os.getloadavg()
    warm_up(cases, args.warmup, lambda c: f"{c.spec.name} / {c.way}")

    by_key = {(c.spec.name, c.way): c for c in cases}
    identical: dict[str, bool | None] = {}
    for spec in SPECS:
        fused, ref = by_key[spec.name, "fused"], by_key[spec.name, "reference"]
        ok = fused.error is None and ref.error is None
        identical[spec.name] = _bit_identical(fused.output, ref.output) if ok else None
        fused.output = ref.output = None  # free 100 MB each before timing
        if identical[spec.name] is False:
            print(f"WARNING: {spec.name}: the fused result differs from the reference's (bit for bit)",
                  file=sys.stderr)

    for _ in range(args.repeats):
        for case in cases:
            if case.error is None:
                case.timings_ms.append(case.timed_call())
                case.output = None
    load_after = os.getloadavg()

    run_id = new_run_id()
    config = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "seed": args.seed,
        "num_tensors": len(shapes),
        "num_elements": num_elements,
        "tensor_dtype": "float32",
        "grad_std": GRAD_STD,
        "bytes_model": "each element read once and written once, at its dtype's size",
        "schedule": "all cases warmed up, then timed round-robin (one call of each case per round)",
        "sync": "the tf.function's outputs returned to Python, one element of the last read back with .numpy()",
    }
    env = {**common_environment(), "kernels": _kernels_record(),
           "loadavg_before": list(load_before), "loadavg_after": list(load_after)}

    records = []
    for case in cases:
        spec, bytes_per_call = case.spec, _bytes_per_call(case.spec, num_elements)
        summary = None
        if case.error is None:
            summary = percentiles(case.timings_ms)
            summary["gbps_at_median"] = bytes_per_call / (summary["median_ms"] * 1e-3) / 1e9
            other = by_key[spec.name, "reference" if case.way == "fused" else "fused"]
            if case.way == "fused" and other.error is None:
                summary["vs_reference"] = ratio(case.timings_ms, other.timings_ms)  # time ratio, < 1 is faster
                summary["speedup_vs_reference"] = ratio(other.timings_ms, case.timings_ms)
        src, dst = ((tf.float32, spec.buffer_dtype) if spec.operation == "pack" else (spec.buffer_dtype, tf.float32))
        records.append({
            "benchmark": "pack_unpack",
            "run_id": run_id,
            "case": spec.name,
            "operation": spec.operation,
            "way": case.way,
            "use_kernel": case.way == "fused",
            "src_dtype": src.name,
            "dst_dtype": dst.name,
            "scale": spec.scale,
            "bytes_per_call": bytes_per_call,
            "ok": case.error is None,
            "error": case.error,
            "bit_identical": identical[spec.name],
            "config": config,
            "env": env,
            "timings_ms": case.timings_ms,
            "warmup_ms": case.warmup_ms,
            "traces": case.fn.experimental_get_tracing_count(),
            "summary": summary,
        })

    append_jsonl(args.out, records)
    _print_table(records, config, env, args.out)
    return 0


def _print_table(records: list[dict[str, Any]], config: dict[str, Any], env: dict[str, Any], out: Path) -> None:
    print(f"pack / unpack, ResNet-50 gradients: {config['num_tensors']} float32 tensors, "
          f"{config['num_elements']:,} elements, inside tf.function")
    print(f"warm-up {config['warmup']}, repeats {config['repeats']} (round-robin); "
          f"TF {env['tensorflow']}, {env['cpu_count']} CPUs, {env['hostname']}; "
          f"load average {env['loadavg_before'][0]:.2f} -> {env['loadavg_after'][0]:.2f}")
    print(f"hvrep kernels: {env['kernels']['status']} (build {env['kernels']['build_key']})")
    header = (f"{'case':<20} {'way':<10} {'MB moved':>8} {'median ms':>9} {'p10':>8} {'p90':>8} {'min':>8} "
              f"{'GB/s':>6}  {'fused/ref time':<18} {'bit-identical':<13}")
    print(header)
    print("-" * len(header))
    for r in records:
        s = r["summary"]
        same = {True: "yes", False: "NO", None: "-"}[r["bit_identical"]] if r["way"] == "fused" else ""
        if s is None:
            print(f"{r['case']:<20} {r['way']:<10} FAILED: {r['error'][:200]}")
            continue
        print(f"{r['case']:<20} {r['way']:<10} {r['bytes_per_call'] / 1e6:>8.1f} {s['median_ms']:>9.2f} "
              f"{s['p10_ms']:>8.2f} {s['p90_ms']:>8.2f} {s['min_ms']:>8.2f} {s['gbps_at_median']:>6.2f}  "
              f"{fmt_ratio(s.get('vs_reference')) if r['way'] == 'fused' else '':<18} {same:<13}")
    traces = {r["traces"] for r in records if r["ok"]}
    print(f"traces per tf.function: {sorted(traces)} (1 means no retracing while timed)")
    print("fused/ref time: ratio of medians [p10-p90 of per-round ratios]; < 1: the fused op is faster.")
    speedups = [f"{r['case']} {r['summary']['speedup_vs_reference']['of_medians']:.2f}×" for r in records
                if r["way"] == "fused" and r["ok"] and r["summary"].get("speedup_vs_reference")]
    if speedups:
        print("fused speed-up over the reference: " + "; ".join(speedups))
    print(f"appended {len(records)} lines to {out}")


if __name__ == "__main__":
    sys.exit(main())
