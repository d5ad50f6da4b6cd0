"""One process per replica, over Horovod's core ops only.

Horovod's Keras helpers (DistributedGradientTape, broadcast_variables,
horovod.tensorflow.keras) fail on Keras 3 variables ("'Variable' object has
no attribute 'ref'", horovod#4290), so this backend uses allreduce,
allgather and broadcast and does the rest itself: fusion, compression,
variable broadcast and the first-step signature check.

Horovod's ops cannot be XLA-compiled on the CPU: ``run`` compiles the step
with ``tf.function`` (no ``jit_compile``); a step that wants XLA for its
compute puts that part in its own ``tf.function(jit_compile=True)`` and keeps
the collectives outside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from hvrep import _env, compat, kernels
from hvrep.compat import gloo_sockets, horovod_patches, removed_worker
from hvrep.errors import CollectiveError, ConfigError, ReplicaMismatchError, SetupError
from hvrep.replica import activity, shm, watchdog
from hvrep.replica.backends.base import Backend, FunctionCache, move_bf16_as_bits, reduce_bf16_as_f32
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext, check_op, per_replica_batch
from hvrep.replica.devices import NO_GPU, ReplicaGpu, rank_cpu_devices, rank_cuda_devices
from hvrep.replica.placement import resolve_placement


def bind_gpu(local_rank: int, devices_per_replica: int = 1, local_size: int = 1) -> ReplicaGpu:
    """Makes this process see its own GPUs only: ``local_rank*k ... local_rank*k+k-1`` (k =
    ``devices_per_replica``; with k = 1 the GPU number ``local_rank``), as Horovod's examples do for one.

    Must run before TensorFlow initialises its GPUs (``Replicator`` calls it at
    construction). Memory growth on, so ranks sharing a node do not each grab
    all of a GPU's memory at start-up. This narrows TensorFlow's view only:
    CUDA, and DALI with it, still numbers every device ``CUDA_VISIBLE_DEVICES``
    leaves visible (``hvrep.replica.devices``).

    Returns:
      The first GPU bound: TensorFlow's "/gpu:0" and its CUDA number (its index
      in the physical list bound from); both None without a GPU. TensorFlow
      numbers the k GPUs bound "/gpu:0" ... "/gpu:k-1".

    Raises:
      hvrep.errors.ConfigError: ``devices_per_replica`` > 1 and this rank has fewer GPUs than that.
    """
    gpus = tf.config.list_physical_devices("GPU")
    mine = rank_cuda_devices(local_rank, devices_per_replica, len(gpus), local_size)
    if not mine:
        return NO_GPU
    try:
        tf.config.set_visible_devices([gpus[i] for i in mine], "GPU")
        for i in mine:
            tf.config.experimental.set_memory_growth(gpus[i], True)
    except RuntimeError as e:  # GPUs already initialised
        raise SetupError(
            f"cannot bind this rank to GPU(s) {mine}: TensorFlow already initialised its GPUs ({e}). Fix: "
            "create hvrep.Replicator before running any TensorFlow op."
        ) from e
    return ReplicaGpu(mine[0], "/gpu:0")


def rank_devices(devices_per_replica: int, gpu: ReplicaGpu) -> tuple[str, ...]:
    """A rank's devices once ``bind_gpu`` has run: its k GPUs as TensorFlow renumbered them, or without a GPU
    its process's first k logical CPU devices (one CPU device needs no look-up, which would start TensorFlow's
    runtime before the program could configure it)."""
    k = devices_per_replica
    if gpu.cuda_device is not None:
        return tuple(f"/device:GPU:{i}" for i in range(k))
    if k == 1:
        return ("/device:CPU:0",)
    return rank_cpu_devices(k, [d.name for d in tf.config.list_logical_devices("CPU")])


@contextlib.contextmanager
def _capture_variables() -> Iterator[list[tf.Variable]]:
    """Collects every tf.Variable created inside (Keras 3 variables wrap one)."""
    created: list[tf.Variable] = []

    def creator(next_creator: Any, **kwargs: Any) -> tf.Variable:
        v = next_creator(**kwargs)
        created.append(v)
        return v

    with tf.variable_creator_scope(creator):
        yield created


_log = logging.getLogger("hvrep")

# What the watchdog's report calls a collective traced outside run: Keras' fit step calling
# Replicator.all_reduce (hvrep.keras.DistributedOptimizer), or the user's own tf.function.
_OUTSIDE_RUN = "a compiled step outside run (Keras fit, a tf.function)"

# What Horovod (and MPI) read when this process started it (they read these settings once, at init), and the
# mpi_yield_when_idle the first Replicator asked for (MPI may have started before it could be set).
_started_with: dict[str, str | None] | None = None
_yield_asked: bool | None = None

_FIELDS = {_env.HOROVOD_FUSION_THRESHOLD: "horovod_fusion_threshold_bytes",
           _env.HOROVOD_CYCLE_TIME: "cycle_time_ms",
           _env.OMPI_MCA_MPI_YIELD_WHEN_IDLE: "mpi_yield_when_idle"}


def _same(variable: str, wanted: Any, started: str | None) -> bool:
    if variable == _env.OMPI_MCA_MPI_YIELD_WHEN_IDLE:
        # What the first Replicator asked for counts too: when MPI had started before it, it was told once.
        return wanted == _yield_asked or bool(_env.flag_value(started)) == wanted  # unset: no yield
    return started is not None and float(started) == float(wanted)


def _mpi_started(hvd: Any) -> bool:
    """MPI already runs in this process: Horovod was started outside hvrep, or mpi4py's MPI was imported
    (which starts it). Importing mpi4py here would start it too, so only what is already imported is asked."""
    if hvd.is_initialized():
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized())


def _start_horovod(hvd: Any, config: CommConfig, *, started_by_hvrep: bool = False) -> None:
    """``hvd.init()`` with CommConfig's Horovod and MPI settings, or a refusal where they cannot apply.

    Horovod reads ``horovod_fusion_threshold_bytes`` and ``cycle_time_ms``
    once, when it starts. Refused: other values for a later Replicator, and
    any value when Horovod was started before the first Replicator (the
    user's own ``hvd.init()``): written to the environment then, they would
    be recorded as applied while Horovod ignores them.

    Args:
      started_by_hvrep: Horovod runs because hvrep's own code started it,
        having set the knobs before (elastic training re-forms the world with
        ``hvd.shutdown()`` and ``hvd.init()``): recorded, not refused.
        hvrep-internal; users never pass it.
    """
    global _started_with, _yield_asked
    wanted = {_env.HOROVOD_FUSION_THRESHOLD: config.horovod_fusion_threshold_bytes,
              _env.HOROVOD_CYCLE_TIME: config.cycle_time_ms,
              _env.OMPI_MCA_MPI_YIELD_WHEN_IDLE: config.mpi_yield_when_idle}
    if _started_with is not None and hvd.is_initialized():
        clashes = [f"{_FIELDS[k]}={v!r} (Horovod runs with {k}={_started_with[k] or 'its default'})"
                   for k, v in wanted.items() if v is not None and not _same(k, v, _started_with[k])]
        if clashes:
            raise ConfigError(
                f"this Replicator's CommConfig asks for {', '.join(clashes)}, but Horovod reads these once, when "
                "the first Replicator started it, and would silently ignore them. Fix: give the first Replicator "
                "of the process these values (or export the variables before it starts), and leave them "
                "None in later ones."
            )
        return
    if hvd.is_initialized() and not started_by_hvrep:
        # Started outside hvrep: what Horovod read is what the environment held then, which is now.
        running = _env.horovod_knobs()
        clashes = [f"{_FIELDS[k]}={wanted[k]!r} (Horovod runs with {k}={running[k] or 'its default'})"
                   for k in running if wanted[k] is not None and not _same(k, wanted[k], running[k])]
        if clashes:
            raise ConfigError(
                f"this Replicator's CommConfig asks for {', '.join(clashes)}, but Horovod was started before "
                "any Replicator (an hvd.init() of your own) and read its settings then: they would be silently "
                "ignored. Fix: create the Replicator before calling hvd.init() (it starts Horovod with them), or "
                "export the variables before hvd.init(), or leave them None in the CommConfig."
            )
    mpi_started = _mpi_started(hvd)
    if _env.horovod_elastic():
        _env.set_elastic_gloo_timeout()
    _yield_asked = config.mpi_yield_when_idle
    _started_with = _env.set_horovod_knobs(config.horovod_fusion_threshold_bytes, config.cycle_time_ms,
                                           config.mpi_yield_when_idle, mpi_started)
    if _env.horovod_elastic():
        with gloo_sockets.recorded():  # the world's connections, shut down on the next reset (reform_world)
            hvd.init()
    else:
        hvd.init()
    got = _env.flag_value(_started_with[_env.OMPI_MCA_MPI_YIELD_WHEN_IDLE])
    if (mpi_started and config.mpi_yield_when_idle and not got and int(hvd.size()) > 1 and int(hvd.rank()) == 0
            and hvd.mpi_enabled()):
        _log.warning(
            "hvrep: MPI started before this Replicator, so CommConfig(mpi_yield_when_idle=True) could not "
            "reach Open MPI: a rank waiting in MPI (Horovod's background thread, once a cycle) busy-polls a "
            "core the training step could use (Open MPI's yielding: ResNet-50 on busy CPU cores ran 1.58x as "
            "fast as busy polling; docs/performance.md, \"Throughput against plain Horovod\"). Fix: create the "
            "Replicator before `from mpi4py import MPI` or hvd.init(), or launch with "
            "`mpirun --mca mpi_yield_when_idle 1` (or export OMPI_MCA_mpi_yield_when_idle=1); "
            "pass mpi_yield_when_idle=None to silence this.")


# The horovod backends of this process that are not closed: an elastic reset re-forms the world under every one.
_LIVE: weakref.WeakSet[HorovodBackend] = weakref.WeakSet()


def reform_world() -> None:
    """Re-forms Horovod's world after a lost worker or a host update (elastic training), for every live backend.

    Every collective of the old world has failed or completed by now (the caller caught the failure or reached
    a commit); ``hvd.shutdown()`` ends Horovod's background thread, ``hvd.init()`` blocks until the elastic
    driver's rendezvous hands this process its place in the new world. hvrep started Horovod itself with the
    first backend's settings, so this start is recorded, not refused as a user's early ``hvd.init()`` would be.
    The watchdog is stopped first (its server may sit on a rank that is gone) and restarted in the new world.

    Raises:
      hvrep.errors.SetupError: no horovod backend is live in this process.
    """
    backends = list(_LIVE)
    if not backends:
        raise SetupError("an elastic reset needs a live hvrep.Replicator on the horovod backend; none is open. "
                         "Fix: create the Replicator (backend 'horovod' or 'auto' under horovodrun) before "
                         "hvrep.elastic.run's function runs, and keep it open.")
    hvd = compat.import_horovod()
    watchdog.install(None)
    hvd.shutdown()
    # Horovod 0.28.1 leaves the old world's Gloo connections open after its shutdown: a survivor waiting to
    # receive from this worker would wait out the Gloo timeout (hvrep/compat/gloo_sockets.py).
    closed = gloo_sockets.shut_down_world()
    _log.debug("hvrep: shut down %d connection(s) of the old Gloo world", closed)
    # A worker the discovery script dropped learns it in hvd.init(), from a C++ exception that would abort it.
    with removed_worker.one_line_on_removal("hvrep: elastic worker"):
        _start_horovod(hvd, backends[0].config, started_by_hvrep=True)
    for b in backends:
        b.reform()
    for b in backends:
        b.restart_watchdog()


def _check_world_size(horovod_size: int) -> None:
    """Horovod's world must be the launcher's: otherwise each process runs as a job of its own."""
    placement = resolve_placement()
    if placement.launcher != "none" and placement.size != horovod_size:
        raise SetupError(
            f"the launcher ({placement.launcher}) started this process as rank {placement.rank} of "
            f"{placement.size}, but Horovod's world has {horovod_size} process(es): the ranks did not find each "
            "other and would train as separate jobs. Fix: launch with horovodrun, mpirun, or srun with an MPI "
            "plugin Horovod's MPI understands (srun --mpi=pmix), and check `hvrep doctor`."
        )


class HorovodBackend(Backend):
    name = "horovod"
    collectives_in_cond = True  # Horovod's ops are graph ops like any other; every rank takes the same branch
    # 25 MiB (PyTorch DDP's default bucket): a bucket's all-reduce is an asynchronous Horovod op that starts
    # as soon as its gradients exist, so smaller buckets overlap the rest of the backward pass, where one
    # 128 MiB bucket waits for all 102 MB of ResNet-50's. Measured with benchmarks/vs_horovod.py, ResNet-50
    # 224 px, 2 ranks, alternating, 3 rounds (docs/performance.md, "Throughput against plain Horovod"): 25 MiB
    # 4.27-4.41 images/s, 128 MiB 4.00-4.07, 0 (each gradient to Horovod's own fusion) 4.05-4.20.
    default_fusion_threshold_bytes = 25 * 1024 * 1024

    def __init__(self, config: CommConfig, devices_per_replica: int = 1) -> None:
        super().__init__(config, devices_per_replica)
        # compression="bf16" (Horovod cannot reduce bfloat16) is refused by the support table (hvrep.replica.support)
        # before the Replicator creates this backend.
        hvd = compat.import_horovod()
        _start_horovod(hvd, config)
        # Every collective this backend issues goes through Horovod's module wrapped for the watchdog, eager or
        # traced, in run or in Keras' fit (hvrep.replica.activity.Watched): nothing else needs to mark them.
        self._doing = ""
        self.hvd = activity.Watched(hvd, lambda: self._doing or _OUTSIDE_RUN)
        # Under horovodrun's elastic driver the world comes from its rendezvous (the launcher's variables are
        # stale after the first reset); otherwise it must be the launcher's.
        self.elastic = _env.horovod_elastic()
        if not self.elastic:
            _check_world_size(int(self.hvd.size()))
        self._read_world()
        self._gpu = bind_gpu(self._local_rank, devices_per_replica, self._local_size)
        self._devices = rank_devices(devices_per_replica, self._gpu)
        self._scope_vars: dict[int, tf.Variable] = {}
        self._functions = FunctionCache()
        self._signature: list[str] | None = None
        self._eager_names = 0
        self._start_watchdog(config.timeout_s)
        self._shm = self._open_shm(config)
        _LIVE.add(self)

    def _open_shm(self, config: CommConfig) -> Any:
        """hvrep's shared-memory all-reduce for the in-step reductions, where it applies (hvrep.replica.shm);
        None: Horovod's collectives serve. Collective: every rank runs the same handshake."""
        asked = shm.setting(config.local_transport)
        if asked == "horovod":
            return None
        reason = shm.why_not(size=self._size, local_size=self._local_size, elastic=self.elastic,
                             gpu=self._gpu.cuda_device is not None)
        if reason and not shm.per_rank(reason):
            # The same on every rank (one rank, several hosts, elastic): no handshake. Under the elastic driver a
            # worker joining later creates its Replicator while the others are past theirs: a collective here would
            # pair with nothing.
            return shm.refused(asked, reason)

        def agree(flag: bool) -> bool:
            out = self.hvd.allreduce(tf.constant(int(flag), tf.int32), op=self.hvd.Min, name=self._name("shm_agree"))
            return bool(int(out.numpy()))

        with self._calling("opening the shared-memory all-reduce (Replicator creation)"):
            return shm.open_transport(self._rank, self._size, reason, asked, agree, self.broadcast_object)

    def _read_world(self) -> None:
        """Rank, size, local rank and local size, from Horovod's live values: read at start and after each
        elastic reset (hvrep.replica.elastic), never per call (they cost a call into Horovod each)."""
        self._rank, self._size = int(self.hvd.rank()), int(self.hvd.size())
        self._local_rank, self._local_size = int(self.hvd.local_rank()), int(self.hvd.local_size())

    def reform(self) -> None:
        """Follows a world Horovod has just re-formed (an elastic reset: ``hvd.shutdown()``, ``hvd.init()``).

        Rank and size are read again; the compiled steps are dropped, since a traced step holds the old world
        (a mean's 1/N prescale, the signature checked on its first call), so the next ``run`` traces and checks
        anew against the new world and broadcasts rank 0's values of the variables it uses that the elastic
        state's sync did not; the eager collectives' names restart (a joining worker starts its count at 0).
        Called on every backend of the process by :func:`reform_world`. The GPU stays the one bound at start
        (TensorFlow binds once per process).
        """
        self._read_world()
        self._functions = FunctionCache()
        self._signature = None
        self._eager_names = 0
        # A joining worker holds none of them: its first run broadcasts every variable the step uses that the
        # elastic state did not, and so must the others'.
        self._scope_vars.clear()

    def restart_watchdog(self) -> None:
        """Starts this backend's watchdog for the current world (after :meth:`reform`): rank 0's server, with a
        new secret, on whichever process is rank 0 now."""
        self._start_watchdog(self.config.timeout_s)

    def _start_watchdog(self, timeout_s: float) -> None:
        """One hang watchdog per process (CommConfig.timeout_s > 0, more than one rank); a later Replicator
        reuses it with its own timeout. Rank 0's address and the job's secret travel in one broadcast, the only
        Horovod op it uses."""
        if timeout_s <= 0 or self._size < 2:
            return
        found = watchdog.current()
        if found is not None:
            found.timeout_s = float(timeout_s)
            watchdog.acquire(self)
            return

        def exchange(address: bytes) -> bytes:
            buf = np.zeros(512, np.uint8)
            buf[:len(address)] = np.frombuffer(address[:512], np.uint8)
            out = self.hvd.broadcast(tf.constant(buf), root_rank=0, name=self._name("watchdog")).numpy()
            return out.tobytes().rstrip(b"\0")

        watchdog.install(watchdog.Watchdog(self._rank, self._size, timeout_s, exchange,
                                           single_host=self._local_size == self._size, elastic=self.elastic), self)

    def close(self) -> None:
        """Drops the compiled steps and the variables it tracks, and its use of the watchdog (the last user
        stops it). Horovod stays initialised for the process, as Horovod requires."""
        self._functions = FunctionCache()
        self._scope_vars.clear()
        watchdog.release(self)
        _LIVE.discard(self)

    @contextlib.contextmanager
    def _calling(self, what: str) -> Iterator[None]:
        """Labels the collectives issued inside (traced or eager) with ``what``, for the watchdog's report."""
        before, self._doing = self._doing, what
        try:
            yield
        finally:
            self._doing = before

    @classmethod
    def available(cls) -> bool:
        try:
            return resolve_placement().size > 1 and compat.import_horovod() is not None
        except Exception:
            return False

    @property
    def num_replicas(self) -> int:
        return self._size

    @property
    def controller(self) -> str:
        """How Horovod's ranks meet: "gloo" (horovodrun --gloo, its elastic driver) or "mpi"."""
        return "gloo" if self.hvd.gloo_enabled() else "mpi"

    @property
    def is_chief(self) -> bool:
        return self._rank == 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_processes(self) -> int:
        return self._size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_size(self) -> int:
        return self._local_size

    def replica_devices(self) -> tuple[str, ...]:
        return self._devices

    def _name(self, kind: str) -> str:
        # Eager Horovod ops need names that match across ranks: every rank
        # makes the same eager calls in the same order.
        self._eager_names += 1
        return f"hvrep.{kind}.{self._eager_names}"

    # --- scope: variables start identical -------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        with _capture_variables() as created:
            yield
        if self.elastic:
            # A worker that joins a running elastic job reaches this while the others are past it: a broadcast
            # here would pair with nothing. hvrep.elastic.State's sync broadcasts what it tracks, and the first
            # run after each reset broadcasts every other variable the step uses, on every rank alike.
            return
        for v in created:
            self._scope_vars[id(v)] = v
        with self._calling("scope()'s broadcast of its variables"):
            self._broadcast_variables(created)

    def broadcast_variables(self, variables: Sequence[tf.Variable], root: int) -> None:
        super().broadcast_variables(variables, root)
        with self._calling(f"broadcast_variables(root_rank={root}) at {_call_site()}"):
            self._broadcast_variables(variables, root)
        for v in variables:
            self._scope_vars[id(v)] = v

    def _broadcast_variables(self, variables: Sequence[tf.Variable], root: int = 0) -> None:
        """Overwrites ``variables`` with rank ``root``'s values: one broadcast per dtype."""
        by_dtype: dict[tf.DType, list[tf.Variable]] = {}
        for v in variables:
            by_dtype.setdefault(v.dtype.base_dtype, []).append(v)
        for dtype, vs in sorted(by_dtype.items(), key=lambda kv: kv[0].name):
            flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in vs], axis=0)
            name = self._name(f"scope_{dtype.name}")
            out = move_bf16_as_bits(flat, lambda w, name=name: self.hvd.broadcast(w, root_rank=root, name=name))
            sizes = [int(v.shape.num_elements()) for v in vs]
            for v, piece in zip(vs, tf.split(out, sizes) if len(vs) > 1 else [out], strict=True):
                v.assign(tf.reshape(piece, v.shape))

    # --- data -----------------------------------------------------------------------------

    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None) -> tf.data.Dataset:
        ctx = InputContext(self._rank, self.num_replicas, per_replica_batch(global_batch_size, self.num_replicas),
                           cuda_device=self._gpu.cuda_device, tf_device=self._gpu.tf_device, devices=self._devices)
        return input_fn(ctx)

    # --- run ------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        entry = self._functions.entry(fn, lambda f: tf.function(self.step_body(f), reduce_retracing=True))
        tf_fn = entry[1]
        with self.replica_section(), self._calling(f"run({getattr(fn, '__qualname__', repr(fn))})"):
            if entry[2] is None:
                self._first_call_checks(tf_fn, args, kwargs)
                entry[2] = "checked"
            return tf_fn(*args, **kwargs)

    def _first_call_checks(self, tf_fn: Any, args: tuple, kwargs: dict) -> None:
        """Traces without running, checks the collective signatures, then makes every variable the step uses
        start identical: those not already broadcast by ``scope()`` (a model built outside it, layers and
        optimizer slots created lazily by this first trace) are broadcast from rank 0 before the step runs."""
        self._signature = []
        concrete = tf_fn.get_concrete_function(*args, **kwargs)
        signature, self._signature = self._signature, None
        # In creation order: the same on every rank running the same program (the function's own order is not).
        late = sorted((v for v in concrete.variables if id(v) not in self._scope_vars), key=_creation_order)
        if self.num_replicas > 1 and late:
            # The broadcast below needs the same variables in the same order on every rank.
            signature = signature + [f"variable {v.name} {v.dtype.name}{v.shape.as_list()}" for v in late]
        if self.config.check_first_step and self.num_replicas > 1:
            self._compare_signatures(signature)
        if self.num_replicas > 1 and late:
            self._broadcast_variables(late)
            if self.is_chief:
                outside = [v.name for v in late if v.trainable]
                if outside:
                    warnings.warn(
                        f"{len(outside)} trainable variable(s) the step uses were not created inside "
                        f"Replicator.scope() ({', '.join(sorted(outside)[:5])}); hvrep broadcast rank 0's values "
                        "before the first step so every rank starts the same. Create the model inside `with "
                        "repl.scope():` to have them identical from the start (e.g. for an evaluation before "
                        "training).", stacklevel=4)
        for v in late:
            self._scope_vars[id(v)] = v

    def _texts_if_they_differ(self, text: str, kind: str) -> list[str] | None:
        """None if every rank passed the same ``text`` (one allgather of a digest), else every rank's text."""
        digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        digests = self.hvd.allgather(tf.constant([digest], tf.int64), name=self._name(kind)).numpy().tolist()
        if len(set(digests)) == 1:
            return None
        blob = np.frombuffer(text.encode(), np.uint8)
        lengths = self.hvd.allgather(tf.constant([len(blob)], tf.int64), name=self._name(f"{kind}len")).numpy()
        data = self.hvd.allgather(tf.constant(blob), name=self._name(f"{kind}data")).numpy().tobytes()
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return [data[offsets[r]:offsets[r + 1]].decode() for r in range(len(lengths))]

    def _compare_signatures(self, signature: list[str]) -> None:
        texts = self._texts_if_they_differ("\n".join(signature), "sig")
        if texts is None:
            return
        per_rank = [t.split("\n") for t in texts]
        mine = int(self.hvd.rank())
        for r, sig in enumerate(per_rank):
            if sig == per_rank[0]:
                continue
            pairs = enumerate(zip(per_rank[0], sig, strict=False))
            n = next((i for i, (a, b) in pairs if a != b), min(len(sig), len(per_rank[0])))
            a = per_rank[0][n] if n < len(per_rank[0]) else "(nothing)"
            b = sig[n] if n < len(sig) else "(nothing)"
            raise ReplicaMismatchError(
                f"replicas issue different collectives in the step (seen on rank {mine}): collective #{n + 1} "
                f"is {a} on rank 0 but {b} on rank {r}. Horovod would hang. Fix: make every replica call the "
                "same collectives with the same shapes and dtypes (pad or mask uneven batches)."
            )

    def _on_collective(self, kind: str, tensors: Sequence[tf.Tensor], detail: str = "") -> None:
        if self._signature is not None:
            # (A tensor of unknown rank, which the fused all-reduce reduces unfused, shows as "[?]".)
            desc = ",".join(f"{t.dtype.name}{t.shape.as_list() if t.shape.rank is not None else '[?]'}"
                            for t in tensors)
            self._signature.append(f"{kind}({detail}){desc}")

    # --- collectives ----------------------------------------------------------------------

    def _hvd_op(self, op: str) -> Any:
        return {"sum": self.hvd.Sum, "mean": self.hvd.Sum, "max": self.hvd.Max, "min": self.hvd.Min}[op]

    def _reduce_wire(self, t: tf.Tensor, op: str) -> tf.Tensor:
        if (self._shm is not None and op in ("sum", "mean") and t.dtype in shm.native_shm.DTYPES
                and not tf.executing_eagerly()):
            # One host: hvrep's shared-memory all-reduce (hvrep.replica.shm), watched as Horovod's ops are. The key
            # pairs the op across ranks as Horovod's name would: the tensor's name in the traced step.
            return activity.watched(self._shm.allreduce, "allreduce", lambda: self._doing or _OUTSIDE_RUN)(
                t, key=f"hvrep_shm_{_op_name(t)}")
        # Every in-step reduction of hvrep's (its fused buckets: all_reduce, wrap_optimizer, PowerSGD, local SGD)
        # is fused already: the marker in the op's name has hvrep's Horovod build start the cycle at once instead
        # of waiting a fusion window for more tensors (compat/horovod_patches.py, FLUSH_PATCHES). The name keeps
        # "HorovodAllreduce", which elastic's failure check looks for, and the tensor's name, as Horovod's default
        # does, so it is the same on every rank tracing the same step.
        name = None if tf.executing_eagerly() else f"HorovodAllreduce_{horovod_patches.FLUSH_NAME}_{_op_name(t)}"
        return self.hvd.allreduce(t, op=self._hvd_op(op), name=name)

    def _reduce_parts(self, parts: list[tf.Tensor], scale: float, align: int) -> tf.Tensor | None:
        dtype = parts[0].dtype
        if (self._shm is None or tf.executing_eagerly() or dtype not in shm.native_shm.DTYPES
                or dtype == tf.bfloat16 or not self._shm.gathers):
            return None  # bfloat16 keeps _reduce_wire's float32 path (reduce_bf16_as_f32), as Horovod needs
        # The key pairs the op across ranks as _reduce_wire's does, from the parts' names in the traced step (the
        # same on every rank), with the scale and layout: two ops of one key must reduce the same thing.
        names = "|".join(t.name for t in parts) + f"|{scale!r}|{align}"
        digest = hashlib.blake2b(names.encode(), digest_size=8).hexdigest()
        # The watchdog's label names the packed buffer, as it does where the bucket is packed (across hosts).
        sizes = [t.shape.num_elements() for t in parts]
        packed = tf.TensorSpec([None if None in sizes else kernels.packed_length(sizes, align)], dtype)
        return activity.watched(self._shm.allreduce_parts, "allreduce", lambda: self._doing or _OUTSIDE_RUN,
                                describe=packed)(
            parts, key=f"hvrep_shm_{_op_name(parts[0])}_{len(parts)}_{digest}", scale=scale, align=align)

    def all_gather(self, x: tf.Tensor, axis: int) -> tf.Tensor:
        self._on_collective("all_gather", [x], str(axis))
        self.collective_calls += 1
        rank = x.shape.rank
        if rank == 0:
            raise CollectiveError("all_gather needs a tensor of rank >= 1; got a scalar. Fix: x[None].")
        axis = axis % rank
        perm = [axis, *[i for i in range(rank) if i != axis]]
        moved = tf.transpose(x, perm) if axis else x
        gathered = move_bf16_as_bits(moved, self.hvd.allgather)
        return tf.transpose(gathered, np.argsort(perm)) if axis else gathered

    def broadcast(self, x: tf.Tensor, root: int) -> tf.Tensor:
        self._on_collective("broadcast", [x], str(root))
        self.collective_calls += 1
        if not 0 <= root < self.num_replicas:
            raise CollectiveError(f"broadcast root={root} is not a replica id in [0, {self.num_replicas}).")
        return move_bf16_as_bits(x, lambda w: self.hvd.broadcast(w, root_rank=root))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` on every rank: its pickle's length, then its bytes, in two named broadcasts
        (eager, watched). Only plain values travel this way (the elastic state's scalars)."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8) if self._rank == root else np.zeros(0, np.uint8)
        with self._calling("an elastic state's sync (broadcast of its values)"):
            n = int(self.hvd.broadcast(tf.constant([len(data)], tf.int64), root_rank=root,
                                       name=self._name("object_len")).numpy()[0])
            buf = data if self._rank == root else np.zeros(n, np.uint8)
            out = self.hvd.broadcast(tf.constant(buf), root_rank=root, name=self._name("object")).numpy()
        return obj if self._rank == root else pickle.loads(out.tobytes())

    def replica_id(self) -> tf.Tensor:
        return tf.constant(int(self.hvd.rank()), tf.int32)

    def reduce(self, value: Any, op: str) -> Any:
        check_op(op)
        hop = self._hvd_op(op)
        with self._calling(f"reduce({op}) at {_call_site()}"):
            return self._reduce(value, op, hop)

    def _reduce(self, value: Any, op: str, hop: Any) -> Any:
        # What travels: bfloat16 as float32 (Horovod reduces no bfloat16), cast back after the reduction. Each
        # leaf is converted once; a large reduce casts nothing here (reduce_bf16_as_f32 does, leaf by leaf).
        flat = [None if v is None else tf.convert_to_tensor(v) for v in tf.nest.flatten(value)]
        leaves = [t for t in flat if t is not None]
        wire = [tf.float32 if t.dtype == tf.bfloat16 else t.dtype for t in leaves]
        small = (all(d in _GATHERED_DTYPES for d in wire) and self.num_replicas * sum(
            t.shape.num_elements() * d.size for t, d in zip(leaves, wire, strict=True)) <= GATHERED_REDUCE_BYTES)
        arrays = [np.asarray(tf.cast(t, d).numpy()) for t, d in zip(leaves, wire, strict=True)] if small else []
        gathered = self._check_same_call(f"reduce({op})", value, b"".join(a.tobytes() for a in arrays) if small
                                         else None)
        if gathered is not None:
            # The values came with the call check: reduced here, in rank order, the same on every rank.
            reduced = iter(_reduce_gathered(gathered, arrays, op))
            collective = lambda w: tf.constant(next(reduced))  # noqa: E731
        else:
            collective = lambda w: self.hvd.allreduce(w, op=hop, name=self._name("reduce"))  # noqa: E731

        return tf.nest.pack_sequence_as(value, [
            None if t is None else reduce_bf16_as_f32(t, op, self.num_replicas, collective).numpy() for t in flat])

    def _check_same_call(self, what: str, value: Any, payload: bytes | None = None) -> list[bytes] | None:
        """Refuses an eager collective that is not the same call on every rank; returns every rank's ``payload``.

        Eager Horovod ops pair across ranks by name, and the names come from a per-process counter; a call made
        on some ranks only (``if repl.is_chief: repl.reduce(...)``) would pair each later call with a different
        one on the other ranks, exchanging the wrong tensors or hanging. One allgather of the call site's digest
        first makes every rank see the mismatch and raise the same error instead. ``payload`` (a small
        reduction's values, the same size on every rank making the same call) travels in that same allgather:
        returned in rank order, so the caller needs no collective of its own; None where it was None.
        """
        site = _call_site()
        shapes = ",".join(f"{tf.as_dtype(getattr(v, 'dtype', np.asarray(v).dtype)).name}{list(np.shape(v))}"
                          for v in tf.nest.flatten(value) if v is not None)
        text = f"{what} at {site} of {shapes}"
        digest = hashlib.sha256(text.encode()).digest()[:8]
        body = payload or b""
        block = digest + len(body).to_bytes(8, "little") + body
        out = self.hvd.allgather(tf.constant(np.frombuffer(block, np.uint8)), name=self._name("call")).numpy()
        blocks, pos, data = [], 0, out.tobytes()
        while pos + _CALL_HEADER <= len(data):  # each rank's block, in rank order: its length is in its header
            n = int.from_bytes(data[pos + 8:pos + 16], "little")
            blocks.append((data[pos:pos + 8], data[pos + _CALL_HEADER:pos + _CALL_HEADER + n]))
            pos += _CALL_HEADER + n
        # The same digest is the same call on the same dtypes and shapes: every rank sent a payload or none.
        if len(blocks) == self.num_replicas and pos == len(data) and all(b[0] == digest for b in blocks):
            return [b[1] for b in blocks] if payload is not None else None
        calls = self._texts_if_they_differ(text, "call") or [text] * self.num_replicas
        listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        raise ReplicaMismatchError(
            f"ranks made different eager collective calls (call #{self._eager_names} of this process): {listing}. "
            "Every rank must make the same Replicator.reduce calls in the same order, or the job exchanges the "
            "wrong values or hangs. Fix: call repl.reduce on every rank and use its result only on the chief "
            "(e.g. `loss = repl.reduce(x, 'mean'); if repl.is_chief: print(loss)`)."
        )


# An eager reduce whose values, times the ranks, come to at most this many bytes travels in its call check's
# allgather (HorovodBackend._check_same_call) and is summed on each rank: one collective a call, where one a leaf
# followed, each waiting out Horovod's fusion window (eager ops cannot skip it) — hvrep train's loop totals every
# steps_per_loop steps, a Keras callback's metrics. Larger values take Horovod's all-reduce, leaf by leaf.
GATHERED_REDUCE_BYTES = 1 << 16
_GATHERED_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
_CALL_HEADER = 16  # a rank's block in the call check: the call's digest (8 bytes), the payload's length (8)


def _reduce_gathered(gathered: Sequence[bytes], wires: Sequence[np.ndarray], op: str) -> list[np.ndarray]:
    """Every rank's values (``gathered``: each rank's counterpart of this rank's ``wires``, as bytes, in rank
    order) reduced leaf by leaf: summed (for "sum" and "mean") or the max or min, in rank order and in the wire's
    dtype, as Horovod would."""
    ufunc = {"max": np.maximum, "min": np.minimum}.get(op, np.add)
    out = []
    offset = 0
    for w in wires:
        parts = [np.frombuffer(g, w.dtype, w.size, offset).reshape(w.shape) for g in gathered]
        acc = parts[0].copy()
        for p in parts[1:]:
            ufunc(acc, p, out=acc)
        out.append(acc)
        offset += w.nbytes
    return out


def _op_name(t: tf.Tensor) -> str:
    """``t``'s name as a piece of an op name (Horovod's own default name does the same)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", t.name)


def _creation_order(v: tf.Variable) -> tuple[int, str]:
    """A variable's place in this process's creation order: eager TF variables end their unique id in a
    process-wide counter (``name_<uid>``)."""
    tail = str(getattr(v, "_unique_id", "")).rpartition("_")[2]
    return (int(tail) if tail.isdigit() else 1 << 62, v.name)


def _call_site() -> str:
    """file:line of the first caller outside hvrep's replica layer (the user's call)."""
    here = Path(__file__).resolve().parents[1]
    frame = sys._getframe(1)
    while frame is not None and Path(frame.f_code.co_filename).resolve().is_relative_to(here):
        frame = frame.f_back
    if frame is None:
        return "(unknown)"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
