"""The interface every backend implements, and what they share."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from hvrep.errors import CollectiveError
from hvrep.replica.comm import CommConfig

OPS = ("sum", "mean", "max", "min")

# The backends whose `run` is executing (innermost last). Collectives act on
# the innermost one. A plain list, not thread-local: MirroredStrategy runs each
# replica's function in a thread of its own.
_ACTIVE: list[Backend] = []


def active_backend() -> Backend | None:
    """The backend whose ``run`` is executing, or None outside any replica step."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass(frozen=True)
class InputContext:
    """What ``input_fn`` needs to build one replica's data.

    Attributes:
      replica_id: this replica, in [0, num_replicas).
      num_replicas: replicas in the job.
      per_replica_batch_size: global batch / num_replicas, or None when
        ``distribute_dataset`` was not given a global batch size.
    """

    replica_id: int
    num_replicas: int
    per_replica_batch_size: int | None = None

    def shard(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """This replica's 1/num_replicas of ``dataset`` (every element once overall)."""
        return dataset.shard(self.num_replicas, self.replica_id)


def check_op(op: str) -> str:
    if op not in OPS:
        raise CollectiveError(f"op must be one of {OPS}, got {op!r}.")
    return op


def per_replica_batch(global_batch_size: int | None, num_replicas: int) -> int | None:
    if global_batch_size is None:
        return None
    if global_batch_size <= 0 or global_batch_size % num_replicas:
        raise CollectiveError(
            f"global_batch_size={global_batch_size} must be a positive multiple of the "
            f"{num_replicas} replicas; use {max(1, round(global_batch_size / num_replicas)) * num_replicas}."
        )
    return global_batch_size // num_replicas


class Backend(abc.ABC):
    """One way to run replicas. Chosen once, at start-up, by the registry."""

    name: str = ""

    def __init__(self, config: CommConfig) -> None:
        self.config = config
        # Collectives issued, for tests and reports (counted when traced).
        self.collective_calls = 0
        # Not thread-local: MirroredStrategy runs each replica's fn in its own thread.
        self._run_depth = 0

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process."""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int: ...

    @property
    @abc.abstractmethod
    def is_chief(self) -> bool: ...

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Variables created inside start identical on every replica."""

    @abc.abstractmethod
    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None) -> Any: ...

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...

    @abc.abstractmethod
    def reduce(self, value: Any, op: str) -> Any: ...

    # In-replica collectives, on flat lists (the public functions handle nests).
    @abc.abstractmethod
    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str) -> list[tf.Tensor]: ...

    @abc.abstractmethod
    def all_gather(self, x: tf.Tensor, axis: int) -> tf.Tensor: ...

    @abc.abstractmethod
    def broadcast(self, x: tf.Tensor, root: int) -> tf.Tensor: ...

    @abc.abstractmethod
    def replica_id(self) -> tf.Tensor | int: ...

    # Whether the caller is inside `run` (collectives are only legal there).
    @property
    def in_replica(self) -> bool:
        return self._run_depth > 0

    @contextlib.contextmanager
    def replica_section(self) -> Iterator[None]:
        self._run_depth += 1
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self._run_depth -= 1
