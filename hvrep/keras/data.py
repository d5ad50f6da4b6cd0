"""Each process's share of ``fit``'s data, every rank with the same number of steps.

These helpers count the batch per replica (``per_replica_batch_size``), as
Horovod scripts do; the global batch is ``per_replica_batch_size x replicas``
(docs/large-batch.md#which-batch-which-learning-rate). Global step k is the k-th
run of ``replicas x per_replica_batch_size`` consecutive samples, the batch a
single process would take with ``per_replica_batch_size x replicas``: horovod
rank r trains on its r-th slice of it. The samples that
cannot fill a last global step are dropped on every rank, so no rank waits in
a collective for a step another rank never takes (what ``InputContext`` and
``hvrep.data``'s plans do for hvrep's own pipelines).

On an in-graph backend one process feeds every replica: it gets every global
batch whole, and Keras splits it over the replicas of ``repl.scope()``'s strategy.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tensorflow as tf

from hvrep.errors import ConfigError


def _per_replica(per_replica_batch_size: Any, batch_size: Any, function: str) -> int:
    """The per-replica batch, from the argument's name or its old one (``batch_size``, with a DeprecationWarning)."""
    if batch_size is not None:
        warnings.warn(f"hvrep.keras.{function}(batch_size=...) is deprecated: it counts the batch per replica; "
                      f"pass per_replica_batch_size={batch_size!r} (the same value).", DeprecationWarning,
                      stacklevel=3)
        if per_replica_batch_size is not None:
            raise ConfigError(f"hvrep.keras.{function}: per_replica_batch_size={per_replica_batch_size!r} and "
                              f"batch_size={batch_size!r} are the same argument. Fix: pass per_replica_batch_size "
                              "only.")
        per_replica_batch_size = batch_size
    b = per_replica_batch_size
    if not isinstance(b, int | np.integer) or isinstance(b, bool) or b < 1:
        raise ConfigError(f"per_replica_batch_size must be an int >= 1, got {b!r}.")
    return int(b)


def process_batch_size(replicator: Any, per_replica_batch_size: int | None = None, *,
                       batch_size: int | None = None) -> int:
    """The batch to pass to ``fit``/``evaluate`` in this process for ``per_replica_batch_size`` per replica: that
    on horovod, ``per_replica_batch_size x replicas`` on an in-graph backend.

    ``batch_size=`` is the argument's old name (deprecated, the same meaning).
    """
    b = _per_replica(per_replica_batch_size, batch_size, "process_batch_size")
    return b * (replicator.num_replicas // replicator.num_processes)


def shard_arrays(arrays: Any, replicator: Any, per_replica_batch_size: int | None = None, *,
                 batch_size: int | None = None) -> Any:
    """This process's rows of ``arrays`` (a NumPy array or a nest of them, same first dimension), in step order.

    Pass the result to ``fit(..., batch_size=process_batch_size(repl, per_replica_batch_size), shuffle=False)``
    (shuffle the arrays beforehand with the same seed on every rank instead). ``batch_size=`` is the old name of
    ``per_replica_batch_size`` (deprecated, the same meaning).

    Returns:
      The same nest; each array holds ``steps x process_batch_size`` rows, ``steps = len // (replicas x
      per_replica_batch_size)`` the same on every rank.
    """
    b = _per_replica(per_replica_batch_size, batch_size, "shard_arrays")
    flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
    lengths = {len(a) for a in flat}
    if len(lengths) != 1:
        raise ConfigError(f"the arrays must have the same number of rows, got {sorted(lengths)}.")
    n, procs = replicator.num_replicas, replicator.num_processes
    steps = lengths.pop() // (n * b)
    if steps == 0:
        raise ConfigError(f"{len(flat[0])} rows cannot fill one global batch of {n} replicas x {b}. Fix: a smaller "
                          "per_replica_batch_size, or more data.")
    per_process = n // procs * b
    rank = replicator.rank
    idx = (np.arange(steps)[:, None] * n * b + rank * per_process + np.arange(per_process)[None, :]).ravel()
    return tf.nest.pack_sequence_as(arrays, [a[idx] for a in flat])


def shard_dataset(dataset: tf.data.Dataset, replicator: Any, per_replica_batch_size: int | None = None, *,
                  batch_size: int | None = None) -> tf.data.Dataset:
    """``dataset`` (unbatched examples, the same order on every rank) batched for this process, in batches of
    ``process_batch_size(replicator, per_replica_batch_size)``.

    Every rank reads the whole stream and keeps its slice of each global batch: simple and exact (the same
    batches as one process), at the cost of reading ``replicas`` times the data. For large data, shard the
    files per rank with ``dataset.shard`` before decoding and make the step counts equal yourself.
    ``batch_size=`` is the old name of ``per_replica_batch_size`` (deprecated, the same meaning).
    """
    b = _per_replica(per_replica_batch_size, batch_size, "shard_dataset")
    n, procs = replicator.num_replicas, replicator.num_processes
    per_process = n // procs * b
    start = replicator.rank * per_process
    batched = dataset.batch(n * b, drop_remainder=True)
    if procs == 1:
        return batched
    return batched.map(lambda *t: tf.nest.map_structure(lambda x: x[start:start + per_process],
                                                        t[0] if len(t) == 1 else t),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
