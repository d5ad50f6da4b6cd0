"""The cost of one collective in a small step: the step with the all-reduce minus the same step without it.

    python benchmarks/step_overhead.py --rounds 7 --inner 10 --out results/step_overhead.jsonl   # ~6 min
    python benchmarks/step_overhead.py --quick --out /tmp/so.jsonl                 # smoke test, 2 launches
    hvrep report results/step_overhead.jsonl                                       # step-overhead.md

On 2 ranks of this machine, one core each (every rank pins itself to the core of its local rank before
TensorFlow starts, under both launchers alike), under ``mpirun`` and ``horovodrun --gloo``. For each payload G
(16 KB, 256 KB, 4 MB, 32 MB of fp32), as one tensor and as 50 tensors of the same total, two entry points:

* ``all_reduce``: ``Replicator.run`` of a step whose only work is ``hvrep.all_reduce(xs, "mean")``, against
  the same step returning ``tf.identity`` of each tensor.
* ``wrap_optimizer``: ``apply_gradients`` of SGD (learning rate 0) wrapped by ``repl.wrap_optimizer``, against
  the same apply by an unwrapped SGD, both in ``Replicator.run``.

Floors, on the same ranks and cores, in the same rounds: ``mpi4py`` ``Allreduce`` of the same bytes (under
``mpirun``; MPI started by mpi4py in the same process); under ``horovodrun --gloo``, ``torch.distributed``'s Gloo
backend (``all_reduce`` of one tensor of G bytes) in a child process of each rank, pinned to the rank's core, from
the CPU PyTorch wheel in the venv ``--torch-python`` names (Horovod's sdist is not kept after hvrep builds it, so
Gloo's own benchmark was not at hand; a floor that cannot run is a ``floor`` line with ``measured: false`` and why).

Both ranks are on one host, so the entry points' default path is hvrep's shared-memory all-reduce
(``hvrep.replica.shm``). ``--other-transport`` (default on) adds, in the same rounds, each with-step through
Horovod's collectives (``CommConfig(local_transport="horovod")``, what a job across hosts uses): cost lines of
``variant: "horovod_transport"``. The flush-off contenders and the breakdown's variants go through Horovod too
(they take its machinery apart).

Every contender runs round-robin: one sample of each per round, a sample being ``--inner`` back-to-back calls
after a barrier, divided by ``--inner``; a round's sample is the slowest rank's. The cost of an entry point in a
round is its with-sample minus its without-sample of that round; the lines hold every round's samples, so the
cost can be recomputed. ``--flush-off`` (default on; off with ``--quick``) adds, in the same rounds, each
entry point's with-step run with ``HVREP_HOROVOD_FLUSH=0`` (hvrep's reductions wait Horovod's fusion window, as
before hvrep's build ended it for them: hvrep/compat/horovod_patches.py), set around its samples only: cost lines
of ``variant: "flush_off"``, against the same without-step. ``--packed`` (default off) adds, in the same rounds,
each default with-step with its buckets packed into one buffer before hvrep's shared-memory all-reduce, as before
that transport took a bucket's tensors themselves (``Backend._reduce_parts``): cost lines of ``variant:
"packed_first"``. ``--breakdown`` (default on; off with ``--quick``)
adds the 16 KB, 1-tensor ``all_reduce`` case re-run under variants (``HOROVOD_CYCLE_TIME=0.1``,
``HVREP_HOROVOD_IDLE_WAIT_MS=0``, ``CommConfig(timeout_s=0)``: no watchdog markers, the watchdog's
``tf.py_function`` markers instead of its native ones, Gloo's ring instead of halving-doubling
(``HVREP_GLOO_BCUBE_BYTES=0``), and ``HOROVOD_TIMELINE``,
whose activities are summed per step): ``kind: "breakdown"`` lines; with 4 MB among the sizes, the 4 MB
1-tensor case once more under ``HOROVOD_TIMELINE`` (variant ``timeline_4mb``: how much of its cost is inside
``MPI_Allreduce``). Under ``mpirun`` the floor is also measured on buffers of 4 KB pages (``floor_small_pages``):
numpy asks for transparent huge pages for arrays of 4 MB and more, TensorFlow's allocator does not, and Open MPI's
single-copy transfer pins each page of the peer's buffer; and on ``COLD_PAIRS`` (4) pairs of such buffers used in
turn (``floor_cold``): a step's tensors are allocated afresh, so the reduction's memory is not hot in the caches.

JSON lines, ``"benchmark": "step_overhead"``: ``cost`` (launcher, variant, entry, bytes, tensors, with_us,
without_us, cost_us, cost_median_us, cost_p10_us, cost_p90_us; for the default variant's steps through hvrep's
shared-memory all-reduce, from its counters (``hvrep.replica.shm.stats``) per step and round, each on the rank
where it was larger, and their medians: shm_allreduce_us, the reductions from submission to end; shm_wait_us,
waiting for the other rank; shm_handover_us, from submission until the transport's thread takes the op),
``floor`` (launcher, floor, bytes, us, median_us, or measured false and why), ``floor_small_pages`` and
``floor_cold`` (the same fields, mpirun), ``timeline`` (bytes, tensors, activity -> median µs per step), ``run``
(load average, the command).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python benchmarks/step_overhead.py` from anywhere: hvrep and benchmarks._common

BENCHMARK = "step_overhead"
PREFIX = "STEP_OVERHEAD "
SIZES = (16 << 10, 256 << 10, 4 << 20, 32 << 20)
QUICK_SIZES = (16 << 10, 256 << 10)
TENSORS = (1, 50)
ENTRIES = ("all_reduce", "wrap_optimizer")
LAUNCHERS = ("mpirun", "horovodrun")
# The variants of the breakdown: the extra environment of each launch of the 16 KB case.
# "watchdog_off": CommConfig(timeout_s=0), so no collective in the step is wrapped in the hang watchdog's two
# markers (hvrep/replica/activity.py); "py_markers": the watchdog on, its markers the tf.py_function calls it
# falls back to where hvrep's kernels are not loaded (and used everywhere before kernels/tf/watch.cc);
# "gloo_ring": Gloo's ring for every size, as before hvrep's build took halving-doubling for small all-reduces
# (hvrep/compat/horovod_patches.py, GLOO_PATCHES; under mpirun it changes nothing).
VARIANTS = {"cycle_time_0.1": {"HOROVOD_CYCLE_TIME": "0.1"}, "idle_wait_0": {"HVREP_HOROVOD_IDLE_WAIT_MS": "0"},
            "watchdog_off": {}, "py_markers": {}, "gloo_ring": {"HVREP_GLOO_BCUBE_BYTES": "0"}}
# The case a variant launch runs: (bytes, tensors); every variant but these runs the 16 KB, 1-tensor case.
# "timeline_4mb": Horovod's timeline of the 4 MB one-tensor all_reduce (what of its cost is inside MPI).
VARIANT_CASE = {"timeline_4mb": (4 << 20, 1)}


def _case(variant: str) -> tuple[int, int]:
    """(bytes, tensors) of the one case a variant launch runs."""
    return VARIANT_CASE.get(variant, (16 << 10, 1))


COLD_PAIRS = 4  # the cold floor's pairs of buffers, used in turn
TORCH_PYTHON = Path.home() / ".cache/hvrep/torch-gloo-venv/bin/python"


# --------------------------------------------------------------------------- the ranks


class _GlooFloor:
    """torch.distributed's Gloo all-reduce in a child process on this rank's core, driven over a pipe."""

    def __init__(self, python: Path, store: str, rank: int) -> None:
        self.proc = subprocess.Popen([str(python), __file__, "--torch-child", store, str(rank)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._ask("hello")

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the torch Gloo child exited (code {self.proc.poll()})")
        return answer.strip()

    def sample(self, nbytes: int, inner: int) -> float:
        return float(self._ask(f"{nbytes} {inner}"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self._ask("quit")
            self.proc.wait(timeout=30)


def _torch_child(store: str, rank: int) -> int:
    """The Gloo floor's child: answers "BYTES INNER" with µs per all_reduce of BYTES, after a barrier."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    buffers: dict[int, Any] = {}
    for line in sys.stdin:
        words = line.split()
        if words == ["quit"]:
            print("bye", flush=True)
            break
        if words == ["hello"]:
            print("ok", flush=True)
            continue
        nbytes, inner = int(words[0]), int(words[1])
        x = buffers.setdefault(nbytes, torch.ones(nbytes // 4, dtype=torch.float32))
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            dist.all_reduce(x)
        print((time.perf_counter() - t0) / inner * 1e6, flush=True)
    dist.destroy_process_group()
    return 0


def _apply_step(opt: Any, variables: list, scope: str) -> Any:
    """A step applying its gradients to ``variables`` with ``opt`` (a closure: tf.function would trace default
    arguments as inputs)."""
    import tensorflow as tf

    def apply(grads: list) -> Any:
        with tf.name_scope(scope):
            opt.apply_gradients(zip(grads, variables, strict=True))
        return tf.constant(0.0)

    return apply


def _worker(args: argparse.Namespace) -> int:
    import _common

    core = _common.pin_to_local_core()
    import keras
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep.replica import shm

    # The breakdown's variants take Horovod's machinery apart, so their launches reduce through it.
    config = hvrep.CommConfig(timeout_s=0 if args.variant == "watchdog_off" else 600.0,
                              local_transport="auto" if args.variant == "default" else "horovod")
    repl = hvrep.Replicator("horovod", config=config)
    # The same reductions through Horovod's collectives, side by side in the same rounds: on one host the default
    # is hvrep's shared-memory all-reduce (hvrep.replica.shm); Horovod's is what a job spanning hosts uses. The
    # flush-off contenders, which ask how hvrep's Horovod build serves them, go through Horovod too.
    via_horovod = args.variant == "default" and (args.other_transport or args.flush_off)
    repl_h = (hvrep.Replicator("horovod", config=dataclasses.replace(config, local_transport="horovod"))
              if via_horovod else None)
    # --packed: each default with-step once more with the bucket packed before hvrep's shared-memory all-reduce
    # (the path before it took the parts themselves), where that transport is open.
    packed = args.packed and args.variant == "default" and shm.stats() is not None

    def packing_first(call: Any) -> Any:
        """``call`` with the backend's parts path off (traced so on its first call, in the warm-up)."""
        def run() -> Any:
            repl._backend._reduce_parts = lambda *a: None
            try:
                return call()
            finally:
                del repl._backend._reduce_parts
        return run

    if args.variant == "py_markers":
        from hvrep.replica import activity, watchdog

        dog = watchdog.current()
        dog.activity = activity.Activity(native=False)
        activity.bind(dog.activity)
    rank, size = repl.rank, repl.num_replicas
    mpi = None
    if args.launcher == "mpirun":
        from mpi4py import MPI

        mpi = MPI
    gloo = None
    floor_error = None
    if args.launcher == "horovodrun":
        if not Path(args.torch_python).exists():
            floor_error = (f"{args.torch_python} does not exist: make it with `python3.11 -m venv "
                           f"{Path(args.torch_python).parents[1]} && {args.torch_python} -m pip install torch==2.13.0`")
        else:
            try:
                gloo = _GlooFloor(Path(args.torch_python), args.store, rank)
            except Exception as e:  # recorded in the floor line; the rest still runs
                floor_error = f"{type(e).__name__}: {e}"

    def barrier() -> None:
        repl.reduce(np.zeros((), np.float32), "sum")

    # (entry, G, n, "with"|"with_horovod"|"with_flush_off"|"without") or ("floor", G) -> a call
    contenders: dict[tuple, Any] = {}
    for nbytes in args.sizes:
        for n in TENSORS:
            if args.variant != "default" and (nbytes, n) != _case(args.variant):
                continue
            each = [nbytes // 4 // n + (1 if i < (nbytes // 4) % n else 0) for i in range(n)]
            xs = [tf.constant(np.full(k, 1.0 + rank, np.float32)) for k in each]
            scope = f"so_{nbytes}_{n}"

            def with_ar(v: list, scope: str = scope) -> list:
                with tf.name_scope(scope):
                    return hvrep.all_reduce([tf.identity(x) for x in v], "mean")

            def without_ar(v: list, scope: str = scope) -> list:
                with tf.name_scope(scope):
                    return [tf.identity(x) for x in v]

            contenders[("all_reduce", nbytes, n, "with")] = lambda f=with_ar, v=xs: repl.run(f, args=(v,))
            contenders[("all_reduce", nbytes, n, "without")] = lambda f=without_ar, v=xs: repl.run(f, args=(v,))
            if via_horovod:
                # One call through Horovod; the flush-off contender is the same call with the flush turned off.
                contenders[("all_reduce", nbytes, n, "with_horovod")] = lambda f=with_ar, v=xs: repl_h.run(f, args=(v,))
            if packed:
                def with_ar_packed(v: list, scope: str = scope) -> list:  # a function of its own: its own trace
                    return with_ar(v, scope)

                contenders[("all_reduce", nbytes, n, "with_packed")] = packing_first(
                    lambda f=with_ar_packed, v=xs: repl.run(f, args=(v,)))
            if args.variant == "default":
                with repl.scope():
                    variables = [keras.Variable(np.zeros(k, np.float32)) for k in each]
                    plain = keras.optimizers.SGD(learning_rate=0.0)
                    wrapped = repl.wrap_optimizer(keras.optimizers.SGD(learning_rate=0.0))
                for opt, which in ((wrapped, "with"), (plain, "without")):
                    apply = _apply_step(opt, variables, f"{scope}_{which}")
                    contenders[("wrap_optimizer", nbytes, n, which)] = lambda f=apply, v=xs: repl.run(f, args=(v,))
                if packed:
                    with repl.scope():
                        wrapped_p = repl.wrap_optimizer(keras.optimizers.SGD(learning_rate=0.0))
                    apply = _apply_step(wrapped_p, variables, f"{scope}_with_packed")
                    contenders[("wrap_optimizer", nbytes, n, "with_packed")] = packing_first(
                        lambda f=apply, v=xs: repl.run(f, args=(v,)))
                if via_horovod:
                    with repl_h.scope():
                        variables_h = [keras.Variable(np.zeros(k, np.float32)) for k in each]
                        wrapped_h = repl_h.wrap_optimizer(keras.optimizers.SGD(learning_rate=0.0))
                    apply = _apply_step(wrapped_h, variables_h, f"{scope}_with_horovod")
                    contenders[("wrap_optimizer", nbytes, n, "with_horovod")] = (
                        lambda f=apply, v=xs: repl_h.run(f, args=(v,)))
            for entry in ENTRIES:
                key = (entry, nbytes, n, "with_horovod")
                if key not in contenders:
                    continue
                if args.flush_off:
                    contenders[(entry, nbytes, n, "with_flush_off")] = contenders[key]
                if not args.other_transport:
                    del contenders[key]
        if args.variant == "default" and (mpi is not None or gloo is not None):
            if mpi is not None:
                send = np.full(nbytes // 4, 1.0 + rank, np.float32)
                recv = np.empty_like(send)
                contenders[("floor", nbytes)] = lambda s=send, r=recv: mpi.COMM_WORLD.Allreduce(s, r, op=mpi.SUM)
                # The same on buffers of 4 KB pages: numpy asks for transparent huge pages for arrays of 4 MB and
                # more (madvise), TensorFlow's allocator does not, and Open MPI's single-copy transfer (CMA) pins
                # every page of the peer's buffer: the floor's transport on memory like the reduction's.
                (small,) = _common.small_page_pairs(nbytes // 4, 1.0 + rank, 1)
                contenders[("floor_small_pages", nbytes)] = lambda b=small: mpi.COMM_WORLD.Allreduce(*b, op=mpi.SUM)
                # And on 4 such pairs used in turn: a step's tensors are allocated afresh, and TensorFlow's
                # allocator hands back a few blocks in turn, so the reduction's memory is not hot in the caches.
                turns = itertools.cycle(_common.small_page_pairs(nbytes // 4, 1.0 + rank, COLD_PAIRS))
                contenders[("floor_cold", nbytes)] = lambda t=turns: mpi.COMM_WORLD.Allreduce(*next(t), op=mpi.SUM)
            else:
                contenders[("floor", nbytes)] = nbytes

    # The default with-steps' reductions, through hvrep's shared-memory all-reduce where it is open: its counters
    # over each sample (hvrep.replica.shm.stats), µs per call: (from submission to end, waiting for the other rank,
    # the hand-over to its thread).
    parts: dict[tuple, list] = {}

    def sample(key: tuple) -> float:
        call = contenders[key]
        barrier()
        if isinstance(call, int):  # the Gloo floor times itself in its child, after a barrier of its own
            return gloo.sample(call, args.inner)
        flush_off = key[-1] == "with_flush_off"
        if flush_off:  # read by hvrep's Horovod at each enqueue of hvrep's reductions
            os.environ["HVREP_HOROVOD_FLUSH"] = "0"
        try:
            before = shm.stats() if key[-1] in ("with", "with_packed") else None  # None where it is not open
            t0 = time.perf_counter()
            for _ in range(args.inner):
                out = call()
            tf.nest.flatten(out)[0].numpy() if out is not None else None
            us = (time.perf_counter() - t0) / args.inner * 1e6
            if before is not None:
                after = shm.stats()
                d = {k: (after[k] - before[k]) / 1e3 / args.inner for k in ("latency_ns", "wait_ns", "reduce_ns")}
                parts.setdefault(key, []).append([d["latency_ns"], d["wait_ns"], d["latency_ns"] - d["reduce_ns"]])
            return us
        finally:
            if flush_off:
                os.environ.pop("HVREP_HOROVOD_FLUSH", None)

    keys = list(contenders)
    for key in keys:  # warm-up: traces, negotiates, fills Horovod's response cache
        for _ in range(args.warmup):
            sample(key)
    mine = np.zeros((args.rounds, len(keys)), np.float64)
    for r in range(args.rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]  # rotate, so no contender always follows another
        for key in order:
            mine[r, keys.index(key)] = sample(key)
    slowest = repl.reduce(mine, "max")  # a round's sample is the slowest rank's
    # Each part per round on the rank where it was larger (the warm-up's samples dropped).
    split = {key: repl.reduce(np.asarray(v[-args.rounds:], np.float64), "max") for key, v in sorted(parts.items())}
    if gloo is not None:
        gloo.close()
    if rank != 0:
        return 0
    base = {"benchmark": BENCHMARK, "run_id": args.run_id, "launcher": args.launcher, "ranks": size,
            "cores": "one each", "core": core, "inner": args.inner, "rounds": args.rounds, "variant": args.variant}
    records = []
    col = {key: [round(float(v), 2) for v in slowest[:, i]] for i, key in enumerate(keys)}
    for key in keys:
        if key[0] in ("floor_small_pages", "floor_cold"):
            us = col[key]
            records.append({**base, "kind": key[0], "bytes": key[1], "floor": "mpi4py_allreduce",
                            "us": us, "median_us": round(float(np.median(us)), 2)})
        elif key[0] == "floor":
            us = col[key]
            records.append({**base, "kind": "floor", "bytes": key[1], "measured": True,
                            "floor": "mpi4py_allreduce" if mpi is not None else "torch_gloo_allreduce", "us": us,
                            "median_us": round(float(np.median(us)), 2)})
        elif key[3] in ("with", "with_horovod", "with_flush_off", "with_packed"):
            w, wo = col[key], col[(*key[:3], "without")]
            cost = [round(a - b, 2) for a, b in zip(w, wo, strict=True)]
            variant = {"with_flush_off": "flush_off", "with_horovod": "horovod_transport",
                       "with_packed": "packed_first"}.get(key[3], args.variant)
            records.append({**base, "variant": variant, "kind": "cost", "entry": key[0], "bytes": key[1],
                            "tensors": key[2],
                            "with_us": w, "without_us": wo, "cost_us": cost,
                            "cost_median_us": round(float(np.median(cost)), 2),
                            "cost_p10_us": round(float(np.percentile(cost, 10)), 2),
                            "cost_p90_us": round(float(np.percentile(cost, 90)), 2)})
            if key in split:
                for j, part in enumerate(("shm_allreduce_us", "shm_wait_us", "shm_handover_us")):
                    values = [round(float(v), 2) for v in split[key][:, j]]
                    records[-1][part] = values
                    records[-1][part.replace("_us", "_median_us")] = round(float(np.median(values)), 2)
    if args.variant == "default" and floor_error is not None:
        records += [{**base, "kind": "floor", "bytes": g, "measured": False, "floor": "torch_gloo_allreduce",
                     "why": floor_error} for g in args.sizes]
    if args.variant == "default":
        records.append({**base, "kind": "environment", **{k: v for k, v in _common.environment().items()
                                                          if k != "doctor"}})
    for rec in records:
        print(PREFIX + json.dumps(rec), flush=True)
    return 0


# --------------------------------------------------------------------------- the driver


def _one_launch(launcher: str, variant: str, extra: dict[str, str], args: argparse.Namespace,
                run_id: str) -> list[dict[str, Any]]:
    import _common

    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        worker = ["--variant", variant, "--run-id", run_id, "--rounds", str(args.rounds), "--inner", str(args.inner),
                  "--warmup", str(args.warmup), "--store", f"{tmp}/torch-store",
                  "--torch-python", str(args.torch_python), "--sizes", *map(str, args.sizes),
                  "--flush-off" if args.flush_off and variant == "default" else "--no-flush-off",
                  "--other-transport" if args.other_transport else "--no-other-transport",
                  "--packed" if args.packed and variant == "default" else "--no-packed"]
        command = _common.two_rank_command(launcher, __file__, ["--worker", "--launcher", launcher, *worker])
        proc = subprocess.run(command, env=_common.launch_env(ROOT, extra), cwd=ROOT, capture_output=True, text=True,
                              timeout=args.timeout)
        records = [json.loads(line.split(PREFIX, 1)[1]) for line in proc.stdout.splitlines() if PREFIX in line]
        if proc.returncode != 0 or not records:
            raise RuntimeError(f"{launcher} {variant}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
        timeline = Path(extra.get("HOROVOD_TIMELINE", ""))
        if extra.get("HOROVOD_TIMELINE") and timeline.exists():
            nbytes, tensors = _case(variant)
            records.append({"benchmark": BENCHMARK, "run_id": run_id, "launcher": launcher, "variant": variant,
                            "kind": "timeline", "bytes": nbytes, "tensors": tensors,
                            "activities_us": timeline_activities(timeline)})
    return records


def timeline_activities(path: Path) -> dict[str, float]:
    """Median µs per occurrence of each activity in a Horovod timeline (Chrome trace, B/E pairs per tensor).

    Horovod writes the file as a JSON array it never closes; a cut-off last event is dropped.
    """
    import numpy as np

    text = path.read_text().strip().rstrip(",")
    try:
        events = json.loads(text if text.endswith("]") else text + "]")
    except json.JSONDecodeError:
        events = json.loads(text[:text.rfind("}") + 1].rstrip().rstrip(",") + "]")
    open_: dict[tuple, list[tuple[str, float]]] = {}
    spans: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "B":
            open_.setdefault((e.get("pid"), e.get("tid")), []).append((e.get("name", "?"), float(e["ts"])))
        elif e.get("ph") == "E":
            stack = open_.get((e.get("pid"), e.get("tid")))
            if stack:
                name, ts = stack.pop()
                spans.setdefault(name, []).append(float(e["ts"]) - ts)
        elif e.get("ph") == "X":
            spans.setdefault(e.get("name", "?"), []).append(float(e.get("dur", 0.0)))
    return {name: round(float(np.median(d)), 1) for name, d in sorted(spans.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS))
    p.add_argument("--sizes", nargs="+", type=int, default=None, help="payloads in bytes (default 16K 256K 4M 32M)")
    p.add_argument("--rounds", type=int, default=15, help="rounds, one sample of every contender each (default 15)")
    p.add_argument("--inner", type=int, default=20, help="back-to-back calls per sample (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples of each contender first (default 2)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=None,
                   help="add the 16 KB variants and the timeline (default: on, off with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke test: 16 KB and 256 KB, 3 rounds of 3 calls")
    p.add_argument("--flush-off", action=argparse.BooleanOptionalAction, default=None,
                   help="add each with-step with HVREP_HOROVOD_FLUSH=0, alternating (default: on, off with --quick)")
    p.add_argument("--other-transport", action=argparse.BooleanOptionalAction, default=True,
                   help="add each with-step through Horovod's collectives (local_transport='horovod': what a job "
                        "across hosts uses), alternating with the default (default: on)")
    p.add_argument("--packed", action=argparse.BooleanOptionalAction, default=False,
                   help="add each with-step with its buckets packed before hvrep's shared-memory all-reduce (the "
                        "path before that transport took the parts themselves), alternating (default: off)")
    p.add_argument("--out", type=Path, default=Path("results/step_overhead.jsonl"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch (default 900)")
    p.add_argument("--torch-python", type=Path, default=TORCH_PYTHON,
                   help=f"the interpreter of a venv with CPU PyTorch, for the Gloo floor (default {TORCH_PYTHON})")
    # The ranks' side (set by the driver).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launcher", choices=LAUNCHERS, help=argparse.SUPPRESS)
    p.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    p.add_argument("--run-id", default="", help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    p.add_argument("--torch-child", nargs=2, metavar=("STORE", "RANK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_child:
        return _torch_child(args.torch_child[0], int(args.torch_child[1]))
    if args.quick:
        args.rounds, args.inner, args.warmup = 3, 3, 1
        args.sizes = args.sizes or list(QUICK_SIZES)
    args.sizes = args.sizes or list(SIZES)
    if args.flush_off is None:
        args.flush_off = not args.quick
    if args.worker:
        return _worker(args)
    breakdown = (not args.quick) if args.breakdown is None else args.breakdown
    import _common

    run_id = _common.run_id()
    load = [round(os.getloadavg()[0], 2)]
    records: list[dict[str, Any]] = []
    for launcher in args.launchers:
        records += _one_launch(launcher, "default", {}, args, run_id)
        if breakdown:
            with tempfile.TemporaryDirectory(prefix="step-overhead-tl-") as tmp:
                variants = {**VARIANTS, "timeline": {"HOROVOD_TIMELINE": f"{tmp}/timeline.json"}}
                variants["timeline_4mb"] = {"HOROVOD_TIMELINE": f"{tmp}/timeline_4mb.json"}
                for name, extra in variants.items():
                    if _case(name)[0] not in args.sizes:
                        continue  # its case is not among the sizes asked for
                    records += _one_launch(launcher, name, extra, args, run_id)
    load.append(round(os.getloadavg()[0], 2))
    records.append({"benchmark": BENCHMARK, "run_id": run_id, "kind": "run", "load_1min": load,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                    "command": " ".join(["python", "benchmarks/step_overhead.py", *(argv or sys.argv[1:])])})
    _common.append_jsonl(args.out, records)
    for rec in records:
        if rec["kind"] == "cost":
            print(f"{rec['launcher']:10s} {rec['variant']:15s} {rec['entry']:14s} {rec['bytes']:>9d} B "
                  f"x{rec['tensors']:<2d} cost {rec['cost_median_us']:9.1f} us "
                  f"[{rec['cost_p10_us']:.0f}-{rec['cost_p90_us']:.0f}]")
        elif rec["kind"] == "floor":
            print(f"{rec['launcher']:10s} floor {rec['floor']:20s} {rec['bytes']:>9d} B "
                  + (f"{rec['median_us']:9.1f} us" if rec["measured"] else f"not measured: {rec['why']}"))
        elif rec["kind"] == "floor_small_pages":
            print(f"{rec['launcher']:10s} floor on 4 KB pages {rec['bytes']:>9d} B {rec['median_us']:9.1f} us")
        elif rec["kind"] == "floor_cold":
            print(f"{rec['launcher']:10s} floor, {COLD_PAIRS} pairs in turn {rec['bytes']:>9d} B "
                  f"{rec['median_us']:9.1f} us")
        elif rec["kind"] == "timeline":
            print(f"{rec['launcher']:10s} timeline {rec['bytes']:>9d} B {rec['activities_us']}")
    print(f"wrote {len(records)} line(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
