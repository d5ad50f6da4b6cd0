"""Frozen, validated configuration for cross-replica communication (STYLE.md, principle 3: Orbit's options)."""

from __future__ import annotations

from dataclasses import dataclass

from hvrep.errors import ConfigError
from hvrep.replica import support

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# CommConfig(outer_optimizer=...): what local SGD applies to the averaged change of each round (None: averaging).
OUTER_OPTIMIZERS = (None, "nesterov")
LOCAL_TRANSPORTS = ("auto", "horovod", "shm")


@dataclass(frozen=True)
class CommConfig:
    """How gradients and other values cross replicas.

    Attributes:
      fusion_threshold_bytes: hvrep packs the tensors of one ``all_reduce``
        call into contiguous buffers of at most this many bytes (in backward
        order: the last layers' gradients first, so a bucket can go while the
        backward pass still runs) and issues one collective per buffer. 0: one
        collective per tensor (on horovod: each gradient goes to Horovod as
        soon as it exists and Horovod's background thread fuses what is
        ready each cycle). None (default): the backend's choice: 25 MiB on
        horovod, where smaller buckets overlap the backward pass (measured
        faster than 128 MiB and than 0 on ResNet-50; docs/performance.md, "Throughput against plain Horovod"),
        128 MiB on the in-graph backends (not measured there; all of
        ResNet-50's 102 MB of fp32 gradients in one buffer). hvrep's buckets only: Horovod's own fusion
        buffer is ``horovod_fusion_threshold_bytes``.
      horovod_fusion_threshold_bytes: Horovod's process-wide
        ``HOROVOD_FUSION_THRESHOLD`` (its background fusion of the collectives
        in flight). None (default): hvrep does not set it, so Horovod's stock
        value, or the one the user exported, holds.
      cycle_time_ms: Horovod's background-thread cycle time
        (``HOROVOD_CYCLE_TIME``). None (default): Horovod's stock value (or the
        exported one; 1 ms). Horovod reads both once, when it starts: a later
        Replicator in the same process that asks for other values is refused.
        Its thread meets the other ranks once a cycle while a tensor is
        pending (stock Horovod: every cycle, busy or not; hvrep's build waits
        for work, hvrep/compat/horovod_patches.py); before
        ``mpi_yield_when_idle`` was the default, a longer cycle cut how long
        Open MPI busy-polled: 5 ms ran ResNet-50 on busy CPU cores 1.37x as
        fast (20 ms: 1.48x), while 45 ms steps ran 4% slower (docs/performance.md,
        "Throughput against plain Horovod").
      mpi_yield_when_idle: how a rank waits inside MPI (Open MPI's
        ``mpi_yield_when_idle``, which hvrep sets as
        ``OMPI_MCA_mpi_yield_when_idle`` before Horovod starts MPI). True
        (default): a waiting rank hands its core back to the scheduler
        between polls, so Horovod's background thread, which meets the other
        ranks in MPI once a cycle while a tensor is pending, stops taking a core from the training
        step while it waits for them. False: it busy-polls (Open MPI's
        default unless a node is oversubscribed). None: hvrep sets nothing.
        A value the user exported (or ``mpirun --mca mpi_yield_when_idle``)
        wins, and so does a site's: where an Open MPI parameter file
        (``$OMPI_HOME/etc/openmpi-mca-params.conf``,
        ``~/.openmpi/mca-params.conf`` or those ``OMPI_MCA_param_files``
        names) sets ``mpi_yield_when_idle``, hvrep exports nothing. Open MPI
        reads it once, when MPI starts: a Replicator created after MPI
        started (``from mpi4py import MPI``, the user's own ``hvd.init()``)
        cannot set it and says so. Horovod's MPI controller only (mpirun,
        horovodrun without --gloo, srun with Open MPI); Gloo and NCCL do not
        read it. This is Open MPI's own setting, not an hvrep algorithm: on
        2 ranks that keep both cores of a machine busy, ResNet-50 ran 1.58x
        as fast as plain Horovod with Open MPI's stock busy polling, and at
        parity (0.99x) when Horovod's job yields too
        (``mpirun -x OMPI_MCA_mpi_yield_when_idle=1``; docs/performance.md, "Throughput
        against plain Horovod").
      compression: "none", "fp16" or "bf16": the dtype gradient buffers
        travel in: the floating-point sum/mean of the reductions that ask for
        it (``all_reduce(..., compress=True)``: ``wrap_optimizer``,
        ``hvrep.keras.DistributedOptimizer``, the training app's step), never
        statistics, counts, metrics or other values (fp16's largest value is
        65,504). fp16 halves the bytes on every backend. bf16 keeps
        fp32's range; Horovod cannot reduce bfloat16, so the horovod backend
        refuses it (see docs/replica-api.md, "Backends"). "powersgd": rank-r
        compression of the gradient matrices with error feedback (Vogels et
        al. 2019; the ``powersgd_*`` fields, ``hvrep.replica.powersgd``,
        docs/powersgd.md); it needs the variables the gradients belong to, so
        it applies where a reduction passes them (``wrap_optimizer``,
        ``hvrep.keras.DistributedOptimizer``, ``all_reduce(...,
        powersgd=state)``). Other tensors travel uncompressed in fp32.
      powersgd_rank: r, the rank a gradient matrix is compressed to
        (min(r, rows, cols)). 1 to 4 is the paper's range for image models.
      powersgd_start_step: reductions before this step (counted per
        compressed reducer, from 0) are exact all-reduces, as PyTorch DDP's
        ``start_powerSGD_iter``: the first steps of training move the weights
        most and compress worst.
      powersgd_error_feedback: each replica adds what compression lost in the
        last step to the next step's gradient (the paper's error feedback;
        without it PowerSGD converges to a worse model).
      powersgd_warm_start: reuse last step's Q as the next power iteration's
        start (one iteration per step then tracks the gradients' top
        subspace); False: a fresh random Q each step.
      powersgd_min_compression_rate: a matrix is compressed only when
        rows*cols > rate * (rows+cols)*r (PyTorch's rule, default 2 as
        PyTorch's); others, vectors and scalars go exact through the fused
        buckets. 0: every matrix is compressed.
      num_groups: 0 to bucket by ``fusion_threshold_bytes``; N > 0 to split
        the tensors into N groups of about equal bytes instead (Horovod's
        ``num_groups``).
      accumulation_steps: micro-batches a ``Replicator.wrap_optimizer``
        optimizer accumulates locally before one all-reduce and update
        (1: every step). Horovod backend only: in-graph strategies cannot put
        collectives inside the conditional update.
      check_first_step: before the first step of each ``run`` function
        executes, compare the collectives every replica traced (kind, dtype,
        shape) and raise on a mismatch instead of hanging in Horovod.
      timeout_s: seconds a collective (any hvrep issues: in ``run``, a
        ``reduce``, Keras' ``fit`` through ``hvrep.keras``) may wait for the
        other ranks before every rank exits with one report naming the ranks
        that did not join, what each was doing, and exit code 75
        (``hvrep.errors.EXIT_HANG``; ranks in different collectives exit 65
        without waiting; ``hvrep.replica.watchdog``; docs/troubleshooting.md, "Exit codes").
        Default 600: a first step's tracing or a chief's checkpoint write
        that others wait on must fit. 0: never (the job can hang). Horovod
        backend with more than one rank only: on the in-graph backends one
        process drives every replica, no rank can be missing, and it is not
        enforced.
      local_transport: how the horovod backend's in-step reductions (the buckets of ``all_reduce``,
        ``wrap_optimizer``, ``hvrep.keras``, PowerSGD, local SGD) reach the other ranks when every rank runs
        on one host. "auto" (default): hvrep's shared-memory all-reduce (``hvrep.replica.shm``: each rank
        copies its bucket into a file every rank maps, sums its share of it, copies the sum out; no
        background thread, no network) where it applies: more than one rank, all on one host, no GPU, not
        elastic, the kernels built; Horovod's collectives otherwise, and for everything else (eager
        ``reduce``, broadcasts, gathers, integer reductions). "horovod": always Horovod. "shm": the
        shared-memory all-reduce or a SetupError saying why it cannot apply. ``HVREP_LOCAL_TRANSPORT``
        (``horovod`` or ``shm``), where set, replaces "auto". See docs/one-host.md.
      local_steps: None (default): synchronous SGD, gradients all-reduced at
        every step. H >= 1: local SGD (Lin et al. 2018): each replica updates
        its own copy of the model with its own gradients, with no collective,
        and every H-th update the replicas' models (trainable weights and the
        model's floating-point non-trainable state: batch-norm statistics) are
        replaced by their mean. H = 1 equals synchronous SGD for optimizers
        linear in the gradient (SGD, heavy-ball and Nesterov momentum), not for
        Adam, LARS or global-norm clipping. The optimizer's own state
        (momentum) stays per replica between synchronisations (averaged only
        before a checkpoint). Through ``Replicator.wrap_optimizer(opt,
        model=model)`` and ``hvrep.keras.DistributedOptimizer(opt, repl,
        model=model)``; see docs/local-sgd.md.
      outer_optimizer: None (default): each synchronisation sets the model to
        the replicas' mean. "nesterov": DiLoCo's outer step (Douillard et al.
        2023): SGD with Nesterov momentum on delta = (model at the round's
        start) - (mean of the replicas' models), i.e. m = outer_momentum * m +
        delta; model = start - outer_lr * (delta + outer_momentum * m). Applies
        to the trainable weights; batch-norm statistics are averaged. Needs
        ``local_steps``. outer_lr=1, outer_momentum=0 is plain averaging.
      outer_lr: the outer step's learning rate (default 0.7, DiLoCo's).
      outer_momentum: the outer step's Nesterov momentum in [0, 1) (default 0.9, DiLoCo's).
    """

    fusion_threshold_bytes: int | None = None
    horovod_fusion_threshold_bytes: int | None = None
    cycle_time_ms: float | None = None
    mpi_yield_when_idle: bool | None = True
    compression: str = "none"
    # PowerSGD (compression="powersgd"); PyTorch's PowerSGDState defaults except the rank and start step.
    powersgd_rank: int = 1
    powersgd_start_step: int = 0  # exact all-reduce before this step
    powersgd_error_feedback: bool = True
    powersgd_warm_start: bool = True
    powersgd_min_compression_rate: float = 2.0  # 0: compress every matrix
    num_groups: int = 0
    accumulation_steps: int = 1
    check_first_step: bool = True
    timeout_s: float = 600.0  # 0: never
    local_transport: str = "auto"  # hvrep's shared-memory all-reduce where every rank is on one host
    # Local SGD (docs/local-sgd.md): its own block, last.
    local_steps: int | None = None  # None: synchronous SGD
    outer_optimizer: str | None = None  # None: plain averaging at each synchronisation
    outer_lr: float = 0.7  # DiLoCo's (Douillard et al. 2023, section 3)
    outer_momentum: float = 0.9  # DiLoCo's

    def __post_init__(self) -> None:
        ft = self.fusion_threshold_bytes
        if ft is not None and (not isinstance(ft, int) or isinstance(ft, bool) or ft < 0):
            raise ConfigError(
                f"fusion_threshold_bytes must be None (the backend's choice) or an int >= 0, got "
                f"{self.fusion_threshold_bytes!r}; 0 sends each tensor on its own."
            )
        hft = self.horovod_fusion_threshold_bytes
        if hft is not None and (not isinstance(hft, int) or hft < 0):
            raise ConfigError(f"horovod_fusion_threshold_bytes must be None or an int >= 0, got {hft!r}.")
        if self.cycle_time_ms is not None and not self.cycle_time_ms > 0:
            raise ConfigError(f"cycle_time_ms must be None or > 0, got {self.cycle_time_ms!r}.")
        y = self.mpi_yield_when_idle
        if y is not None and not isinstance(y, bool):
            raise ConfigError(f"mpi_yield_when_idle must be True, False or None (hvrep sets nothing), got {y!r}.")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}.")
        self._check_powersgd()
        if not isinstance(self.num_groups, int) or self.num_groups < 0:
            raise ConfigError(f"num_groups must be an int >= 0, got {self.num_groups!r}.")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0 or t == float("inf"):
            raise ConfigError(f"timeout_s must be a number of seconds >= 0 (0: never time out), got {t!r}.")
        if 0 < t < 5:
            raise ConfigError(f"timeout_s={t!r} is shorter than the watchdog's heartbeat can judge; use >= 5 s, "
                              "or 0 to never time out.")
        if self.local_transport not in LOCAL_TRANSPORTS:
            raise ConfigError(f"local_transport must be one of {LOCAL_TRANSPORTS}, got {self.local_transport!r}.")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps must be an int >= 1, got {self.accumulation_steps!r}.")
        self._check_local_sgd()

    def _check_local_sgd(self) -> None:
        h = self.local_steps
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h < 1):
            raise ConfigError(f"local_steps must be None (synchronous SGD) or an int >= 1 (average the models every "
                              f"local_steps steps), got {h!r}. Fix: e.g. local_steps=4.")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(f"outer_optimizer must be one of {OUTER_OPTIMIZERS}, got {self.outer_optimizer!r}. "
                              "Fix: None (plain averaging) or \"nesterov\" (DiLoCo's outer step).")
        lr, mu = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf"):
            raise ConfigError(f"outer_lr must be a number > 0, got {lr!r}. Fix: 0.7 (DiLoCo's), or 1.0 with "
                              "outer_momentum=0 for plain averaging.")
        if isinstance(mu, bool) or not isinstance(mu, int | float) or not 0 <= mu < 1:
            raise ConfigError(f"outer_momentum must be a number in [0, 1), got {mu!r}. Fix: 0.9 (DiLoCo's), or 0.")
        if self.outer_optimizer is not None and h is None:
            raise ConfigError(f"outer_optimizer={self.outer_optimizer!r} needs local SGD: local_steps is None "
                              "(synchronous SGD). Fix: set local_steps (e.g. 4), or outer_optimizer=None.")
        if self.outer_optimizer is None and (lr, mu) != (0.7, 0.9):
            raise ConfigError(f"outer_lr={lr!r} and outer_momentum={mu!r} apply only with outer_optimizer="
                              "\"nesterov\"; outer_optimizer is None (plain averaging). Fix: "
                              "outer_optimizer=\"nesterov\", or leave outer_lr and outer_momentum at their defaults.")
        # Combinations of settings (local SGD with accumulation or compression): the support table's rules.
        support.check(support.comm_settings(self), "CommConfig")

    def _check_powersgd(self) -> None:
        r = self.powersgd_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"powersgd_rank must be an int >= 1, got {r!r}. Fix: e.g. powersgd_rank=1 (the "
                              "rank each gradient matrix is compressed to).")
        s = self.powersgd_start_step
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(f"powersgd_start_step must be an int >= 0, got {s!r}. Fix: 0 compresses from the "
                              "first step; k reduces the first k steps exactly.")
        for name in ("powersgd_error_feedback", "powersgd_warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        m = self.powersgd_min_compression_rate
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m < float("inf"):
            raise ConfigError(f"powersgd_min_compression_rate must be a number >= 0, got {m!r}. Fix: 2 (PyTorch's "
                              "default) or 0 to compress every matrix.")



def powersgd_matrix(shape: tuple[int, ...] | list[int], rank: int, min_compression_rate: float
                    ) -> tuple[int, int, int] | None:
    """How PowerSGD sends a gradient of ``shape``: ``(rows, cols, r)`` when compressed, None when exact.

    A tensor of rank >= 2 is the matrix [prod(shape[:-1]), shape[-1]]: a Keras
    kernel keeps its output units last (Dense [in, out], Conv2D [kh, kw, in,
    out]), so this is the matrix PyTorch's ``[shape[0], -1]`` of its [out, in,
    kh, kw] kernels forms, transposed, and compresses alike. r = min(rank,
    rows, cols). Compressed when ``rows*cols > min_compression_rate *
    (rows+cols)*r`` (PyTorch's ``_should_compress``); vectors and scalars never.
    Pure Python: the cost model uses it without TensorFlow.
    """
    if len(shape) < 2:
        return None
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    cols = int(shape[-1])
    r = min(rank, rows, cols)
    if r < 1 or not rows * cols > min_compression_rate * (rows + cols) * r:
        return None
    return rows, cols, r
