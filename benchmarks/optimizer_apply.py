"""Time one optimizer step (``apply_gradients``) over ResNet-50's 161 trainable variables.

Optimizers: ``hvrep.optimizers.LARS``, ``hvrep.optimizers.MomentumSGD`` (both
with coupled weight decay and the default batch-norm/bias exclusions) and
Keras' own momentum ``SGD`` as a baseline. Modes: eager (a plain Python call),
``tf.function`` and ``tf.function(jit_compile=True)`` (XLA).

Only the update is timed: gradients are fixed random ``tf.constant``s made
once, and each optimizer is built before any call. Every (optimizer, mode)
is warmed up (which also traces and compiles), then the cases are timed
round-robin, one call of each per round, so that load from other processes
drifts over all cases alike and the ratios compare calls made side by side.

The step touches at least 20 bytes per float32 parameter (reads params,
grads, momentum; writes params, momentum): the effective bandwidth at the
median is the roofline reference a fused kernel is measured against.

Usage:
    python benchmarks/optimizer_apply.py [--repeats N] [--warmup N] [--out FILE] [--quick]

One JSON line per (optimizer, mode) is appended to ``--out``, all lines of a
run sharing one ``run_id``; a readable table goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from hvrep.models import resnet50_variable_shapes
from hvrep.optimizers import LARS, MomentumSGD

# Benchmarks run as scripts (also under `python -m mpi4py`): their folder holds the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment as common_environment
from _common import fmt_ratio, parse_timing_args, percentiles, ratio, timing_parser

MODES = ("eager", "tf.function", "xla")
OPTIMIZERS = ("LARS", "MomentumSGD", "keras.SGD")
BASELINE = ("LARS", "tf.function")  # every row's ratio is taken against this case

# Bytes per float32 parameter that any momentum step must move at least once:
# read params, grads and momentum (3 x 4), write params and momentum (2 x 4).
BYTES_PER_PARAM = 5 * 4

QUICK_WARMUP, QUICK_REPEATS = 2, 5


# The hyper-parameters change the numbers a step produces, not the work it does.
# Keras' SGD gets no weight decay: its own is decoupled, a different update.
LEARNING_RATE, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-5


def _make_optimizer(name: str) -> keras.optimizers.Optimizer:
    if name == "LARS":
        return LARS(LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if name == "MomentumSGD":
        return MomentumSGD(LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    if name == "keras.SGD":
        return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}.")


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






@dataclass
class _Case:
    optimizer: str
    mode: str
    call: Callable[[], Any] | None = None
    traced: Any = None  # the tf.function, to count its traces; None in eager mode
    sync: Callable[[], float] | None = None
    timings_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def timed_call(self) -> float:
        assert self.call is not None and self.sync is not None
        start = time.perf_counter()
        self.call()
        self.sync()
        return (time.perf_counter() - start) * 1e3


def _environment() -> dict[str, Any]:
    return common_environment()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = timing_parser(__doc__, "results/optimizer_apply.jsonl", "(optimizer, mode)", "weights and gradients",
                      QUICK_WARMUP, QUICK_REPEATS)
    return parse_timing_args(p, argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    shapes = resnet50_variable_shapes()
    num_params = sum(math.prod(s) for _, s in shapes)
    bytes_per_step = BYTES_PER_PARAM * num_params
    rng = np.random.default_rng(args.seed + 1)
    # Fixed gradients, one tensor per variable, passed to the tf.functions as
    # arguments (not captured) so that no graph can constant-fold them.
    grads = [tf.constant((1e-3 * rng.standard_normal(s)).astype(np.float32)) for _, s in shapes]

    cases: list[_Case] = []
    for opt_name in OPTIMIZERS:
        # Each optimizer owns its variables, so one's updates never feed another's.
        variables = _make_variables(shapes, seed=args.seed)
        optimizer = _make_optimizer(opt_name)
        optimizer.build(variables)

        apply = _apply_fn(optimizer, variables)
        fns = {
            "eager": apply,
            "tf.function": tf.function(apply),
            "xla": tf.function(apply, jit_compile=True),
        }
        sync = _make_sync(variables[-1])
        for mode in MODES:
            fn = fns[mode]
            traced = None if mode == "eager" else fn
            cases.append(_Case(opt_name, mode, call=lambda fn=fn: fn(grads), sync=sync, traced=traced))

    load_before = os.getloadavg()
    for case in cases:
        try:
            for _ in range(args.warmup):
                case.warmup_ms.append(case.timed_call())
        except Exception as e:  # one failing case (e.g. XLA) is reported, the others still run
            case.error = f"{type(e).__name__}: {e}".strip()[:2000]
            print(f"{case.optimizer} / {case.mode} failed in warm-up, skipped:\n"
                  + "".join(traceback.format_exception_only(e))[-1500:], file=sys.stderr)

    sync_probe = next((c.sync for c in cases if c.sync is not None), None)
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

    by_key = {(c.optimizer, c.mode): c for c in cases}
    baseline = by_key[BASELINE].timings_ms
    run_id = f"{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
    config = {
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "seed": args.seed,
        "num_variables": len(shapes),
        "num_params": num_params,
        "dtype": "float32",
        "bytes_per_step": bytes_per_step,
        "bytes_per_step_model": "params+grads+momentum read, params+momentum written, 4 bytes each",
        "hyperparameters": {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY,
                            "weight_decay_keras_sgd": None},
        "schedule": "all cases warmed up, then timed round-robin (one call of each case per round)",
        "sync": "one element of the last variable read back with .numpy() after each call, inside the timing",
    }
    env = _environment()
    env["loadavg_before"] = list(load_before)
    env["loadavg_after"] = list(load_after)
    sync_summary = percentiles(sync_ms) if sync_ms else None

    records = []
    for case in cases:
        summary = None
        if case.error is None:
            summary = percentiles(case.timings_ms)
            summary["gbps_at_median"] = bytes_per_step / (summary["median_ms"] * 1e-3) / 1e9
            summary["vs_lars_tf_function"] = ratio(case.timings_ms, baseline)
            summary["vs_momentum_sgd_same_mode"] = ratio(case.timings_ms, by_key["MomentumSGD", case.mode].timings_ms)
            summary["vs_keras_sgd_same_mode"] = ratio(case.timings_ms, by_key["keras.SGD", case.mode].timings_ms)
        records.append({
            "benchmark": "optimizer_apply",
            "run_id": run_id,
            "optimizer": case.optimizer,
            "mode": case.mode,
            "ok": case.error is None,
            "error": case.error,
            "config": config,
            "env": env,
            "timings_ms": case.timings_ms,
            "warmup_ms": case.warmup_ms,
            # TensorFlow may warn of "retracing": its detector counts traces per
            # Python function, and the six tf.functions here share one. Each
            # should trace once, in its first warm-up call.
            "traces": None if case.traced is None else case.traced.experimental_get_tracing_count(),
            "sync_overhead_ms": sync_summary,
            "summary": summary,
        })

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")

    _print_table(records, config, env, sync_summary, args.out)
    return 0




def _print_table(records: list[dict[str, Any]], config: dict[str, Any], env: dict[str, Any],
                 sync: dict[str, float] | None, out: Path) -> None:
    print(f"optimizer apply_gradients, ResNet-50: {config['num_variables']} variables, "
          f"{config['num_params']:,} params, {config['bytes_per_step'] / 1e6:.1f} MB touched per step")
    print(f"warm-up {config['warmup']}, repeats {config['repeats']} (round-robin); "
          f"TF {env['tensorflow']}, Keras {env['keras']}, {env['cpu_count']} CPUs, {env['hostname']}; "
          f"load average {env['loadavg_before'][0]:.2f} -> {env['loadavg_after'][0]:.2f}")
    if sync is not None:
        print(f"sync read-back (inside every timing): median {sync['median_ms']:.3f} ms")
    header = (f"{'optimizer':<12} {'mode':<12} {'median ms':>10} {'p10':>9} {'p90':>9} {'min':>9} "
              f"{'GB/s':>6}  {'vs LARS tf.function':<20} {'vs MomentumSGD':<20} {'vs keras.SGD':<20}")
    print(header)
    print("-" * len(header))
    for r in records:
        s = r["summary"]
        if s is None:
            print(f"{r['optimizer']:<12} {r['mode']:<12} FAILED: {r['error'][:200]}")
            continue
        print(f"{r['optimizer']:<12} {r['mode']:<12} {s['median_ms']:>10.2f} {s['p10_ms']:>9.2f} "
              f"{s['p90_ms']:>9.2f} {s['min_ms']:>9.2f} {s['gbps_at_median']:>6.2f}  "
              f"{fmt_ratio(s['vs_lars_tf_function']):<20} {fmt_ratio(s['vs_momentum_sgd_same_mode']):<20} "
              f"{fmt_ratio(s['vs_keras_sgd_same_mode']):<20}")
    traces = {r["traces"] for r in records if r["traces"] is not None}
    print(f"traces per tf.function: {sorted(traces)} (1 means no retracing while timed)")
    print("ratios: of medians [p10-p90 of per-round ratios]; >1 is slower than the reference.")
    print(f"appended {len(records)} lines to {out}")


if __name__ == "__main__":
    sys.exit(main())
