"""Each process's share of ``fit``'s data, every rank with the same number of steps.

Global step k is the k-th run of ``replicas x batch_size`` consecutive
samples, the batch a single process would take with ``batch_size x
replicas``: horovod rank r trains on its r-th slice of it. The samples that
cannot fill a last global step are dropped on every rank, so no rank waits in
a collective for a step another rank never takes (what ``InputContext`` and
``hvrep.data``'s plans do for hvrep's own pipelines).

On an in-graph backend one process feeds every replica: it gets every global
batch whole, and Keras splits it over the replicas of ``repl.scope()``'s strategy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from hvrep.errors import ConfigError


def _check_batch(batch_size: Any) -> int:
    if not isinstance(batch_size, int | np.integer) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigError(f"batch_size (per replica) must be an int >= 1, got {batch_size!r}.")
    return int(batch_size)


def process_batch_size(replicator: Any, batch_size: int) -> int:
    """The batch to pass to ``fit``/``evaluate`` in this process for ``batch_size`` per replica: ``batch_size``
    on horovod, ``batch_size x replicas`` on an in-graph backend."""
    return _check_batch(batch_size) * (replicator.num_replicas // replicator.num_processes)


def shard_arrays(arrays: Any, replicator: Any, batch_size: int) -> Any:
    """This process's rows of ``arrays`` (a NumPy array or a nest of them, same first dimension), in step order.

    Pass the result to ``fit(..., batch_size=process_batch_size(repl, batch_size), shuffle=False)`` (shuffle the
    arrays beforehand with the same seed on every rank instead).

    Returns:
      The same nest; each array holds ``steps x process_batch_size`` rows, ``steps = len // (replicas x
      batch_size)`` the same on every rank.
    """
    b = _check_batch(batch_size)
    flat = [np.asarray(a) for a in tf.nest.flatten(arrays)]
    lengths = {len(a) for a in flat}
    if len(lengths) != 1:
        raise ConfigError(f"the arrays must have the same number of rows, got {sorted(lengths)}.")
    n, procs = replicator.num_replicas, replicator.num_processes
    steps = lengths.pop() // (n * b)
    if steps == 0:
        raise ConfigError(f"{len(flat[0])} rows cannot fill one global batch of {n} replicas x {b}. Fix: a smaller "
                          "batch_size, or more data.")
    per_process = n // procs * b
    rank = replicator.rank
    idx = (np.arange(steps)[:, None] * n * b + rank * per_process + np.arange(per_process)[None, :]).ravel()
    return tf.nest.pack_sequence_as(arrays, [a[idx] for a in flat])


def shard_dataset(dataset: tf.data.Dataset, replicator: Any, batch_size: int) -> tf.data.Dataset:
    """``dataset`` (unbatched examples, the same order on every rank) batched for this process.

    Every rank reads the whole stream and keeps its slice of each global batch: simple and exact (the same
    batches as one process), at the cost of reading ``replicas`` times the data. For large data, shard the
    files per rank with ``dataset.shard`` before decoding and make the step counts equal yourself.
    """
    b = _check_batch(batch_size)
    n, procs = replicator.num_replicas, replicator.num_processes
    per_process = n // procs * b
    start = replicator.rank * per_process
    batched = dataset.batch(n * b, drop_remainder=True)
    if procs == 1:
        return batched
    return batched.map(lambda *t: tf.nest.map_structure(lambda x: x[start:start + per_process],
                                                        t[0] if len(t) == 1 else t),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
