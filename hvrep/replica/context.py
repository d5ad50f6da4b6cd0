"""What a replica knows about itself and its step: the input context, the live backend, op checks.

The lowest module of the replica layer: the data pipelines import
:class:`InputContext` from here without pulling in any backend, and the
collectives find the backend whose ``run`` is executing through
:func:`live_backend` (STYLE.md, "Roles ... computed once in one context object").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any

import tensorflow as tf

from hvrep.errors import CollectiveError, ConfigError

OPS = ("sum", "mean", "max", "min")

# The backends whose `run` is executing (innermost last). Collectives act on
# the innermost one. A plain list, not thread-local: MirroredStrategy runs each
# replica's function in a thread of its own. Holds `hvrep.replica.backends.base.Backend`s
# (typed Any: this module sits below the backends).
_ACTIVE: list[Any] = []


def active_backend() -> Any:
    """The backend whose ``run`` is executing, or None outside any replica step."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def activated(backend: Any) -> Iterator[None]:
    """Makes ``backend`` the live one while a replica step runs (``Backend.replica_section``)."""
    _ACTIVE.append(backend)
    try:
        yield
    finally:
        _ACTIVE.pop()


# The backends whose ``scope()`` is open (innermost last): where ``replica_devices`` looks outside ``run``.
_SCOPED: list[Any] = []


@contextlib.contextmanager
def scoped(backend: Any, inner: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """``inner`` (the backend's own scope), with ``backend`` recorded as the one whose scope is open."""
    with inner:
        _SCOPED.append(backend)
        try:
            yield
        finally:
            _SCOPED.pop()


def replica_devices() -> tuple[str, ...]:
    """The devices of the replica running this code: ``devices_per_replica`` names for ``tf.device``.

    Inside ``Replicator.run``: this replica's. Inside ``Replicator.scope()``: this process's first replica's
    (on the horovod backend its only one; in-graph strategies mirror every variable on each replica's first
    device whatever ``tf.device`` asks). Names as ``tf.config.list_logical_devices`` gives them
    ("/device:GPU:0", "/device:CPU:1"); a horovod rank's GPUs are renumbered from 0 in its process.

    Raises:
      hvrep.errors.CollectiveError: outside ``run`` and ``scope()``.
    """
    backend = active_backend() or (_SCOPED[-1] if _SCOPED else None)
    if backend is None:
        raise CollectiveError(
            "hvrep.replica_devices() names the devices of the replica running the code: call it inside "
            "`with repl.scope():` (to build each part of the model on its device) or inside the step you pass to "
            "`repl.run`. Fix: move the call there, or read `ctx.devices` in your input_fn.")
    return backend.replica_devices()


def live_backend() -> Any:
    """The backend of the Replicator whose ``run`` is executing.

    Raises:
      hvrep.errors.CollectiveError: outside a replica step.
    """
    backend = active_backend()
    if backend is None:
        raise CollectiveError(
            "hvrep collectives run inside a replica step only. Fix: call them from the function you pass to "
            "`repl.run(step_fn, args=...)`; outside it, use `repl.reduce(value, op)`."
        )
    return backend


@dataclass(frozen=True)
class InputContext:
    """What ``input_fn`` needs to build one replica's data.

    Attributes:
      replica_id: this replica, in [0, num_replicas).
      num_replicas: replicas in the job.
      per_replica_batch_size: global batch / num_replicas, or None when
        ``distribute_dataset`` was not given a global batch size.
      cuda_device: this replica's GPU as CUDA numbers it among the devices
        ``CUDA_VISIBLE_DEVICES`` leaves visible: what DALI's ``device_id``
        takes. A Horovod rank's is ``local_rank % visible GPUs``. None without
        a GPU, or in a context no Replicator made.
      tf_device: the same GPU as TensorFlow names it: "/gpu:0" for a Horovod
        rank (``bind_gpu`` leaves it its own GPUs only), "/gpu:i*k" for in-graph
        replica i with k devices per replica; None without a GPU.
      devices: every device this replica owns (``Replicator(devices_per_replica=k)``: k
        of them), as ``hvrep.replica_devices()`` names them inside the step; the first
        is where a pipeline's input belongs. Empty in a context no Replicator made.

    The device fields are keyword-only. Only their index rules were tested (no
    GPU was available; see ``hvrep.replica.devices``).
    """

    replica_id: int
    num_replicas: int
    per_replica_batch_size: int | None = None
    _: KW_ONLY
    cuda_device: int | None = None
    tf_device: str | None = None
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.devices, str) or not all(isinstance(d, str) for d in self.devices):
            raise ConfigError(f"devices must be a sequence of device names, got {self.devices!r}. Fix: e.g. "
                              "(\"/device:GPU:0\", \"/device:GPU:1\").")
        object.__setattr__(self, "devices", tuple(self.devices))
        if (self.cuda_device is None) != (self.tf_device is None):
            raise ConfigError(f"cuda_device={self.cuda_device!r} and tf_device={self.tf_device!r} name one GPU. "
                              "Fix: give both, or neither for no GPU.")
        if self.cuda_device is not None and self.cuda_device < 0:
            raise ConfigError(f"cuda_device must be >= 0, got {self.cuda_device}.")

    def shard(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """This replica's 1/num_replicas of ``dataset`` (every element once overall)."""
        return dataset.shard(self.num_replicas, self.replica_id)


def check_op(op: str) -> str:
    """Returns ``op`` if it is a reduction hvrep knows; raises CollectiveError otherwise."""
    if op not in OPS:
        raise CollectiveError(f"op must be one of {OPS}, got {op!r}.")
    return op


def per_replica_batch(global_batch_size: int | None, num_replicas: int) -> int | None:
    """``global_batch_size / num_replicas``, or None; raises CollectiveError when it does not divide."""
    if global_batch_size is None:
        return None
    if global_batch_size <= 0 or global_batch_size % num_replicas:
        raise CollectiveError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"{num_replicas} replicas; use {max(1, round(global_batch_size / num_replicas)) * num_replicas}."
        )
    return global_batch_size // num_replicas
