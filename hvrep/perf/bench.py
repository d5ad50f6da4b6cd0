"""Throughput benchmarks and the scaling sweep: ``hvrep bench throughput|scaling`` (``node``: nodebench.py).

    hvrep bench scaling --ranks 1,2 --launcher horovodrun --out results/scaling.jsonl
    hvrep report results/scaling.jsonl

``throughput`` runs on every rank of a launched job (or alone): the training
step on synthetic data (no input cost), timed after a warm-up, two ways in
the same process so their ratio is measured side by side:

* ``hvrep``: the replica API (``Replicator.run`` with a fused ``hvrep.all_reduce``);
* ``baseline``: the same step written the plain way, doing the same work: on
  horovod a hand-written ``tf.function`` with ``hvd.grouped_allreduce``; on an
  in-graph backend with several devices a plain ``tf.distribute.MirroredStrategy``
  over the same devices with Keras' own gradient sum; on one device, plain TF.

Each step is timed to completion (the loss is read back). A separate pass
times the phases on their own to give a step-time breakdown: compute
(forward + backward) and communication (the all-reduce of the gradients);
the phases are synchronised one by one there, so they add up to more than a
fused step, by at least the communication that overlapped the backward pass
in the step (``communication_hidden_s``: a floor, since the update's own time
is inside the step too). Input wait is recorded as not measured (``null``): the
data is one synthetic in-memory batch, so there is no input to wait for
(``benchmarks/input_pipeline.py`` measures the real pipelines). The chief
appends one JSON line per mode in the layout ``hvrep report`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hvrep.errors import ConfigError


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _sync(value: Any) -> None:
    """Waits for a step's result: a tensor (horovod) or per-replica values (in-graph)."""
    parts = getattr(value, "values", None)
    (parts[0] if parts else value).numpy()


def _spread(seconds: Sequence[float]) -> dict[str, float]:
    ms = sorted(1000 * s for s in seconds)

    def q(p: float) -> float:
        return ms[min(len(ms) - 1, round(p * (len(ms) - 1)))]

    return {"median_ms": statistics.median(ms), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": ms[0]}


def throughput(model_name: str = "small_resnet", per_replica_batch: int = 32, image_size: int = 32,
               steps: int = 20, warmup: int = 3, seed: int = 0, threads_per_rank: int | None = None
               ) -> list[dict[str, Any]]:
    """Measures both modes on this rank; returns the JSON records (the same on every rank).

    ``threads_per_rank`` caps TensorFlow's intra- and inter-op threads: on a CPU
    machine, 1 thread per rank makes 1 rank use one core, so 1 vs N ranks
    compares N times the hardware, as scaling efficiency assumes.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    if threads_per_rank:
        tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank)
        tf.config.threading.set_inter_op_parallelism_threads(threads_per_rank)

    import hvrep
    from hvrep import compat, models
    from hvrep.cluster import doctor
    from hvrep.data import DataConfig, synthetic_dataset

    repl = hvrep.Replicator("auto")
    n, chief = repl.num_replicas, repl.is_chief
    num_classes = 1000 if model_name == "resnet50" else 10

    def make_model() -> keras.Model:
        keras.utils.set_random_seed(seed)
        if model_name == "resnet50":
            return models.resnet50(num_classes, (image_size, image_size, 3))
        return models.small_resnet(num_classes, (image_size, image_size, 3))

    data_cfg = DataConfig("synthetic", image_size=image_size, resize_size=image_size, seed=seed)
    batches = synthetic_dataset(data_cfg, per_replica_batch_size=per_replica_batch, num_classes=num_classes).prefetch(2)
    it = iter(batches)
    x, y = next(it)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # --- hvrep: the replica API ---
    with repl.scope():
        model = make_model()
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        opt.build(model.trainable_variables)

    def compute(xb: tf.Tensor, yb: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        loss, grads = compute(xb, yb)
        opt.apply_gradients(zip(hvrep.all_reduce(grads, "mean", compress=True), model.trainable_variables, strict=True))
        return loss

    def hvrep_step() -> None:
        _sync(repl.run(step, args=(x, y)))

    # --- baseline: the plain way, doing the same work (all replicas' batches) ---
    hvd = compat.import_horovod() if repl.backend == "horovod" else None
    in_graph = repl.backend != "horovod" and n > 1
    base_strategy = (tf.distribute.MirroredStrategy(list(repl._backend.strategy.extended.worker_devices))
                     if in_graph else tf.distribute.get_strategy())
    with base_strategy.scope():
        base_model = make_model()
        base_opt = keras.optimizers.SGD(0.01, momentum=0.9)
        base_opt.build(base_model.trainable_variables)
    if hvd is not None:
        for i, v in enumerate(base_model.variables):
            v.assign(hvd.broadcast(v.value, root_rank=0, name=f"bench.bcast.{i}"))

    def base_replica_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            # Under MirroredStrategy the Loss object divides by the replica count and Keras' optimizer sums.
            loss = loss_fn(yb, base_model(xb, training=True))
        grads = tape.gradient(loss, base_model.trainable_variables)
        if hvd is not None:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        base_opt.apply_gradients(zip(grads, base_model.trainable_variables, strict=True))
        return loss

    @tf.function
    def base_step(xb: tf.Tensor, yb: tf.Tensor) -> Any:
        if in_graph:
            return base_strategy.run(base_replica_step, args=(xb, yb))
        return base_replica_step(xb, yb)

    def baseline_step() -> None:
        _sync(base_step(x, y))

    for _ in range(warmup):
        hvrep_step()
        baseline_step()
    # Round-robin: shared-machine noise hits both modes alike.
    times: dict[str, list[float]] = {"hvrep": [], "baseline": []}
    for _ in range(steps):
        times["hvrep"] += _timed(hvrep_step, 1)
        times["baseline"] += _timed(baseline_step, 1)

    # --- step-time breakdown (hvrep), phases synchronised one by one ---
    compute_fn = tf.function(compute)
    _, grads = compute_fn(x, y)
    reduce_fn = lambda gs: hvrep.all_reduce(gs, "mean", compress=True)  # noqa: E731
    repl.run(reduce_fn, args=(grads,))
    k = max(3, steps // 2)
    def one_compute() -> None:
        compute_fn(x, y)[0].numpy()

    def one_comm() -> None:
        _sync(repl.run(reduce_fn, args=(grads,))[0])

    t_compute, t_comm = _timed(one_compute, k), _timed(one_comm, k)

    env = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "hostname": platform.node(),
           "gpus": [d.name for d in tf.config.list_logical_devices("GPU")], "tensorflow": tf.__version__,
           "doctor": doctor.collect(with_tensorflow=False)}
    config = {"model": model_name, "image_size": image_size, "ranks": n, "per_replica_batch": per_replica_batch,
              "global_batch": per_replica_batch * n, "backend": repl.backend, "steps": steps, "warmup": warmup,
              "launcher": hvrep.resolve_placement().launcher, "data": "synthetic",
              "baseline": ("horovod grouped_allreduce" if hvd is not None else
                           f"MirroredStrategy over {n} devices, Keras' own sum" if in_graph else "plain TF, 1 device"),
              "threads_per_rank": threads_per_rank}
    records = []
    for mode in ("hvrep", "baseline"):
        spread = _spread(times[mode])
        summary: dict[str, Any] = {**spread, "images_per_sec": n * per_replica_batch / (spread["median_ms"] / 1000)}
        if mode == "hvrep":
            compute_s, comm_s = statistics.median(t_compute), statistics.median(t_comm)
            # Overlap: forward+backward and the all-reduce timed alone add up to more than the whole step by at
            # least the communication that ran during the backward pass (the update's own time makes it a floor).
            hidden = min(comm_s, max(0.0, compute_s + comm_s - spread["median_ms"] / 1000))
            summary["step_time_breakdown"] = {
                "compute_s": compute_s, "communication_s": comm_s,
                "communication_hidden_s": hidden, "communication_hidden_share": hidden / comm_s if comm_s else 0.0,
                "input_wait_s": None, "input_wait": "not measured: one synthetic in-memory batch, no input pipeline"}
            ratios = sorted(a / b for a, b in zip(times["hvrep"], times["baseline"], strict=True))
            summary["step_time_vs_baseline"] = {"median": statistics.median(ratios), "p10": ratios[len(ratios) // 10],
                                                "p90": ratios[(9 * len(ratios)) // 10]}
        records.append({"ok": True, "benchmark": "throughput", "mode": mode,
                        "config": {**config, "mode": mode}, "env": env,
                        "raw_step_s": times[mode], "summary": summary})
    if chief:
        for r in records:
            s = r["summary"]
            print(f"{r['mode']:>8}: {n} rank(s) x {per_replica_batch} {model_name}: "
                  f"{s['images_per_sec']:,.0f} images/s (step {s['median_ms']:.1f} ms "
                  f"[p10 {s['p10_ms']:.1f}, p90 {s['p90_ms']:.1f}])", flush=True)
        b = records[0]["summary"]["step_time_breakdown"]
        vs = records[0]["summary"]["step_time_vs_baseline"]["median"]
        print(f"   hvrep vs plain Horovod step time: {vs:.2f}x; breakdown compute {1000 * b['compute_s']:.1f} ms, "
              f"communication {1000 * b['communication_s']:.1f} ms (at least "
              f"{100 * b['communication_hidden_share']:.0f}% hidden behind the backward pass), input wait not measured "
              "(synthetic data)",
              flush=True)
    return records


def baseline_path(out: Path) -> Path:
    """Where the plain-Horovod baseline of a results file goes: ``NAME-baseline.jsonl``."""
    return out.with_name(f"{out.stem}-baseline{out.suffix}")


def _write(records: list[dict[str, Any]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def scaling(ranks: Sequence[int], launcher: str, out: Path, mode: str, model: str, per_replica_batch: int,
            global_batch: int | None, image_size: int, steps: int, dry_run: bool = False,
            threads_per_rank: int | None = None) -> int:
    """Runs ``throughput`` once per rank count (weak: fixed per-replica batch; strong: fixed global batch)."""
    from hvrep.cluster import launch

    if mode == "strong" and not global_batch:
        raise ConfigError("--mode strong needs --global-batch (fixed over the sweep).")
    for r in ranks:
        if r < 1:
            raise ConfigError(f"--ranks must be positive, got {r}.")
        b = per_replica_batch if mode == "weak" else (global_batch or 0) // r
        if mode == "strong" and (global_batch or 0) % r:
            raise ConfigError(f"--global-batch {global_batch} does not divide by {r} ranks.")
        cmd = [sys.executable, "-m", "hvrep.perf.bench", "throughput", "--model", model, "--per-replica-batch", str(b),
               "--image-size", str(image_size), "--steps", str(steps), "--out", str(out),
               *(["--threads-per-rank", str(threads_per_rank)] if threads_per_rank else [])]
        spec = None
        if r > 1:
            spec = launch.LaunchSpec(np=r, command=tuple(cmd), launcher=launcher,
                                     allow_run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
            shown = launch.format_argv(spec)
        else:
            shown = shlex.join(cmd)
        print(f"hvrep bench scaling: {r} rank(s): {shown}", flush=True)
        if dry_run:
            continue
        rc = launch.run(spec) if spec is not None else subprocess.run(cmd).returncode
        if rc != 0:
            print(f"hvrep bench scaling: {r} rank(s) failed with exit code {rc}", file=sys.stderr)
            return rc
    if not dry_run:
        print(f"hvrep bench scaling: results appended to {out} (plain-Horovod baseline: {baseline_path(out)}). "
              f"Next: hvrep report {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvrep bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("throughput", help="one measurement on this job's ranks (run under a launcher)")
    p.add_argument("--model", choices=("small_resnet", "resnet50"), default="small_resnet")
    p.add_argument("--per-replica-batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/throughput.jsonl"))
    p.add_argument("--threads-per-rank", type=int, default=None, help="cap TF's threads per rank (CPU scaling)")
    s = sub.add_parser("scaling", help="throughput at each rank count, launched for you")
    s.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    s.add_argument("--launcher", choices=("horovodrun", "mpirun", "srun"), default="horovodrun")
    s.add_argument("--mode", choices=("weak", "strong"), default="weak",
                   help="weak: fixed per-replica batch; strong: fixed global batch")
    s.add_argument("--model", choices=("small_resnet", "resnet50"), default="small_resnet")
    s.add_argument("--per-replica-batch", type=int, default=32)
    s.add_argument("--global-batch", type=int, default=None)
    s.add_argument("--image-size", type=int, default=32)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--out", type=Path, default=Path("results/scaling.jsonl"))
    s.add_argument("--dry-run", action="store_true", help="print the commands only")
    s.add_argument("--threads-per-rank", type=int, default=None,
                   help="cap TF's threads per rank; 1 on a CPU machine makes 1 rank use one core")
    nd = sub.add_parser("node", help="profile this node for `hvrep plan` (run under the launcher, one rank per "
                        "device; see hvrep/perf/nodebench.py)")
    nd.add_argument("--model", choices=("small_resnet", "resnet50"), default="small_resnet")
    nd.add_argument("--per-replica-batch", type=int, default=32)
    nd.add_argument("--image-size", type=int, default=32)
    nd.add_argument("--width", type=int, default=None,
                    help="small_resnet's width (default its own, 16; 64: the model benchmarks/multihost.py trains)")
    nd.add_argument("--data", default=None, help="time hvrep's input pipeline on this folder (default: synthetic)")
    nd.add_argument("--max-bytes", type=int, default=None, help="largest all-reduce (default 256 MB; --quick 1 MB)")
    nd.add_argument("--powersgd-ranks", default="1,2,4",
                    help="PowerSGD ranks whose codec to time (the plan's powersgd:R needs its R among them)")
    nd.add_argument("--quick", action="store_true", help="a few sizes and repeats: seconds, for tests")
    nd.add_argument("--out", type=Path, default=Path("results/node-profile.json"))
    args = parser.parse_args(argv)
    try:
        if args.what == "node":
            from hvrep.perf.nodebench import main as node_main

            return node_main(args)
        if args.what == "throughput":
            records = throughput(args.model, args.per_replica_batch, args.image_size, args.steps, args.warmup,
                                 threads_per_rank=args.threads_per_rank)
            import hvrep

            if hvrep.resolve_placement().rank == 0:
                # hvrep's results and the plain-Horovod baseline go to separate files, so
                # `hvrep report` on either compares like with like.
                _write([r for r in records if r["mode"] == "hvrep"], args.out)
                _write([r for r in records if r["mode"] == "baseline"], baseline_path(args.out))
            return 0
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        return scaling(ranks, args.launcher, args.out, args.mode, args.model, args.per_replica_batch,
                       args.global_batch, args.image_size, args.steps, args.dry_run, args.threads_per_rank)
    except ConfigError as e:
        print(f"hvrep bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
