"""Time one optimizer step (``apply_gradients``) over ResNet-50's 161 trainable variables, against memory bandwidth.

Optimizers, each named by the path it takes (``hvrep.optimizers.LARS`` and
``MomentumSGD`` pick the fused op by default, so an unqualified "LARS" would
change meaning with the build):

* ``LARS per-variable`` / ``MomentumSGD per-variable``: ``use_fused_kernel=False``,
  about ten TF ops per variable (``hvrep.kernels.lars_update``);
* ``LARS fused`` / ``MomentumSGD fused``: ``use_fused_kernel=True``, one
  ``HvrepFusedLarsApply`` op for all 161 variables. The op has no XLA kernel,
  so their XLA rows are recorded as not applicable (``ok: false``,
  ``applicable: false``) rather than timing the per-variable fallback under the
  fused name. Where the fused kernels are not loaded
  (``hvrep.kernels.status().path == "reference"``) these rows are errors that
  carry the reason, never timings of the reference;
* ``keras.SGD``: Keras' own momentum SGD, a baseline.

LARS and MomentumSGD use coupled weight decay and the default batch-norm/bias
exclusions. Modes: eager (a plain Python call), ``tf.function`` and
``tf.function(jit_compile=True)`` (XLA).

Only the update is timed: gradients are fixed random ``tf.constant``s made
once, and each optimizer is built before any call. Every case is warmed up
(which also traces and compiles), then the cases are timed round-robin, one
call of each per round, so that load from other processes drifts over all
cases alike and the ratios compare calls made side by side.

Bytes. A momentum step must move at least 5 float32 arrays of the parameters'
size: read w, g, v and write w, v, 20 bytes per parameter (511 MB for
ResNet-50); each case's effective GB/s is 20 x params / median time, for the
per-variable and the fused paths alike. The per-variable path moves more (its
intermediates go through memory). The fused CPU kernel (kernels/src/cpu.cc)
needs each tensor's norms before it can update it, so it reads w and g twice:
a small tensor (<= 32768 elements, most of the 161) is one unit that reads it
once into L1/L2 and re-reads it from there; larger tensors go in groups of
about 12 MiB of w + g, sized to the 32 MiB L3, so their second read comes from
L3, not memory. Its memory traffic is therefore close to the 20 bytes counted.

The memory roofline is measured in the same run, as three more cases in the
round-robin: NumPy kernels over float32 arrays of as many elements as there
are parameters, split over one thread per usable CPU (NumPy releases the GIL):
``copy`` (``c[:] = a``, 8 bytes/element), ``add`` (``np.add(a, b, out=c)``,
12 bytes/element, STREAM's "add", triad-like) and ``add in place``
(``np.add(a, b, out=a)``, 12 bytes/element). Bytes are counted as in STREAM,
read + written, without the write-allocate read of a destination line that
is not read first: copy and add move up to 1.5x and 1.33x what is counted, so
the optimizer, whose written arrays (w, v) are read first anyway, can exceed
100% of their counted GB/s. ``add in place`` has the optimizer's access
pattern (read-modify-write), so for it counted = moved. Every optimizer row
reports its fraction of each.

Usage:
    python benchmarks/optimizer_apply.py [--repeats N] [--warmup N] [--out FILE] [--quick] [--shrink N]

One JSON line per case is appended to ``--out``, all lines of a run sharing
one ``run_id``; a readable table and the headline (fused vs per-variable LARS,
goal >= 2x on the CPU, issue #9) go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from hvrep import kernels
from hvrep.models import resnet50_variable_shapes
from hvrep.optimizers import LARS, MomentumSGD

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
    warm_up,
)
from _common import environment as common_environment
from _common import run_id as new_run_id

MODES = ("eager", "tf.function", "xla")
LARS_PER_VARIABLE, LARS_FUSED = "LARS per-variable", "LARS fused"
SGD_PER_VARIABLE, SGD_FUSED = "MomentumSGD per-variable", "MomentumSGD fused"
KERAS_SGD = "keras.SGD"
OPTIMIZERS = (LARS_PER_VARIABLE, LARS_FUSED, SGD_PER_VARIABLE, SGD_FUSED, KERAS_SGD)
FUSED = (LARS_FUSED, SGD_FUSED)
BASELINE = (LARS_PER_VARIABLE, "tf.function")  # every row's ratio is taken against this case
FUSED_OP = "HvrepFusedLarsApply"

# Bytes per float32 parameter that any momentum step must move at least once:
# read params, grads and momentum (3 x 4), write params and momentum (2 x 4).
BYTES_PER_PARAM = 5 * 4

# The roofline kernels: name -> bytes per element counted (read + written, STREAM's convention).
ROOFLINE_MODE = "numpy"
ROOFLINES = {"copy": 8, "add": 12, "add in place": 12}

QUICK_WARMUP, QUICK_REPEATS = 2, 5
SPEEDUP_GOAL = 2.0  # issue #9: fused >= 2x the tf.function per-variable path on the CPU


# The hyper-parameters change the numbers a step produces, not the work it does.
# Keras' SGD gets no weight decay: its own is decoupled, a different update.
LEARNING_RATE, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-5


def _make_optimizer(name: str) -> keras.optimizers.Optimizer:
    hyper = dict(momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if name in (LARS_PER_VARIABLE, LARS_FUSED):
        return LARS(LEARNING_RATE, **hyper, use_fused_kernel=name == LARS_FUSED)
    if name in (SGD_PER_VARIABLE, SGD_FUSED):
        return MomentumSGD(LEARNING_RATE, **hyper, use_fused_kernel=name == SGD_FUSED)
    if name == KERAS_SGD:
        return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}.")


def _fused_problem(status: kernels.KernelStatus) -> str | None:
    """Why the fused rows cannot be timed in this process, or None if the fused CPU kernels are loaded."""
    if status.path != "fused" or "CPU" not in status.devices:
        return f"the fused kernels are not available ({status.describe()}); not timed on the reference"
    return None


def _make_variables(shapes: Sequence[tuple[str, tuple[int, ...]]], seed: int) -> list[keras.Variable]:
    """One float32 ``keras.Variable`` per (path, shape), with ``variable.path == path``.

    The path matters: LARS and MomentumSGD decide batch-norm and bias
    exclusion by searching it, so a wrong path would time a different update.
    """
    rng = np.random.default_rng(seed)
    variables = []
    for path, shape in shapes:
        *scopes, leaf = path.split("/")
        init = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        with contextlib.ExitStack() as stack:
            for scope in scopes:
                stack.enter_context(keras.name_scope(scope))
            v = keras.Variable(init, name=leaf, dtype="float32", trainable=True)
        if v.path != path:
            raise RuntimeError(f"variable path {v.path!r} != {path!r}; keras.name_scope behaved unexpectedly.")
        variables.append(v)
    return variables


def _apply_fn(optimizer: keras.optimizers.Optimizer,
              variables: list[keras.Variable]) -> Callable[[list[tf.Tensor]], None]:
    # A closure, not default arguments: tf.function would trace default
    # arguments as inputs and turn the variables into symbolic tensors.
    def apply(grads: list[tf.Tensor]) -> None:
        optimizer.apply_gradients(zip(grads, variables, strict=True))

    return apply


def _make_sync(variable: keras.Variable) -> Callable[[], float]:
    """Returns a call that blocks until every op queued so far has finished.

    TensorFlow returns from an op (eager or a ``tf.function``) once it is
    queued on the device, not when it is done; a GPU would otherwise be timed
    at launch cost. Reading one element of an updated variable back to the
    host waits for the update (the read is ordered after the variable's last
    write) and, since a device runs one compute stream in order, for all work
    queued before it, while moving 4 bytes. On a CPU the call is nearly
    synchronous anyway and this costs tens of microseconds, measured and
    reported as ``sync_overhead_ms``.
    """
    index = (0,) * len(variable.shape)
    tf_var = variable.value

    def sync() -> float:
        return float(tf_var[index].numpy())

    return sync


def _no_sync() -> float:
    return 0.0  # NumPy returns when the work is done


class _Roofline:
    """STREAM-like NumPy kernels over float32 arrays of ``n`` elements, one contiguous slice per thread.

    One thread per usable CPU, as TensorFlow's pool has: a single core may not
    saturate memory, and the optimizer's ops use them all.
    """

    def __init__(self, n: int, threads: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.threads = threads
        self.a = rng.standard_normal(n, dtype=np.float32)
        # Small, so that a += b repeated a few hundred times stays far from overflow.
        self.b = 1e-6 * rng.standard_normal(n, dtype=np.float32)
        self.c = np.empty_like(self.a)
        step = -(-n // threads)
        step += -step % 16  # slices start on 64-byte boundaries: no cache line is shared by two threads
        self.slices = [slice(i, min(i + step, n)) for i in range(0, n, step)]
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="roofline")
        self.kernels: dict[str, Callable[[slice], Any]] = {
            "copy": lambda s: np.copyto(self.c[s], self.a[s]),
            "add": lambda s: np.add(self.a[s], self.b[s], out=self.c[s]),
            "add in place": lambda s: np.add(self.a[s], self.b[s], out=self.a[s]),
        }

    def call(self, kernel: str) -> Callable[[], None]:
        fn = self.kernels[kernel]

        def run() -> None:
            for f in [self.pool.submit(fn, s) for s in self.slices]:
                f.result()

        return run


@dataclass
class _Case:
    kind: str  # "optimizer" or "roofline"
    optimizer: str  # the optimizer, or the roofline kernel
    mode: str
    bytes_per_call: int
    call: Callable[[], Any] | None = None
    traced: Any = None  # the tf.function, to count its traces; None in eager mode
    sync: Callable[[], float] | None = None
    applicable: bool = True
    path: str | None = None  # "fused" or "per-variable" for hvrep's optimizers
    timings_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def timed_call(self) -> float:
        assert self.call is not None and self.sync is not None
        start = time.perf_counter()
        self.call()
        self.sync()
        return (time.perf_counter() - start) * 1e3


def _fused_ops_in_graph(case: _Case, grads: list[tf.Tensor]) -> int | None:
    """How many fused LARS ops the traced graph holds (None in eager mode): proof of the path timed."""
    if case.traced is None:
        return None
    graph = case.traced.get_concrete_function(grads).graph  # the cached trace: no retracing
    return sum(op.type == FUSED_OP for op in graph.get_operations())


def _build_cases(shapes: Sequence[tuple[str, tuple[int, ...]]], grads: list[tf.Tensor], seed: int,
                 fused_problem: str | None, roofline: _Roofline) -> list[_Case]:
    num_params = sum(math.prod(s) for _, s in shapes)
    opt_bytes = BYTES_PER_PARAM * num_params
    cases: list[_Case] = []
    for opt_name in OPTIMIZERS:
        fused = opt_name in FUSED
        path = None if opt_name == KERAS_SGD else ("fused" if fused else "per-variable")
        if fused and fused_problem is not None:
            cases += [_Case("optimizer", opt_name, m, opt_bytes, path=path, error=fused_problem) for m in MODES]
            continue
        # Each optimizer owns its variables, so one's updates never feed another's.
        variables = _make_variables(shapes, seed=seed)
        optimizer = _make_optimizer(opt_name)
        optimizer.build(variables)
        apply = _apply_fn(optimizer, variables)
        sync = _make_sync(variables[-1])
        for mode in MODES:
            if fused and mode == "xla":
                cases.append(_Case("optimizer", opt_name, mode, opt_bytes, path=path, applicable=False, error=(
                    "not applicable: the fused op has no XLA kernel; under XLA the optimizer falls back to "
                    "the per-variable path, timed as the per-variable row")))
                continue
            fn = {"eager": apply, "tf.function": tf.function(apply),
                  "xla": tf.function(apply, jit_compile=True)}[mode]
            traced = None if mode == "eager" else fn
            cases.append(_Case("optimizer", opt_name, mode, opt_bytes, call=lambda fn=fn: fn(grads), sync=sync,
                               traced=traced, path=path))
    for kernel, per_element in ROOFLINES.items():
        cases.append(_Case("roofline", kernel, ROOFLINE_MODE, per_element * num_params, call=roofline.call(kernel),
                           sync=_no_sync))
    return cases


def _kernels_record() -> dict[str, Any]:
    st = kernels.status()
    return {"status": st.describe(), "path": st.path, "devices": list(st.devices), "reason": st.reason,
            "library": st.library, "build_key": st.build.get("key"), "built_at": st.build.get("built_at")}


def _environment() -> dict[str, Any]:
    return {**common_environment(), "kernels": _kernels_record()}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, "results/optimizer_apply.jsonl", "case", "weights and gradients",
                      QUICK_WARMUP, QUICK_REPEATS)
    add_shrink_flag(p)
    return parse_timing_args(p, argv)


def _gbps(bytes_per_call: int, ms: float) -> float:
    return bytes_per_call / (ms * 1e-3) / 1e9


def _fraction_of(case: _Case, roof: _Case) -> dict[str, float] | None:
    """The case's effective GB/s over the roofline's, at the medians and per round."""
    r = ratio(roof.timings_ms, case.timings_ms)  # time ratio roofline/case = bandwidth ratio case/roofline ...
    if r is None:
        return None
    scale = case.bytes_per_call / roof.bytes_per_call  # ... once each is scaled by its own bytes
    return {k: v * scale for k, v in r.items()}


def _headline(by_key: dict[tuple[str, str], _Case]) -> dict[str, Any]:
    """Issue #9's numbers: fused LARS (tf.function) against the per-variable paths and the roofline."""
    fused = by_key[LARS_FUSED, "tf.function"]
    if fused.error is not None:
        return {"ok": False, "error": fused.error}
    per_var = {m: by_key[LARS_PER_VARIABLE, m] for m in MODES if by_key[LARS_PER_VARIABLE, m].error is None}
    best = min(per_var, key=lambda m: np.median(per_var[m].timings_ms)) if per_var else None

    def speedup(mode: str) -> dict[str, float] | None:
        # per-variable time / fused time: > 1 means the fused op is faster.
        return ratio(per_var[mode].timings_ms, fused.timings_ms) if mode in per_var else None

    vs_tf = speedup("tf.function")
    fused_median = float(np.median(fused.timings_ms))
    roof = {k: by_key[k, ROOFLINE_MODE] for k in ROOFLINES}
    return {
        "ok": True,
        "fused_case": [LARS_FUSED, "tf.function"],
        "speedup_vs_per_variable_tf_function": vs_tf,
        "speedup_vs_per_variable_xla": speedup("xla"),
        "best_per_variable_mode": best,
        "speedup_vs_best_per_variable": speedup(best) if best else None,
        "goal": SPEEDUP_GOAL,
        "goal_met": None if vs_tf is None else vs_tf["of_medians"] >= SPEEDUP_GOAL,
        "fused_gbps": _gbps(fused.bytes_per_call, fused_median),
        "roofline_gbps": {k: _gbps(c.bytes_per_call, float(np.median(c.timings_ms))) for k, c in roof.items()},
        "fraction_of_roofline": {k: _fraction_of(fused, c) for k, c in roof.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    shapes = shrink_shapes(resnet50_variable_shapes(), args.shrink)
    num_params = sum(math.prod(s) for _, s in shapes)
    bytes_per_step = BYTES_PER_PARAM * num_params
    rng = np.random.default_rng(args.seed + 1)
    # Fixed gradients, one tensor per variable, passed to the tf.functions as
    # arguments (not captured) so that no graph can constant-fold them.
    grads = [tf.constant((1e-3 * rng.standard_normal(s)).astype(np.float32)) for _, s in shapes]
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    roofline = _Roofline(num_params, threads=len(cpus) if cpus else (os.cpu_count() or 1), seed=args.seed + 2)
    fused_problem = _fused_problem(kernels.status())
    cases = _build_cases(shapes, grads, args.seed, fused_problem, roofline)
    if fused_problem is not None:
        print(f"fused rows not timed: {fused_problem}", file=sys.stderr)

    load_before = os.getloadavg()
    warm_up(cases, args.warmup, lambda c: f"{c.optimizer} / {c.mode}")

    sync_probe = next((c.sync for c in cases if c.kind == "optimizer" and c.error is None), None)
    sync_ms: list[float] = []
    for _ in range(args.repeats):
        for case in cases:
            if case.error is None:
                case.timings_ms.append(case.timed_call())
        if sync_probe is not None:
            start = time.perf_counter()
            sync_probe()
            sync_ms.append((time.perf_counter() - start) * 1e3)
    load_after = os.getloadavg()
    roofline.pool.shutdown()

    # Read before the trace counts below, so that a retrace by this look-up would show up in them.
    fused_ops = {id(c): _fused_ops_in_graph(c, grads) if c.error is None else None for c in cases}
    by_key = {(c.optimizer, c.mode): c for c in cases}
    run_id = new_run_id()
    config = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "seed": args.seed,
        "shrink": args.shrink,
        "num_variables": len(shapes),
        "num_params": num_params,
        "dtype": "float32",
        "bytes_per_step": bytes_per_step,
        "bytes_per_step_model": "params+grads+momentum read, params+momentum written, 4 bytes each",
        "roofline": {"kernels": {"copy": "c[:] = a", "add": "np.add(a, b, out=c)",
                                 "add in place": "np.add(a, b, out=a)"},
                     "bytes_per_element": ROOFLINES, "elements": num_params, "threads": roofline.threads,
                     "bytes_model": "read + written as STREAM counts them (no write-allocate)"},
        "hyperparameters": {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY,
                            "weight_decay_keras_sgd": None},
        "schedule": "all cases warmed up, then timed round-robin (one call of each case per round)",
        "sync": "one element of the last variable read back with .numpy() after each call, inside the timing",
        "baseline": list(BASELINE),
    }
    env = _environment()
    env["loadavg_before"] = list(load_before)
    env["loadavg_after"] = list(load_after)
    sync_summary = percentiles(sync_ms) if sync_ms else None
    headline = _headline(by_key)

    def same_mode(name: str, case: _Case) -> dict[str, float] | None:
        other = by_key.get((name, case.mode))
        return None if other is None or other.error is not None else ratio(case.timings_ms, other.timings_ms)

    baseline = by_key[BASELINE]
    roofs = {k: by_key[k, ROOFLINE_MODE] for k in ROOFLINES}
    records = []
    for case in cases:
        summary = None
        if case.error is None:
            summary = percentiles(case.timings_ms)
            summary["gbps_at_median"] = _gbps(case.bytes_per_call, summary["median_ms"])
            if case.kind == "optimizer":
                summary["vs_lars_per_variable_tf_function"] = (
                    ratio(case.timings_ms, baseline.timings_ms) if baseline.error is None else None)
                summary["vs_momentum_sgd_per_variable_same_mode"] = same_mode(SGD_PER_VARIABLE, case)
                summary["vs_keras_sgd_same_mode"] = same_mode(KERAS_SGD, case)
                summary["fraction_of_roofline"] = {
                    k: _fraction_of(case, r) if r.error is None else None for k, r in roofs.items()}
        records.append({
            "benchmark": "optimizer_apply",
            "run_id": run_id,
            "kind": case.kind,
            "optimizer": case.optimizer,
            "mode": case.mode,
            "path": case.path,
            "ok": case.error is None,
            "applicable": case.applicable,
            "error": case.error,
            "config": config,
            "env": env,
            "bytes_per_call": case.bytes_per_call,
            "timings_ms": case.timings_ms,
            "warmup_ms": case.warmup_ms,
            # TensorFlow may warn of "retracing": its detector counts traces per
            # Python function, and the tf.functions here share one. Each
            # should trace once, in its first warm-up call.
            "traces": None if case.traced is None else case.traced.experimental_get_tracing_count(),
            "fused_ops_in_graph": fused_ops[id(case)],
            "sync_overhead_ms": sync_summary if case.kind == "optimizer" else None,
            "summary": summary,
            "headline": headline,
        })

    append_jsonl(args.out, records)

    _print_table(records, config, env, sync_summary, headline, args.out)
    return 0


def _fmt_pct(r: dict[str, float] | None) -> str:
    return "-" if r is None else f"{100 * r['of_medians']:.0f}%"


def _print_table(records: list[dict[str, Any]], config: dict[str, Any], env: dict[str, Any],
                 sync: dict[str, float] | None, headline: dict[str, Any], out: Path) -> None:
    print(f"optimizer apply_gradients, ResNet-50: {config['num_variables']} variables, "
          f"{config['num_params']:,} params, {config['bytes_per_step'] / 1e6:.1f} MB touched per step")
    print(f"warm-up {config['warmup']}, repeats {config['repeats']} (round-robin); "
          f"TF {env['tensorflow']}, Keras {env['keras']}, {env['cpu_count']} CPUs, {env['hostname']}; "
          f"load average {env['loadavg_before'][0]:.2f} -> {env['loadavg_after'][0]:.2f}")
    print(f"hvrep kernels: {env['kernels']['status']} (build {env['kernels']['build_key']})")
    if sync is not None:
        print(f"sync read-back (inside every timing): median {sync['median_ms']:.3f} ms")
    header = (f"{'case':<26} {'mode':<12} {'median ms':>9} {'p10':>8} {'p90':>8} {'min':>8} "
              f"{'GB/s':>6} {'%copy':>5} {'%inpl':>5}  {'vs LARS per-var tf.fn':<21} {'vs MomentumSGD p-v':<20} "
              f"{'vs keras.SGD':<18}")
    print(header)
    print("-" * len(header))
    for r in records:
        s = r["summary"]
        name = r["optimizer"] if r["kind"] == "optimizer" else f"roofline: {r['optimizer']}"
        if s is None:
            what = "n/a" if not r["applicable"] else "FAILED"
            print(f"{name:<26} {r['mode']:<12} {what}: {r['error'][:150]}")
            continue
        line = (f"{name:<26} {r['mode']:<12} {s['median_ms']:>9.2f} {s['p10_ms']:>8.2f} {s['p90_ms']:>8.2f} "
                f"{s['min_ms']:>8.2f} {s['gbps_at_median']:>6.2f}")
        if r["kind"] == "optimizer":
            frac = s["fraction_of_roofline"]
            line += (f" {_fmt_pct(frac['copy']):>5} {_fmt_pct(frac['add in place']):>5}  "
                     f"{fmt_ratio(s['vs_lars_per_variable_tf_function']):<21} "
                     f"{fmt_ratio(s['vs_momentum_sgd_per_variable_same_mode']):<20} "
                     f"{fmt_ratio(s['vs_keras_sgd_same_mode']):<18}")
        print(line)
    traces = {r["traces"] for r in records if r["traces"] is not None}
    print(f"traces per tf.function: {sorted(traces)} (1 means no retracing while timed)")
    print("ratios: time ratio of medians [p10-p90 of per-round ratios]; >1 is slower than the reference. "
          "%copy / %inpl: effective GB/s (20 B/param) over the roofline's copy / add in place GB/s.")
    if headline["ok"]:
        h = headline

        def x(r: dict[str, float] | None) -> str:
            return "-" if r is None else f"{r['of_medians']:.2f}× [{r['per_round_p10']:.2f}-{r['per_round_p90']:.2f}]"

        frac = h["fraction_of_roofline"]
        print(f"fused LARS vs per-variable LARS (tf.function): {x(h['speedup_vs_per_variable_tf_function'])} "
              f"(goal >= {h['goal']:.0f}×{'' if h['goal_met'] else ', NOT MET'}) ; "
              f"vs XLA per-variable: {x(h['speedup_vs_per_variable_xla'])} ; "
              f"fused at {h['fused_gbps']:.1f} GB/s = {_fmt_pct(frac['copy'])} of the measured copy bandwidth "
              f"({h['roofline_gbps']['copy']:.1f} GB/s; add {_fmt_pct(frac['add'])}, "
              f"add in place {_fmt_pct(frac['add in place'])})")
        print(f"(best per-variable mode: {h['best_per_variable_mode']}, fused is "
              f"{x(h['speedup_vs_best_per_variable'])} faster; speed-ups: per-variable time / fused time, "
              f"[p10-p90 per round])")
    else:
        print(f"headline: fused LARS not timed: {headline['error']}")
    print(f"appended {len(records)} lines to {out}")


if __name__ == "__main__":
    sys.exit(main())
