"""Elastic training: workers leave and join a running job, which rolls back to its last commit on a failure.

    repl = hvrep.Replicator()                    # horovod under horovodrun's elastic driver, even at size 1
    model, optimizer = ...
    state = hvrep.elastic.State(repl, model, optimizer, epoch=0, step=0)

    @hvrep.elastic.run
    def train(state):
        for batch in ...:                        # rebuilt on every call: the world may have changed
            repl.run(step_fn, args=(batch,))
            state.step += 1
            if state.step % 100 == 0:
                state.commit()                   # copy in memory, then check for host updates

    train(state)

launched by ``horovodrun --gloo -np 2 --min-np 1 --max-np 4 --host-discovery-script S python train.py``.

Horovod's elastic driver (``horovod.runner.elastic``) starts, watches and re-forms the workers; its notification
service tells each worker that the discovery script added or removed hosts. This module reuses both. What it
does not reuse: ``horovod.tensorflow.elastic``'s state classes, which call Keras 2 APIs (``optimizer.variables()``,
``var.ref()``; horovod#4290), and its ``run``, which returns None for any error that is not Horovod's own: here
every other error propagates.

Horovod's order on a reset, kept here: ``restore()`` (a failure only: back to the last commit), the world
re-formed (``hvd.shutdown()``, ``hvd.init()`` through the driver's rendezvous), the reset callbacks, then
``sync()`` as the function is called again: rank 0's variables and rank 0's *last committed* plain values go
to every worker, a joining one included.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hvrep import _env
from hvrep.errors import ConfigError
from hvrep.replica import support

_log = logging.getLogger("hvrep")

# What a collective's failure says when a peer is gone: the op that failed (a traced step names its node, e.g.
# "HorovodAllreduce_x_0"), or Horovod's shut-down message once its background loop has died.
_HOROVOD_FAILURE_MARKS = ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast", "HorovodAlltoall",
                          "HorovodReducescatter", "HorovodBarrier", "HorovodJoin", "Horovod has been shut down")

FAILURE = "failure"
"""``Reset.why`` when a worker was lost: the state was rolled back to the last commit."""
HOSTS_ADDED = "hosts added"
"""``Reset.why`` when the discovery script added hosts: the world grew at a commit, nothing rolled back."""
HOSTS_REMOVED = "hosts removed"
"""``Reset.why`` when the discovery script dropped hosts: the world shrank at a commit, nothing rolled back."""


def lost_worker(error: BaseException) -> bool:
    """Whether ``error`` is Horovod's own: a collective that failed because a worker is gone.

    Horovod raises ``HorovodInternalError`` from its Python functions, and TensorFlow an ``OpError`` naming the
    Horovod op for a collective that failed inside a compiled step.
    """
    from horovod.common.exceptions import HorovodInternalError

    if isinstance(error, HorovodInternalError):
        return True
    return isinstance(error, tf.errors.OpError) and any(m in str(error) for m in _HOROVOD_FAILURE_MARKS)


@dataclasses.dataclass(frozen=True)
class Reset:
    """One reset of an elastic job, as this worker saw it.

    Attributes:
      why: ``"failure"`` (a worker was lost: rolled back to the last commit), ``"hosts added"`` or
        ``"hosts removed"`` (the discovery script changed the hosts: no rollback).
      old_size, new_size: world sizes before and after.
      rolled_back: for each plain numeric value of the state, how far the rollback moved it back (``step``:
        steps lost); empty when nothing was rolled back.
      work_lost_s: seconds of training since the last commit, thrown away (0 without a rollback).
      reform_s: seconds from the interruption to the new world (shut down, rendezvous, restart).
    """

    why: str
    old_size: int
    new_size: int
    rolled_back: dict[str, float]
    work_lost_s: float
    reform_s: float

    @property
    def seconds_lost(self) -> float:
        """Training time the reset cost: the work thrown away plus the time to re-form."""
        return self.work_lost_s + self.reform_s


class State:
    """What an elastic job keeps in memory and rolls back: a Keras 3 model's and optimizer's variables, and
    plain values (``epoch``, ``step``, …) as attributes.

    Every variable a step carries to the next is tracked: the model's, the optimizer's (slots, ``iterations``, a
    ``LossScaleOptimizer``'s loss scale and its growth counter) and, with hvrep's wrappers
    (``Replicator.wrap_optimizer``, ``hvrep.keras.DistributedOptimizer``), the accumulated gradients and
    micro-step (``CommConfig.accumulation_steps``) and PowerSGD's error feedback, Q's and step counter. A
    rollback puts all of them back to the commit, on every worker alike.

    Args:
      repl: the Replicator (its backend broadcasts in :meth:`sync`).
      model: a built Keras model (its ``variables``: weights and statistics), or None.
      optimizer: its Keras optimizer (hvrep's wrappers too), or None. Built here on the model's trainable
        variables if it is not yet (a wrapper's accumulators and PowerSGD state too), so that a worker that
        joins later holds the same variables as rank 0.
      **scalars: plain values, each an attribute (``state.step``); picklable.

    Raises:
      hvrep.errors.ConfigError: a model with no variables yet (build it first), or a scalar named like one of
        the state's own attributes; a combination the support table refuses (local SGD; under the elastic
        driver, a backend other than horovod).
    """

    def __init__(self, repl: Any, model: Any = None, optimizer: Any = None, **scalars: Any) -> None:
        self._repl = repl
        self._model, self._optimizer = model, optimizer
        _check_supported(repl)
        if model is not None and not list(model.variables):
            raise ConfigError(f"hvrep.elastic.State: the model {getattr(model, 'name', model)!r} has no variables "
                              "yet. Fix: build it before making the state (call it on a batch, or model.build(shape)).")
        # Beside the table's check (which reads repl.config): an optimizer wrapped by another Replicator, one with
        # local_steps, is refused here only.
        local_sgd = getattr(optimizer, "local_sgd", None)
        if local_sgd is not None:
            raise ConfigError(f"hvrep.elastic.State: the optimizer runs local SGD (CommConfig.local_steps="
                              f"{local_sgd.every}), which elastic training cannot roll back: a commit would "
                              "hold only one rank's diverged model. Fix: local_steps=None in an elastic job, or a "
                              "non-elastic launch.")
        if optimizer is not None and not _built(optimizer):
            if model is None:
                raise ConfigError("hvrep.elastic.State: the optimizer is not built and no model was given to "
                                  "build it on. Fix: pass the model too, or optimizer.build(variables) first.")
            optimizer.build(model.trainable_variables)
        clash = sorted(n for n in scalars if n.startswith("_") or hasattr(type(self), n))
        if clash:
            raise ConfigError(f"hvrep.elastic.State: value name(s) {clash} clash with the state's own attributes "
                              "or start with '_'. Fix: rename them.")
        self._variables = _tracked(model, optimizer)
        self._names = tuple(scalars)
        self._saved: dict[str, Any] = copy.deepcopy(scalars)
        self._saved_variables: list[Any] = []
        self._snapshot: Any = None
        self._set_attrs()
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self.resets: list[Reset] = []
        self._save_variables()
        self._committed_at = time.monotonic()

    @property
    def variables(self) -> list[Any]:
        """The variables tracked (the model's, then the optimizer's), in the same order on every worker."""
        return list(self._variables)

    # --- Horovod's State interface -------------------------------------------------------------

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Adds functions called after every reset, after the new world formed and before ``sync``: e.g. to
        scale a learning rate with the new world size (``repl.num_replicas``)."""
        self._reset_callbacks.extend(callbacks)

    def commit(self) -> None:
        """Copies the tracked variables and values into memory (what a failure rolls back to), then
        :meth:`check_host_updates`. A collective on every worker: call it at the same step on each.

        Raises:
          horovod.common.exceptions.HostsUpdatedInterrupt: the discovery script added or removed hosts (caught
            by :func:`run`, which re-forms the world).
        """
        self.save()
        self.check_host_updates()

    def save(self) -> None:
        """Copies the state into memory, without checking for host updates. A collective on every worker when
        the optimizer holds per-replica state (see :meth:`_agree`)."""
        self._agree()
        self._save_variables()
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}
        self._committed_at = time.monotonic()

    def restore(self) -> None:
        """Puts back the last commit: variables and values."""
        for v, value in zip(self._variables, self._saved_variables, strict=True):
            v.assign(value)
        self._set_attrs()

    def sync(self) -> None:
        """Makes every worker hold rank 0's state: its variables as they are now, and its last committed
        values, which are set as this worker's attributes (so values changed since the last commit are
        dropped). Then that is this worker's commit. A collective on every worker."""
        if self._variables:
            self._repl.broadcast_variables(self._variables, root_rank=0)
        self._saved = self._repl.broadcast_object(self._saved, 0)
        self._set_attrs()
        self._save_variables()
        self._committed_at = time.monotonic()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` on every worker alike when the driver said hosts were added or
        removed since the last check (rank 0's news decides, broadcast: one small collective)."""
        from horovod.common.exceptions import HostsUpdatedInterrupt
        from horovod.runner.elastic.worker import HostUpdateResult

        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last, update = timestamp, update | result
        if self._repl.num_processes > 1 or _env.horovod_elastic():
            prev, last, update = self._repl.broadcast_object((prev, last, update), 0)
        self._last_updated_timestamp = last
        if last > prev:
            # Only removed: nothing new to sync (Horovod's skip_sync).
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        """Horovod's notification service calls this (another thread) when the discovery script changed hosts."""
        self._host_messages.put((timestamp, update_res))

    def on_reset(self) -> None:
        """After the world re-formed: drops stale host news and the model's compiled Keras functions (``fit``'s
        train step traced the old world's collectives: a mean's 1/N), then calls the registered callbacks."""
        self._host_messages = queue.Queue()
        for attr in ("train_function", "test_function", "predict_function"):
            if self._model is not None and getattr(self._model, attr, None) is not None:
                setattr(self._model, attr, None)
        for callback in self._reset_callbacks:
            callback()

    # --- internals -------------------------------------------------------------------------------

    def _agree(self) -> None:
        # Each replica's accumulated gradients (mid-update) and PowerSGD error feedback are its own, but sync
        # hands every worker rank 0's copy (and a world of another size has other replicas). Their mean over the
        # replicas is what the next update reduces, so every replica takes it before the copy: the commit is
        # then valid on every worker and at any world size, and the run goes on as it would have, to float
        # rounding (as Runner.prepare_checkpoint does for a checkpoint).
        if self._repl.num_replicas < 2 or self._optimizer is None:
            return
        accumulation = getattr(self._optimizer, "accumulation", None)
        if accumulation is not None and int(accumulation.micro_step.numpy()) % self._optimizer.accumulation_steps:
            self._repl.run(self._optimizer.average_accumulators)
        powersgd = getattr(self._optimizer, "powersgd", None)
        if powersgd is not None and powersgd.errors:
            self._repl.run(powersgd.average_errors)

    def _set_attrs(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def _save_variables(self) -> None:
        # One compiled call reads every variable (a ResNet's ~200 eager reads took 12 ms, 1% of a demo step at
        # commit_every_steps=20: benchmarks/elastic.py). The tensors it returns are the copies: TensorFlow copies
        # a variable's buffer on write while a tensor still holds it, so a later assign leaves them as they were.
        if not self._variables:
            self._saved_variables = []
            return
        if self._snapshot is None:
            plain = [v if isinstance(v, tf.Variable) or not hasattr(v, "value") else v.value for v in self._variables]
            self._snapshot = tf.function(lambda: [tf.identity(v) for v in plain])
        self._saved_variables = list(self._snapshot())

    def _rollback_distance(self) -> dict[str, float]:
        out = {}
        for name in self._names:
            now, then = getattr(self, name), self._saved.get(name)
            if isinstance(now, int | float | np.number) and isinstance(then, int | float | np.number) \
                    and not isinstance(now, bool) and now != then:
                out[name] = float(now - then)
        return out


def _built(optimizer: Any) -> bool:
    # hvrep.replica.wrap.CrossReplicaOptimizer's `built` covers its accumulators and PowerSGD state too.
    return bool(getattr(optimizer, "built", True))


def _carried(optimizer: Any) -> list[Any]:
    """What hvrep's optimizer wrappers carry from step to step besides the optimizer's own variables (each a
    ``tf.Module``): the accumulation state and PowerSGD's (``CrossReplicaOptimizer``; ``DistributedOptimizer``
    has PowerSGD's only)."""
    return [m for m in (getattr(optimizer, "accumulation", None), getattr(optimizer, "powersgd", None))
            if m is not None]


def _tracked(model: Any, optimizer: Any) -> list[Any]:
    """The model's variables, the optimizer's, then its wrapper's carried state, each once (Keras 3 lists:
    ``variables`` is a property; a ``tf.Module`` lists its variables in a fixed order)."""
    found: list[Any] = []
    seen: set[int] = set()
    for owner in (model, optimizer, *_carried(optimizer)):
        if owner is None:
            continue
        variables = owner.variables
        for v in variables() if callable(variables) else variables:
            key = id(getattr(v, "value", v)) if not isinstance(v, tf.Variable) else id(v)
            if key not in seen:
                seen.add(key)
                found.append(v)
    return found


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Runs ``func(state, ...)`` through workers leaving and joining, as ``horovod.tensorflow.elastic.run`` does.

    On a lost worker (Horovod's internal error: a collective failed) the state is restored to its last commit;
    on a host update (raised by ``state.commit()``) it is not. Either way the world is re-formed through
    Horovod's elastic driver, the state's reset callbacks run, the state is synced from rank 0 and ``func`` is
    called again. ``state.resets`` records each reset. Any other error propagates at once (Horovod's own
    TensorFlow wrapper returned None for those).

    ``func`` must not run collectives before it reaches its first one on every worker alike: a worker that
    joins calls it right after its sync. Build the dataset inside ``func`` from the state (see
    ``Replicator.distribute_dataset``: its context has the new world).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        from horovod.common.elastic import notification_manager
        from horovod.common.exceptions import HostsUpdatedInterrupt

        if not isinstance(state, State):
            raise ConfigError(f"hvrep.elastic.run: the first argument must be an hvrep.elastic.State, got "
                              f"{type(state).__name__}.")
        if _env.horovod_elastic():
            notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as e:
                    why = HOSTS_REMOVED if e.skip_sync else HOSTS_ADDED
                    skip_sync, rolled, lost = e.skip_sync, {}, 0.0
                except Exception as e:
                    if not lost_worker(e):
                        raise
                    why, skip_sync = FAILURE, False
                    rolled, lost = state._rollback_distance(), time.monotonic() - state._committed_at
                    _log.warning("hvrep: a worker was lost (%s); rolling back to the last commit",
                                 str(e).strip().splitlines()[0][:200])
                    state.restore()
                t0, old = time.monotonic(), state._repl.num_processes
                _reform(state._repl)
                state.resets.append(Reset(why, old, state._repl.num_processes, rolled, round(lost, 3),
                                          round(time.monotonic() - t0, 3)))
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper


def _check_supported(repl: Any) -> None:
    """The support table's refusals for an elastic run of ``repl`` (hvrep.replica.support). The backend is
    checked under horovodrun's elastic driver only: outside it no worker can be lost, and a State is an in-memory
    commit and rollback on any backend."""
    settings = [support.Setting("loop", ("elastic-custom", "elastic-fit"), "hvrep.elastic"),
                *support.comm_settings(repl.config)]
    if _env.horovod_elastic():
        settings.append(support.backend_setting(repl.backend, getattr(repl._backend, "controller", None)))
    support.check(settings, "hvrep.elastic.State")


def _reform(repl: Any) -> None:
    if repl.backend != "horovod":
        raise ConfigError(f"hvrep.elastic: a worker was lost or hosts changed, but the Replicator's backend is "
                          f"{repl.backend!r}: only 'horovod' re-forms its world. Fix: launch with horovodrun "
                          "--min-np/--max-np --host-discovery-script (backend 'auto' then picks horovod).")
    from hvrep.replica.backends.horovod import reform_world

    reform_world()
