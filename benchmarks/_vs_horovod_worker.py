"""One contender of ``benchmarks/vs_horovod.py``, run on every rank of an mpirun job.

    mpirun -np 2 python -m mpi4py benchmarks/_vs_horovod_worker.py --contender hvrep --comm-config '{}'
    TF_USE_LEGACY_KERAS=1 mpirun -np 2 LEGACY_PYTHON -m mpi4py benchmarks/_vs_horovod_worker.py --contender horovod

``vs_horovod.py`` starts it (it makes the legacy-Keras interpreter the
``horovod`` contender needs); it is a separate file so that the ``horovod``
contender's process imports neither hvrep nor Keras 3, only what Horovod's
own example imports.

Contenders, the same model, data, loss and optimizer settings:

* ``horovod``: Horovod's example, ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``
  (horovod/horovod), on legacy Keras (``tf.keras`` is tf_keras): the step is a
  ``tf.function`` with ``hvd.DistributedGradientTape`` (one ``hvd.allreduce``
  per gradient, fused by Horovod's background thread at its stock settings)
  and ``hvd.broadcast_variables`` of the model and the optimizer after the
  first step, which is traced separately (``first_batch`` is a Python bool).
* ``horovod-keras3``: the same step on Keras 3 (``import keras``), with the
  tape's per-gradient ``hvd.allreduce`` written out (``DistributedGradientTape``
  fails on Keras 3 variables): what Horovod's core ops give on the framework
  hvrep runs on, so the gap to ``horovod`` splits into Keras 3's own cost and hvrep's.
* ``hvrep``: the replica API on Keras 3: model and optimizer built in
  ``Replicator.scope()`` (which broadcasts them), the step
  ``tape -> grads -> hvrep.all_reduce(grads, "mean") -> apply_gradients``
  run with ``Replicator.run``, under the ``CommConfig`` given as JSON, with
  ``Replicator(batch_norm=--replicator-batch-norm)`` (default ``fused``: Keras'
  BatchNormalization layers train with TensorFlow's fused kernel inside ``run``,
  as tf_keras did; ``keras``: Keras 3's own ops); with ``--batch-norm fused``
  the model is ``hvrep.models.with_fused_batch_norm(model)``.

Both: one untimed first step (traces; Horovod's broadcast), ``--warmup``
untimed steps, a barrier, then ``--steps`` timed steps, each timed until this
rank holds its loss (read back with ``.numpy()``). Rank 0 prints one line,
``RESULT_PREFIX`` followed by JSON, with every rank's timings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf

# TensorFlow and mpi4py are imported in main(), not here: vs_horovod.py imports
# this module for its constants, and must not start MPI itself.

RESULT_PREFIX = "VS_HOROVOD_RESULT "
CONTENDERS = ("horovod", "horovod-keras3", "hvrep")
BATCH_NORMS = ("keras", "fused")
MODELS = ("resnet50", "small")
NUM_CLASSES = {"resnet50": 1000, "small": 10}
LEARNING_RATE, MOMENTUM = 0.01, 0.9


def build_model(keras_module: Any, name: str, image_size: int) -> Any:
    """The model, from ``keras_module`` (Keras 3 or tf_keras: both have these layers and applications).

    ``small`` is a tiny CNN (3 convolutions) for smoke tests: seconds per
    launch instead of minutes.
    """
    shape = (image_size, image_size, 3)
    if name == "resnet50":
        return keras_module.applications.ResNet50(weights=None, input_shape=shape, classes=NUM_CLASSES[name])
    layers = keras_module.layers
    return keras_module.Sequential([
        keras_module.Input(shape),
        layers.Conv2D(16, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False), layers.BatchNormalization(),
        layers.ReLU(),
        layers.Conv2D(64, 3, strides=2, padding="same", use_bias=False), layers.BatchNormalization(),
        layers.ReLU(),
        layers.GlobalAveragePooling2D(), layers.Dense(NUM_CLASSES[name], activation="softmax"),
    ])


def synthetic_batch(rank: int, seed: int, batch: int, image_size: int, classes: int) -> tuple[tf.Tensor, tf.Tensor]:
    """This rank's one in-memory batch: images (batch, size, size, 3) float32 in [0, 1), labels (batch,) int64."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed + rank)
    x = rng.random((batch, image_size, image_size, 3), dtype=np.float32)
    y = rng.integers(0, classes, size=(batch,), dtype=np.int64)
    return tf.constant(x), tf.constant(y)


def horovod_contender(args: argparse.Namespace) -> tuple[Callable[[bool], tf.Tensor], dict[str, Any]]:
    """Horovod's example step on legacy Keras (``horovod``) or on Keras 3 (``horovod-keras3``: the same
    step, to tell Keras 3's own cost from hvrep's); returns ``step(first_batch)`` and what to record."""
    import horovod
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    legacy = args.contender == "horovod"
    if legacy:
        keras_module = tf.keras
        where = keras_module.optimizers.SGD.__module__
        if not where.startswith("tf_keras"):
            raise RuntimeError(f"tf.keras.optimizers.SGD comes from {where}, not tf_keras: the horovod contender "
                               "runs on legacy Keras. Fix: run it with TF_USE_LEGACY_KERAS=1 and tf_keras installed.")
        keras_name = f"tf_keras {importlib.metadata.version('tf_keras')}"
    else:
        import keras as keras_module

        keras_name = f"keras {keras_module.__version__}"
    tf.random.set_seed(args.seed)
    model = build_model(keras_module, args.model, args.image_size)
    opt = keras_module.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    loss_fn = keras_module.losses.SparseCategoricalCrossentropy()
    x, y = synthetic_batch(hvd.rank(), args.seed, args.batch, args.image_size, NUM_CLASSES[args.model])

    @tf.function
    def training_step(images: tf.Tensor, labels: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        if legacy:
            tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
        else:
            # What DistributedGradientTape does (one hvd.allreduce per gradient, averaged), written out: the
            # helper itself fails on Keras 3 variables (it calls Variable.ref(), which they lack).
            grads = [hvd.allreduce(g, op=hvd.Average)
                     for g in tape.gradient(loss, model.trainable_variables)]
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        # As Horovod's example: after the first step, so the optimizer's slots exist
        # (Keras 3 optimizers have .variables as a property, tf_keras' a method).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables() if callable(opt.variables) else opt.variables, root_rank=0)
        return loss

    info = {
        "framework": {"keras": keras_name, "horovod": horovod.__version__,
                      "horovod_controller": "mpi" if hvd.mpi_enabled() else "gloo"},
        "collectives_per_step": len(model.trainable_variables),
        "collectives_source": "hvd.DistributedGradientTape: one hvd.allreduce per trainable variable "
                              "(fused on the wire by Horovod's background thread)",
        "num_ranks": int(hvd.size()),
        "rank": int(hvd.rank()),
    }
    return lambda first: training_step(x, y, first), info


def hvrep_contender(args: argparse.Namespace) -> tuple[Callable[[bool], tf.Tensor], dict[str, Any]]:
    """hvrep's replica-API step on Keras 3; returns ``step(first_batch)`` and what to record."""
    import dataclasses

    import horovod
    import keras
    import tensorflow as tf

    import hvrep

    config = hvrep.CommConfig(**json.loads(args.comm_config))
    repl = hvrep.Replicator(config=config, batch_norm=args.replicator_batch_norm)
    with repl.scope():
        keras.utils.set_random_seed(args.seed)
        model = build_model(keras, args.model, args.image_size)
        if args.batch_norm == "fused":
            model = hvrep.models.with_fused_batch_norm(model)
        opt = keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
        opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    x, y = synthetic_batch(repl.rank, args.seed, args.batch, args.image_size, NUM_CLASSES[args.model])

    def step(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(hvrep.all_reduce(grads, "mean", compress=True), model.trainable_variables,
                                strict=True))
        # What the trace built (the default graph is the step's own): which batch-norm arithmetic ran.
        ops = [op.type for op in tf.compat.v1.get_default_graph().get_operations()]
        info["traced_batch_norm_ops"] = {k: ops.count(k) for k in ("FusedBatchNormV3", "SquaredDifference")}
        return loss

    info: dict[str, Any] = {
        "framework": {"keras": f"keras {keras.__version__}", "horovod": horovod.__version__,
                      "hvrep": hvrep.__version__, "backend": repl.backend},
        "batch_norm": args.batch_norm,
        "replicator_batch_norm": repl.batch_norm,
        "comm_config": dataclasses.asdict(config),
        "num_ranks": repl.num_replicas,
        "rank": repl.rank,
    }

    def run(first: bool) -> tf.Tensor:
        before = repl.collective_calls
        loss = repl.run(step, args=(x, y))
        if first:  # counted when traced: the first call
            info["collectives_per_step"] = repl.collective_calls - before
            info["collectives_source"] = "repl.collective_calls delta over the first step (counted when traced)"
        return loss

    return run, info


def _timed_step(step: Callable[[bool], tf.Tensor], first: bool) -> float:
    start = time.perf_counter()
    step(first).numpy()
    return time.perf_counter() - start


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contender", choices=CONTENDERS, required=True)
    p.add_argument("--comm-config", default="{}", help="hvrep only: CommConfig's keyword arguments, as JSON")
    p.add_argument("--batch-norm", choices=BATCH_NORMS, default="keras",
                   help="hvrep only: fused = hvrep.models.with_fused_batch_norm(model)")
    p.add_argument("--replicator-batch-norm", choices=BATCH_NORMS, default="fused",
                   help="hvrep only: Replicator(batch_norm=...)")
    p.add_argument("--model", choices=MODELS, default="resnet50")
    p.add_argument("--batch", type=int, default=8, help="per-rank batch")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (tracing) one")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-via", choices=("mpi", "horovod"), default="mpi",
                   help="the barrier and gather around the timed loop: mpi4py (mpirun), or Horovod's own "
                        "collectives (horovodrun --gloo: no MPI world)")
    return p.parse_args(argv)


class _HorovodRanks:
    """The barrier and gather ``main`` needs, over Horovod's own collectives (mpi4py's names): under
    ``horovodrun --gloo`` there is no MPI world, and both contenders have Horovod running."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        self.hvd = hvd
        self.calls = 0

    def Get_rank(self) -> int:
        return int(self.hvd.rank())

    def Get_size(self) -> int:
        return int(self.hvd.size())

    def Barrier(self) -> None:
        import tensorflow as tf

        self.calls += 1
        self.hvd.allreduce(tf.constant(0.0), op=self.hvd.Sum, name=f"vs_horovod.barrier.{self.calls}").numpy()

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self.calls += 1
        everyone = self.hvd.allgather_object(obj, name=f"vs_horovod.gather.{self.calls}")
        return list(everyone) if self.Get_rank() == root else None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    make = hvrep_contender if args.contender == "hvrep" else horovod_contender
    step, info = make(args)
    build_s = time.perf_counter() - t0
    if args.ranks_via == "mpi":
        # Only now: importing mpi4py's MPI starts MPI, and the contender's own start (hvd.init(), or hvrep's
        # Replicator with the MPI settings it gives Open MPI first) must be what starts it, as in a user's script.
        from mpi4py import MPI

        comm: Any = MPI.COMM_WORLD
    else:
        comm = _HorovodRanks()

    first_s = _timed_step(step, True)
    warmup_s = [_timed_step(step, False) for _ in range(args.warmup)]
    comm.Barrier()
    start = time.perf_counter()
    step_s = [_timed_step(step, False) for _ in range(args.steps)]
    timed_s = time.perf_counter() - start
    comm.Barrier()

    mine = {"rank": comm.Get_rank(), "build_s": build_s, "first_step_s": first_s, "warmup_s": warmup_s,
            "step_s": step_s, "timed_s": timed_s}
    per_rank = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return 0
    # The job's throughput: every rank's images over the slowest rank's timed loop.
    slowest = max(r["timed_s"] for r in per_rank)
    result = {
        "contender": args.contender,
        "images_per_sec": comm.Get_size() * args.batch * args.steps / slowest,
        "timed_s": slowest,
        "per_rank": per_rank,
        **info,
        "worker_env": {
            "python": sys.executable,
            "python_version": platform.python_version(),
            "tensorflow": tf.__version__,
            "intra_op_threads_api": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op_threads_api": tf.config.threading.get_inter_op_parallelism_threads(),
            "variables": {k: v for k, v in sorted(os.environ.items())
                          if k.startswith(("HOROVOD_", "TF_NUM_", "TF_USE_LEGACY_KERAS", "OMP_",
                                           "OMPI_MCA_mpi_yield_when_idle"))},
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
        },
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
