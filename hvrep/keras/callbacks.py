"""Keras 3 callbacks for ``fit`` on hvrep: what ``horovod.keras.callbacks`` gave Keras 2 users.

    callbacks = [
        hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
        hvrep.keras.callbacks.MetricAverageCallback(repl),       # before any callback that reads the logs
        hvrep.keras.callbacks.LearningRateWarmupCallback(repl, initial_lr=0.01 * repl.num_replicas),
        *hvrep.keras.callbacks.chief_only(repl, keras.callbacks.ModelCheckpoint("ckpt.keras")),
    ]

Collectives here are eager and must be the same calls on every process:
every rank passes the same callbacks in the same order. On in-graph backends
(one process drives every replica) there is nothing to exchange and the
process-level collectives are skipped.

Every callback here also keeps Horovod's collectives out of XLA: when
``fit`` starts (``set_model`` runs before Keras builds its train function) on
the horovod backend it sets ``model.jit_compile = False``, because Horovod's
ops have no XLA kernels on the CPU and Keras' ``jit_compile="auto"`` turns
XLA on wherever a GPU is visible.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import keras
import numpy as np

from hvrep.errors import ConfigError, ReplicaMismatchError
from hvrep.replica import api

_log = logging.getLogger("hvrep")


def _check_replicator(replicator: Any) -> Any:
    if not isinstance(replicator, api.Replicator):
        raise ConfigError(f"replicator must be an hvrep.Replicator, got {type(replicator).__name__}. "
                          "Fix: pass the Replicator the DistributedOptimizer uses.")
    return replicator


def _local_sgd(model: Any) -> Any:
    """The model's optimizer's local SGD (``hvrep.replica.localsgd.LocalSGD``) when it has diverged replicas
    (mid-round), else None."""
    local_sgd = getattr(getattr(model, "optimizer", None), "local_sgd", None)
    return local_sgd if local_sgd is not None and local_sgd.mid_round else None


def keep_collectives_out_of_xla(model: Any, replicator: Any) -> None:
    """On the horovod backend, ``model.jit_compile = False`` (Horovod's ops cannot be XLA-compiled on the CPU).

    In-graph backends keep Keras' choice: their collectives are TensorFlow's own.
    """
    if replicator.backend == "horovod" and getattr(model, "jit_compile", False):
        _log.info("hvrep: jit_compile=False for fit on the horovod backend: Horovod's collectives cannot be "
                  "compiled by XLA. Put XLA on the compute with tf.function(jit_compile=True) inside the model.")
        model.jit_compile = False


class _ReplicaCallback(keras.callbacks.Callback):
    def __init__(self, replicator: Any) -> None:
        super().__init__()
        self.replicator = _check_replicator(replicator)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        keep_collectives_out_of_xla(model, self.replicator)

    @property
    def _across_processes(self) -> bool:
        return self.replicator.num_processes > 1


class BroadcastGlobalVariablesCallback(_ReplicaCallback):
    """Before the first step, every variable of the model and its optimizer takes ``root_rank``'s value.

    Unlike Horovod's (which broadcast after the first batch), this runs in
    ``on_train_begin``: Keras 3 has built the optimizer by then, so even the
    first step starts from identical weights, and fit with N ranks x B equals
    fit with one process x NB also for models each rank built from its own seed.

    With local SGD (``DistributedOptimizer(opt, repl, model=model)`` and ``CommConfig.local_steps``), ``fit``
    also ends on the replicas' mean model: when its last step is not a synchronisation (a step count that is
    not a multiple of H), ``on_train_end`` averages the models there, plainly (as a checkpoint does; no outer
    step, the optimizer's state stays each replica's own). Local SGD's output is the averaged model (Lin et
    al. 2018, Algorithm 1; Stich 2018 bounds the averaged iterate), and without this each rank's
    ``evaluate``, ``predict`` or ``save`` after ``fit`` would use a different model.
    """

    def __init__(self, replicator: Any, root_rank: int = 0) -> None:
        super().__init__(replicator)
        if not isinstance(root_rank, int) or not 0 <= root_rank < replicator.num_processes:
            raise ConfigError(f"root_rank must be a process rank in [0, {replicator.num_processes}), got "
                              f"{root_rank!r}.")
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.broadcast_done or not self._across_processes:
            return
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables) + (list(optimizer.variables) if optimizer is not None else [])
        self.replicator.broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_end(self, logs: dict | None = None) -> None:
        local_sgd = _local_sgd(self.model)
        if local_sgd is not None:  # every replica counted the same steps: all take this branch together
            self.replicator.run(local_sgd.average_now)  # the model, plainly


def _numeric(logs: dict) -> list[str]:
    return sorted(k for k, v in logs.items() if isinstance(v, int | float | np.number | np.ndarray)
                  or hasattr(v, "numpy"))


class MetricAverageCallback(_ReplicaCallback):
    """Every process reports the same metrics.

    - ``on_epoch_end``: each numeric epoch log is replaced by its mean over the
      processes (Horovod's semantics; the global value when every rank runs the
      same number of equal batches, as ``hvrep.keras.shard_*`` arrange).
    - ``evaluate`` (and ``fit``'s validation): the metrics' states (totals,
      counts) are summed over the processes after every test batch, so
      ``evaluate`` returns the metrics of all ranks' data together (pass the
      callback to ``evaluate`` too). Right for every metric whose state is sums
      and counts starting at zero (Mean, the accuracies, Precision/Recall, AUC,
      MeanIoU ...); every rank must run the same number of test batches.
    - With local SGD, an evaluation between two synchronisations (``fit``'s validation at an epoch end that is
      not a multiple of H) evaluates the replicas' mean model, in a copy: ``on_test_begin`` averages the models
      (each replica's own weights kept), ``on_test_end`` puts each replica's own weights back, so training goes
      on as if nothing had been evaluated (``hvrep.replica.localsgd.LocalSGD.averaged_model``).

    Put it before callbacks that read the logs (ModelCheckpoint, EarlyStopping).
    """

    def __init__(self, replicator: Any) -> None:
        super().__init__(replicator)
        self._synced: np.ndarray | None = None
        self._mean_model = contextlib.ExitStack()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self._across_processes or not logs:
            return
        keys = _numeric(logs)
        values = np.array([float(np.asarray(logs[k])) for k in keys], np.float64)
        mean = self.replicator.reduce(values, "mean")
        for k, v in zip(keys, mean.tolist(), strict=True):
            logs[k] = v

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._synced = None
        local_sgd = _local_sgd(self.model)
        if local_sgd is not None:
            self._mean_model.enter_context(local_sgd.averaged_model(self.replicator.run))

    def on_test_end(self, logs: dict | None = None) -> None:
        self._mean_model.close()  # each replica's own weights back (nothing to do without local SGD)

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # After every test batch (Keras reads the metrics once the loop ends, and a callback cannot tell which
        # batch is the last: in fit's validation `params` describe training), each process adds what its own
        # batch added to the state to the sum of everyone's: one all-reduce of the increments per batch.
        if not self._across_processes:
            return
        states = self._states()
        now = self._read(states)
        before = self._synced if self._synced is not None and len(self._synced) == len(now) else np.zeros_like(now)
        total = before + self.replicator.reduce(now - before, "sum")
        offset = 0
        for v in states:
            size = int(np.prod(v.shape))
            v.assign(total[offset:offset + size].reshape(v.shape).astype(v.dtype))
            offset += size
        self._synced = self._read(states)  # as the variables hold it (rounded to their dtype)

    def _states(self) -> list[Any]:
        seen: set[int] = set()
        states = []
        for metric in self.model.metrics:
            for v in metric.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    states.append(v)
        return states

    @staticmethod
    def _read(states: list[Any]) -> np.ndarray:
        if not states:
            return np.zeros([0], np.float64)
        return np.concatenate([np.asarray(keras.ops.convert_to_numpy(v), np.float64).ravel() for v in states])


class LearningRateWarmupCallback(_ReplicaCallback):
    """Horovod's gradual warmup (Goyal et al., 2017): the learning rate grows from ``initial_lr / size`` to
    ``initial_lr`` over ``warmup_epochs`` epochs, adjusted every batch.

    The same schedule as ``horovod.keras.callbacks.LearningRateWarmupCallback``: at batch b of epoch e,
    ``lr = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`` with ``epoch = e + (b + 1) /
    steps_per_epoch``, ``size`` the number of replicas.

    Args:
      initial_lr: the learning rate after warmup (Horovod: the single-worker rate times the size). None: the
        optimizer's when training starts.
      warmup_epochs: epochs of warmup.
      momentum_correction: while the rate changes, scale the momentum by new_lr / old_lr for that batch. Applies
        when the optimizer's momentum is a variable; Keras 3's SGD holds a Python float that is compiled into
        the train step, so there it has no effect (the learning rates are Horovod's either way).
      steps_per_epoch: None: Keras' ``params["steps"]``.
      verbose: 1 prints when the warmup ends (chief only).
    """

    def __init__(self, replicator: Any, initial_lr: float | None, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__(replicator)
        if not warmup_epochs > 0:
            raise ConfigError(f"warmup_epochs must be > 0, got {warmup_epochs!r}.")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ConfigError(f"steps_per_epoch must be None or an int >= 1, got {steps_per_epoch!r}.")
        self.initial_lr = initial_lr
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._restore_momentum: Any = None

    def multiplier(self, epoch: float) -> float:
        """The factor on ``initial_lr`` at (fractional) ``epoch``, Horovod's formula."""
        size = self.replicator.num_replicas
        epoch += 1.0 / self.steps_per_epoch
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _optimizer(self) -> Any:
        return self.model.optimizer

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = float(keras.ops.convert_to_numpy(self._optimizer().learning_rate))
        if self.steps_per_epoch is None:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigError("LearningRateWarmupCallback cannot tell the steps per epoch (fit's data has no "
                                  "length). Fix: pass steps_per_epoch= to the callback (or to fit).")
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch >= self.warmup_epochs:
            return
        opt = self._optimizer()
        old_lr = float(keras.ops.convert_to_numpy(opt.learning_rate))
        new_lr = self.initial_lr * self.multiplier(self.current_epoch + float(batch) / self.steps_per_epoch)
        opt.learning_rate = new_lr
        momentum = getattr(getattr(opt, "inner_optimizer", opt), "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr > 0:
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restore_momentum is not None:
            momentum = getattr(self._optimizer(), "inner_optimizer", self._optimizer()).momentum
            momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        lr = float(keras.ops.convert_to_numpy(self._optimizer().learning_rate))
        if logs is not None:
            logs["lr"] = lr
        if epoch == int(np.ceil(self.warmup_epochs)) - 1 and self.verbose > 0 and self.replicator.is_chief:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` for several processes: every rank reads the backup, only the chief
    writes it, and the ranks must agree on the epoch they resume from.

    ``backup_dir`` must be the same shared folder on every rank. Other arguments as Keras'.

    Raises (in ``fit``):
      hvrep.errors.ReplicaMismatchError: ranks restored different epochs (a backup folder that is not shared).
    """

    def __init__(self, replicator: Any, backup_dir: str, **kwargs: Any) -> None:
        super().__init__(backup_dir, **kwargs)
        self.replicator = _check_replicator(replicator)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        keep_collectives_out_of_xla(model, self.replicator)

    def on_train_begin(self, logs: dict | None = None) -> None:
        repl = self.replicator
        if repl.is_chief:
            super().on_train_begin(logs)  # may repair the backup from its .bkp copy: a write
        repl.reduce(np.zeros([1], np.int32), "sum")  # the others read once the chief has finished with it
        if not repl.is_chief:
            self._load_model()
        epoch = int(getattr(self.model, "_initial_epoch", None) or 0)
        low, high = (int(x) for x in (repl.reduce(np.array([epoch]), "min")[0], repl.reduce(np.array([epoch]),
                                                                                             "max")[0]))
        if low != high:
            raise ReplicaMismatchError(
                f"ranks restored different epochs from {self.backup_dir!r} (from {low} to {high}; this rank: "
                f"{epoch}): the folder is not the same on every rank. Fix: give BackupAndRestore a backup_dir on a "
                "file system every rank shares."
            )

    def _save_model(self) -> None:
        if self.replicator.is_chief:
            super()._save_model()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.replicator.is_chief:
            super().on_train_end(logs)


def chief_only(replicator: Any, *callbacks: Any) -> list[Any]:
    """``list(callbacks)`` on the chief, ``[]`` elsewhere: for callbacks that only write (ModelCheckpoint,
    TensorBoard, CSVLogger), so one process writes each file.

    Only for callbacks without collectives: every hvrep callback must run on every rank.
    """
    _check_replicator(replicator)
    for cb in callbacks:
        if isinstance(cb, _ReplicaCallback | BackupAndRestore):
            raise ConfigError(f"{type(cb).__name__} runs collectives and must run on every rank; pass it to fit "
                              "directly, not through chief_only.")
    return list(callbacks) if replicator.is_chief else []


# --- elastic training (hvrep.elastic): Horovod's elastic Keras callbacks, on Keras 3 -----------------------------


def _check_state(state: Any) -> Any:
    from hvrep.replica.elastic import State

    if not isinstance(state, State):
        raise ConfigError(f"state must be an hvrep.elastic.State, got {type(state).__name__}. Fix: "
                          "state = hvrep.elastic.State(repl, model, optimizer, epoch=0, batch=0).")
    return state


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at each epoch's end (``hvrep.elastic``).

    A commit copies the model's and optimizer's variables into memory (what a lost worker rolls back to) and
    checks for host updates; fewer commits cost less per batch and lose more on a failure.

    Raises:
      hvrep.errors.ConfigError: ``state`` is not an ``hvrep.elastic.State``, or ``batches_per_commit`` < 1.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = _check_state(state)
        if int(batches_per_commit) < 1:
            raise ConfigError(f"batches_per_commit must be >= 1, got {batches_per_commit!r}.")
        self.batches_per_commit = int(batches_per_commit)
        self._left = self.batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._left = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()
        self._left = self.batches_per_commit


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the batches of the current epoch trained, counting from where the epoch (re)started
    at ``state.batch``; 0 again at each epoch's end. Put it before :class:`CommitStateCallback`, so a commit
    records the batch it follows."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = _check_state(state)
        self._start = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = int(getattr(self.state, "batch", 0))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = self._start + batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
        self._start = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the epochs finished: the value ``fit`` started from plus the epochs it ran, whether
    ``fit`` was called with ``initial_epoch=state.epoch`` or with ``epochs=total - state.epoch``. Put it before
    :class:`CommitStateCallback`."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = _check_state(state)
        self._base = 0
        self._first: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._base, self._first = int(self.state.epoch), None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self._base + (epoch - (self._first or 0)) + 1
