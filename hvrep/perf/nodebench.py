"""``hvrep bench node``: measure one node, write the profile ``hvrep plan`` extrapolates to a cluster.

    mpirun -np 8 python -m hvrep.cli bench node --out node.json       # or horovodrun -np 8, srun -n 8
    hvrep plan node.json --cluster cluster.json

Run it on every rank of one node, one rank per device, under the launcher you will train with: the
all-reduce it times is the one your training uses (Horovod's MPI or Gloo for CPU tensors, NCCL for GPU
tensors when Horovod was built with it). It measures, in about two minutes by default (``--quick``: a few
seconds past TensorFlow's start, for tests):

* all-reduce (sum, float32, through ``hvrep.all_reduce``) of 4 KB to 256 MB between the node's ranks:
  each call after a barrier, the slowest rank's time, median over repeats; algbw = bytes / time, busbw =
  algbw × 2(N−1)/N (as nccl-tests), and a fit time = a + 2(N−1)/N · bytes / B;
* the same all-reduce of float16 (4 KB to 16 MB): its fit's per-byte cost beyond float32's is the plan's γ of
  float16, what the library's reduction arithmetic costs (Gloo sums float16 in software on a CPU);
* the model's step per replica at the given batch, every rank at once (the node's contention): forward
  alone, forward + backward, the whole step without the gradient reduction, and with it;
* contention (the plan's ``overlap_slowdown`` σ): forward + backward timed alone and beside an all-reduce of
  the model's gradient bytes running in another thread on every rank (what a collective beside the backward
  pass takes from the device); σ = beside / alone − 1, the ranks' mean, at least 0;
* the codec of each scheme on the model's gradients, every rank at once: hvrep's packing and unpacking of the
  buckets (fp32), the same with fp16's casts, and PowerSGD's factors, orthogonalisation and error feedback at
  each rank of ``powersgd_ranks``, with the collectives left out (what a step pays around them);
* the input pipeline's images/s (``--data``: hvrep's tf.data pipeline on that folder; without it, the
  synthetic in-memory batch, recorded as such and not given to the plan);
* host-to-device copy GB/s where there is a GPU.

The chief writes one JSON object: the measurements, and ``plan_inputs`` and ``intra_node_link``, which
``hvrep plan`` reads. The NCCL and host-device parts follow TensorFlow's and Horovod's APIs but were never
run on a GPU by hvrep's tests (no GPU on the machines they ran on).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hvrep.errors import ConfigError
from hvrep.perf.costmodel import DEFAULT_BETA_TENSOR_S

SCHEMA = "hvrep.node_profile/1"
# 4 KB to 256 MB in steps of 4x: the span nccl-tests' all_reduce_perf is usually run over.
SIZES = tuple(4096 * 4**i for i in range(9))
QUICK_SIZES = (4096, 65536, 1048576)
# float16's sweep stops at 16 MB: enough sizes for its slope, a fraction of float32's time.
FLOAT16_MAX_BYTES = 16 << 20
POWERSGD_RANKS = (1, 2, 4)


def _repeats(nbytes: int, quick: bool) -> int:
    if quick:
        return 3
    return 20 if nbytes <= 1 << 20 else 5 if nbytes <= 16 << 20 else 3


def _median_s(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_link(points: Sequence[dict[str, float]], ranks: int) -> dict[str, float] | None:
    """Fits seconds = a + 2(N−1)/N · bytes / B to the points, minimising the RELATIVE error (each point
    weighted by 1/seconds²), so that the 4 KB points set a and the large ones B, rather than the largest
    alone setting both; a and 1/B are held >= 0.

    Returns {"fixed_s": a, "latency_us": a / (2(N−1)) µs per ring hop, "bandwidth_GBps": B} or None with
    fewer than 2 points or one rank.
    """
    if ranks < 2 or len(points) < 2:
        return None
    rows = [(2 * (ranks - 1) / ranks * p["bytes"], p["seconds"]) for p in points if p["seconds"] > 0]
    # Normal equations of min sum w (a + s x - t)^2, w = 1/t^2.
    w = [1 / t**2 for _, t in rows]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, rows, strict=True))
    st = sum(wi * t for wi, (_, t) in zip(w, rows, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, rows, strict=True))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, rows, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    fixed = (st - slope * sx) / sw if det > 0 else 0.0
    if slope <= 0:  # no growth with bytes: all fixed cost
        slope, fixed = 1e-15, st / sw
    elif fixed < 0:  # refit through the origin
        slope, fixed = sxt / sxx, 0.0
    return {"fixed_s": fixed, "latency_us": fixed / (2 * (ranks - 1)) * 1e6, "bandwidth_GBps": 1 / slope / 1e9}


def float16_gamma(fit32: dict[str, float] | None, fit16: dict[str, float] | None) -> float | None:
    """γ of float16: seconds per byte its reduction costs beyond float32's, from the two link fits.

    Both fits are t = a + 2(N−1)/N · bytes / B; the γ term adds (N−1)/N · bytes · γ to float16's, so
    γ = 2 (1/B16 − 1/B32) (B in bytes/s), and 0 where float16 is not slower per byte (MPI's, a GPU's).
    """
    if not fit32 or not fit16:
        return None
    return max(0.0, 2 * (1 / (fit16["bandwidth_GBps"] * 1e9) - 1 / (fit32["bandwidth_GBps"] * 1e9)))


class _NoCollectives:
    """A backend whose all-reduce returns its input: what PowerSGD computes around its collectives, alone."""

    collectives_in_cond = True

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    def all_reduce(self, tensors: Sequence[Any], op: str, compress: bool = False) -> list[Any]:
        import tensorflow as tf

        return [tf.identity(t) for t in tensors]


def codec_functions(variables: Sequence[Any], grads: Sequence[Any], num_replicas: int, threshold: int,
                    powersgd_ranks: Sequence[int]) -> dict[str, Callable[[], Any]]:
    """Per scheme, a compiled step of the codec on ``grads`` with the collectives taken out: ``fp32`` (hvrep's
    packing of the buckets and the mean's scaling, unpacking), ``fp16`` (the same with the casts), and
    ``powersgd:R`` (its products, orthogonalisation, approximation and error feedback, its state updated)."""
    import tensorflow as tf

    from hvrep.replica import fusion
    from hvrep.replica.comm import CommConfig
    from hvrep.replica.powersgd import PowerSGDState

    def packed(wire: Any) -> Callable[[], Any]:
        return tf.function(lambda: fusion.fused_reduce(list(grads), tf.identity, threshold, wire_dtype=wire,
                                                       prescale=1.0 / num_replicas))

    out = {"fp32": packed(None), "fp16": packed(tf.float16)}
    local = _NoCollectives(num_replicas)
    for r in powersgd_ranks:
        state = PowerSGDState(variables, CommConfig(compression="powersgd", powersgd_rank=r), num_replicas)
        out[f"powersgd:{r}"] = tf.function(lambda state=state: state.reduce(list(grads), "mean", local))
    return out


def _contention(repl: Any, n: int, compute: Callable[..., Any], args: tuple, nbytes: int, steps: int,
                sync: Callable[[Any], Any], barrier: Callable[[], None], reduce_sum: Callable[[Any], Any],
                deadline_s: float = 30.0) -> dict[str, Any]:
    """σ: ``compute`` (forward + backward, no collective) timed alone, then beside all-reduces of ``nbytes`` that
    a thread of every rank runs meanwhile, then alone again; beside / alone − 1, the mean over the ranks, at
    least 0. The threads go on until every rank has timed ``steps`` passes beside them (or ``deadline_s`` has
    passed): after each all-reduce they sum one flag, so every rank stops after the same one. Horovod ranks
    only: an in-graph backend's replicas are one process's threads."""
    import threading

    import tensorflow as tf

    if repl.backend != "horovod" or n < 2:
        return {"overlap_slowdown": None, "why": "needs 2 or more Horovod ranks (one collective to run beside)"}
    for _ in range(2):
        sync(compute(*args))
    big = tf.fill([max(nbytes // 4, 1)], tf.constant(1.0))
    one = lambda: sync(repl.run(reduce_sum, args=(big,)))  # noqa: E731
    one()

    def alone() -> list[float]:
        barrier()
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            sync(compute(*args))
            out.append(time.perf_counter() - t0)
        return out

    before = alone()
    enough = threading.Event()
    failure: list[BaseException] = []
    count: list[int] = []

    def collectives() -> None:
        try:
            k, more = 0, 1.0
            while more > 0:
                one()
                k += 1
                more = float(sync(repl.run(reduce_sum, args=(tf.constant([0.0 if enough.is_set() else 1.0]),)))[0])
            count.append(k)
        except BaseException as e:  # re-raised on the main thread
            failure.append(e)

    barrier()
    worker = threading.Thread(target=collectives, name="hvrep-bench-contention", daemon=True)
    start = time.perf_counter()
    worker.start()
    beside: list[float] = []
    while worker.is_alive():
        t0 = time.perf_counter()
        sync(compute(*args))
        if worker.is_alive():  # a pass that ended after the collectives did was partly alone: not counted
            beside.append(time.perf_counter() - t0)
        if len(beside) >= steps or time.perf_counter() - start > deadline_s:
            enough.set()
    worker.join()
    if failure:
        raise failure[0]
    after = alone()
    base = statistics.median(before + after)
    mine = statistics.median(beside) / base - 1.0 if beside else None
    counted, total = (float(x) for x in sync(repl.run(
        reduce_sum, args=(tf.constant([0.0 if mine is None else 1.0, mine or 0.0]),))))
    sigma = max(0.0, total / counted) if counted == n else None
    return {"overlap_slowdown": sigma, "alone_s": base, "beside_s": statistics.median(beside) if beside else None,
            "passes_beside": len(beside), "collectives": count[0], "collective_bytes": int(big.shape[0]) * 4,
            "seconds": time.perf_counter() - start,
            "why": None if sigma is not None else "a rank timed no pass while the collectives ran"}


def node_profile(model_name: str = "small_resnet", per_replica_batch: int = 32, image_size: int = 32,
                 quick: bool = False, data_dir: str | None = None, max_bytes: int | None = None,
                 steps: int | None = None, width: int | None = None,
                 powersgd_ranks: Sequence[int] = POWERSGD_RANKS) -> dict[str, Any]:
    """Measures this node on every rank (run under the launcher); returns the profile (the same on every rank)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep import compat, models

    repl = hvrep.Replicator("auto")
    n = repl.num_replicas
    placement = hvrep.resolve_placement()
    gpus = tf.config.list_logical_devices("GPU")
    steps = steps or (3 if quick else 10)

    def sync(value: Any) -> Any:
        parts = getattr(value, "values", None)
        return (parts[0] if parts else value).numpy()

    backend = "none (1 rank)"
    if repl.backend == "horovod":
        hvd = compat.import_horovod()
        controller = "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "unknown"
        # Horovod reduces a GPU tensor with NCCL when built with it (HOROVOD_GPU_OPERATIONS=NCCL); never run here.
        backend = "nccl" if gpus and hvd.nccl_built() else controller
    elif n > 1:
        backend = f"{repl.backend} (in-graph)"

    def reduce_sum(t: Any) -> Any:
        return hvrep.all_reduce(t, "sum")

    def reduce_max(t: Any) -> Any:
        return hvrep.all_reduce(t, "max")

    # --- all-reduce sweep ---
    flag = tf.constant([1.0])

    def barrier() -> None:
        sync(repl.run(reduce_sum, args=(flag,)))

    sizes = [s for s in (QUICK_SIZES if quick else SIZES) if max_bytes is None or s <= max_bytes]

    def sweep(dtype: Any, sizes: Sequence[int]) -> tuple[list[dict[str, Any]], bool | None]:
        points: list[dict[str, Any]] = []
        if n < 2:
            return points, None
        rank_value = float(placement.rank + 1) if repl.backend == "horovod" else 1.0
        expected = n * (n + 1) / 2 if repl.backend == "horovod" else float(n)
        checked = True
        for nbytes in sizes:
            x = tf.fill([nbytes // dtype.size], tf.constant(rank_value, dtype))
            reduce_once = lambda x=x: repl.run(reduce_sum, args=(x,))  # noqa: E731
            got = sync(reduce_once())
            checked = checked and bool(got[0] == expected and got[-1] == expected)
            mine = []
            for _ in range(_repeats(nbytes, quick)):
                barrier()
                t0 = time.perf_counter()
                out = reduce_once()
                sync(out)
                mine.append(time.perf_counter() - t0)
            # The collective is done when every rank holds its result: the slowest rank's time per repeat.
            slowest = sync(repl.run(reduce_max, args=(tf.constant(mine),)))
            seconds = float(np.median(slowest))
            alg = nbytes / seconds / 1e9
            points.append({"bytes": nbytes, "seconds": seconds, "seconds_min": float(np.min(slowest)),
                           "seconds_max": float(np.max(slowest)), "repeats": len(mine), "algbw_GBps": alg,
                           "busbw_GBps": alg * 2 * (n - 1) / n})
        return points, checked

    points, checked = sweep(tf.float32, sizes)
    link = fit_link(points, n)
    points16, checked16 = sweep(tf.float16, [s for s in sizes if s <= FLOAT16_MAX_BYTES])
    link16 = fit_link(points16, n)
    gamma16 = float16_gamma(link, link16)

    # --- the model's step, every rank at once ---
    num_classes = 1000 if model_name == "resnet50" else 10
    keras.utils.set_random_seed(0)
    with repl.scope():
        if model_name == "resnet50":
            model = models.resnet50(num_classes, (image_size, image_size, 3))
        else:  # width None: small_resnet's own default
            model = models.small_resnet(num_classes, (image_size, image_size, 3),
                                        **({} if width is None else {"width": width}))
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        opt.build(model.trainable_variables)
    rng = np.random.default_rng(placement.rank)
    x = tf.constant(rng.normal(size=(per_replica_batch, image_size, image_size, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, num_classes, size=(per_replica_batch,)).astype("int32"))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    shapes = [tuple(int(d) for d in v.shape) for v in variables]
    grad_bytes = 4 * sum(math.prod(s) for s in shapes)

    def forward(xb, yb):
        return loss_fn(yb, model(xb, training=True))

    def forward_backward(xb, yb):
        with tf.GradientTape() as tape:
            loss = forward(xb, yb)
        return loss, tape.gradient(loss, variables)

    def step_local(xb, yb):
        loss, grads = forward_backward(xb, yb)
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    def step_reduced(xb, yb):
        loss, grads = forward_backward(xb, yb)
        opt.apply_gradients(zip(hvrep.all_reduce(grads, "mean", compress=True), variables, strict=True))
        return loss

    def loss_and_grads(xb, yb):
        # Return something of every gradient: a compiled function prunes the ops its outputs do not need, and
        # would time the forward pass alone. The sums cost one read of the gradients.
        loss, grads = forward_backward(xb, yb)
        return loss + 0.0 * tf.add_n([tf.reduce_sum(g) for g in grads])

    modes = {"forward_s": forward, "forward_backward_s": loss_and_grads, "step_no_reduce_s": step_local,
             "step_with_reduce_s": step_reduced}
    for fn in modes.values():  # trace and warm up
        for _ in range(2):
            sync(repl.run(fn, args=(x, y)))
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(steps):  # round-robin: a shared machine's load falls on every mode alike
        for name, fn in modes.items():
            barrier()
            t0 = time.perf_counter()
            sync(repl.run(fn, args=(x, y)))
            times[name].append(time.perf_counter() - t0)
    timed = {name: statistics.median(ts) for name, ts in times.items()}

    # --- contention: forward + backward beside a collective ---
    contention = _contention(repl, n, tf.function(loss_and_grads), (x, y), grad_bytes, steps,
                             sync, barrier, reduce_sum, deadline_s=10.0 if quick else 30.0)

    # --- the codec of each scheme, on this model's gradients, every rank at once ---
    grads = [tf.convert_to_tensor(g) for g in forward_backward(x, y)[1]]  # eager, this rank's own
    codecs = codec_functions(variables, grads, n, repl._backend.fusion_threshold_bytes, powersgd_ranks)
    for fn in codecs.values():
        fn()
    codec_times: dict[str, list[float]] = {name: [] for name in codecs}
    for _ in range(steps):
        for name, fn in codecs.items():
            barrier()
            t0 = time.perf_counter()
            last = [t for t in tf.nest.flatten(fn()) if t is not None][-1]
            tf.reshape(last, [-1])[:1].numpy()  # a device runs in order: its last output's first value is the end
            codec_times[name].append(time.perf_counter() - t0)
    codec = {name: statistics.median(ts) for name, ts in codec_times.items()}
    backward = max(timed["forward_backward_s"] - timed["forward_s"], 1e-9)
    rest = max(timed["step_no_reduce_s"] - backward, 0.0)

    # --- input pipeline ---
    from hvrep.data import DataConfig

    if data_dir:
        from hvrep.data import make_dataset

        fmt = "tfrecord" if list(Path(data_dir).glob("train-*-of-*")) else "folder"
        cfg = DataConfig(data_dir, format=fmt, image_size=image_size, resize_size=max(image_size, 256 * image_size
                                                                                       // 224))
        dataset = make_dataset(cfg, "train", batch_size=per_replica_batch)
        source = f"hvrep tf.data pipeline on {data_dir} ({fmt})"
    else:
        from hvrep.data.tfdata import synthetic_dataset

        cfg = DataConfig("synthetic", image_size=image_size, resize_size=image_size)
        dataset = synthetic_dataset(cfg, batch_size=per_replica_batch, num_classes=num_classes)
        source = "synthetic (one in-memory batch): not an input pipeline; not given to the plan"
    it = iter(dataset)
    next(it)
    batches = 3 if quick else 20
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    per_rank = batches * per_replica_batch / (time.perf_counter() - t0)
    node_ips = float(sync(repl.run(reduce_sum, args=(tf.constant([per_rank]),)))[0]) \
        if repl.backend == "horovod" else per_rank

    # --- host to device ---
    copy: dict[str, Any] = {"GBps": None, "why": "no GPU on this node"}
    if gpus:  # built to TensorFlow's API; never run by hvrep's tests (no GPU there)
        host = tf.constant(np.ones((16 << 20) // 4, dtype="float32"))

        def to_device() -> None:
            with tf.device(gpus[0].name):
                tf.reduce_sum(tf.identity(host)).numpy()

        copy = {"GBps": (16 << 20) / _median_s(to_device, 3 if quick else 10) / 1e9, "bytes": 16 << 20,
                "device": gpus[0].name, "why": "16 MB host tensor to the first GPU, sum read back"}

    from hvrep import _env

    # Horovod's cycle (1 ms unless HOROVOD_CYCLE_TIME says otherwise); no cycle on the in-graph backends.
    cycle_ms = float(_env.horovod_knobs()[_env.HOROVOD_CYCLE_TIME] or 1.0) if repl.backend == "horovod" else 0.0
    profile: dict[str, Any] = {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv, "quick": quick,
        "node": {"hostname": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                 "gpus": [d.name for d in gpus], "tensorflow": tf.__version__},
        "ranks": n, "launcher": placement.launcher, "replica_backend": repl.backend,
        "allreduce": {"backend": backend, "dtype": "float32", "op": "sum", "points": points, "fit": link,
                      "result_checked": checked,
                      "nccl": "built to Horovod's API, never run by hvrep's tests" if backend == "nccl" else None},
        "allreduce_float16": {"points": points16, "fit": link16, "result_checked": checked16,
                              "gamma_s_per_byte": gamma16},
        "contention": contention,
        "codec_s": codec, "codec_spread_s": {name: [min(ts), max(ts)] for name, ts in codec_times.items()},
        "model": {"name": model_name, "width": width, "per_replica_batch": per_replica_batch, "image_size": image_size,
                  "grad_bytes": grad_bytes, "tensors": len(shapes), "steps_timed": steps},
        "step": timed, "step_spread_s": {name: [min(ts), max(ts)] for name, ts in times.items()},
        "input": {"source": source, "images_per_sec_per_rank": per_rank, "images_per_sec_node": node_ips},
        "host_device_copy": copy,
        "plan_inputs": {
            "name": f"{model_name} ({image_size} px), measured", "per_replica_batch": per_replica_batch,
            "forward_s": rest, "backward_s": backward, "grad_bytes": grad_bytes, "tensors": len(shapes),
            # In the order the backward pass produces them (roughly the reverse of the variables').
            "gradient_shapes": [list(s) for s in shapes[::-1]],
            # hvrep's bucket (0: one collective per gradient, as Horovod gets them).
            "fusion_threshold_bytes": repl._backend.fusion_threshold_bytes or 1,
            "bucketing": "static" if repl._backend.fusion_threshold_bytes else "dynamic",
            "cycle_s": cycle_ms / 1e3,
            # One rank count cannot tell a per-hop latency from a per-call cost; on one node the per-call cost
            # (Horovod's negotiation and cycle, the library's launch) is most of it: it is taken as β, per
            # collective, and the link's hop latency as 0.
            "beta_s": DEFAULT_BETA_TENSOR_S if link is None else link["fixed_s"],
            "input_images_per_sec": node_ips if data_dir else None,
            "gamma_s_per_byte": {} if gamma16 is None else {"float16": gamma16},
            "codec_s": codec,
            "overlap_slowdown": contention["overlap_slowdown"] or 0.0,
            "source": f"hvrep bench node, {n} rank(s) via {placement.launcher} on {platform.node()}",
        },
        "intra_node_link": None if link is None else {
            "name": f"measured ({backend}, {n} ranks)", "bandwidth_GBps": link["bandwidth_GBps"],
            "latency_us": 0.0, "note": "the fitted per-call cost is plan_inputs.beta_s"},
    }
    return profile


def format_profile(p: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = [f"hvrep bench node: {p['ranks']} rank(s) via {p['launcher']}, all-reduce backend "
             f"{p['allreduce']['backend']}"]
    for pt in p["allreduce"]["points"]:
        lines.append(f"  all-reduce {pt['bytes']:>11,} B: {1e6 * pt['seconds']:10.1f} µs, algbw "
                     f"{pt['algbw_GBps']:.3f} GB/s, busbw {pt['busbw_GBps']:.3f} GB/s")
    fit = p["allreduce"]["fit"]
    if fit:
        lines.append(f"  fit: {1e6 * fit['fixed_s']:.0f} µs per call + bytes at {fit['bandwidth_GBps']:.3f} GB/s bus "
                     "bandwidth")
    half = p.get("allreduce_float16") or {}
    if half.get("fit"):
        gamma = half["gamma_s_per_byte"]
        lines.append(f"  float16 fit: {1e6 * half['fit']['fixed_s']:.0f} µs per call + bytes at "
                     f"{half['fit']['bandwidth_GBps']:.3f} GB/s: γ {1e9 * gamma:.2f} ns per byte beyond float32")
    if p.get("codec_s"):
        lines.append("  codec per step: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in p["codec_s"].items()))
    s, m = p["step"], p["model"]
    lines.append(f"  {m['name']} batch {m['per_replica_batch']}: forward {1e3 * s['forward_s']:.1f} ms, forward+"
                 f"backward {1e3 * s['forward_backward_s']:.1f} ms, step without reduction "
                 f"{1e3 * s['step_no_reduce_s']:.1f} ms, with it {1e3 * s['step_with_reduce_s']:.1f} ms")
    c = p.get("contention") or {}
    if c.get("overlap_slowdown") is not None:
        lines.append(f"  contention: forward+backward {1e3 * c['alone_s']:.1f} ms alone, {1e3 * c['beside_s']:.1f} ms "
                     f"beside an all-reduce of {c['collective_bytes']:,} B: σ {c['overlap_slowdown']:.2f}")
    elif c:
        lines.append(f"  contention: - ({c.get('why')})")
    lines.append(f"  input: {p['input']['images_per_sec_node']:,.0f} images/s on the node ({p['input']['source']})")
    copy = p["host_device_copy"]
    lines.append(f"  host to device: {'-' if copy['GBps'] is None else format(copy['GBps'], '.2f') + ' GB/s'} "
                 f"({copy['why']})")
    return "\n".join(lines)


def main(args: Any) -> int:
    """``hvrep bench node`` with parsed arguments (hvrep.perf.bench owns the flags)."""
    if args.per_replica_batch < 1 or args.image_size < 8:
        raise ConfigError(f"--per-replica-batch must be >= 1 and --image-size >= 8, got {args.per_replica_batch} "
                          f"and {args.image_size}.")
    width = getattr(args, "width", None)
    if width is not None and (width < 1 or args.model != "small_resnet"):
        raise ConfigError(f"--width {width} applies to --model small_resnet only and must be >= 1. Fix: drop it, "
                          "or use --model small_resnet.")
    text = getattr(args, "powersgd_ranks", None) or ",".join(map(str, POWERSGD_RANKS))
    try:
        ranks = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 1:
        raise ConfigError(f"--powersgd-ranks must be comma-separated whole numbers >= 1, got {text!r}. Fix: e.g. "
                          "--powersgd-ranks 1,2,4.")
    profile = node_profile(args.model, args.per_replica_batch, args.image_size, quick=args.quick,
                           data_dir=args.data, max_bytes=args.max_bytes, width=width, powersgd_ranks=ranks)
    import hvrep

    if hvrep.resolve_placement().rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(profile, indent=1) + "\n")
        print(format_profile(profile))
        print(f"hvrep bench node: profile written to {args.out}. Next: hvrep plan {args.out} --cluster CLUSTER.json")
    return 0
