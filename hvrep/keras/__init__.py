"""Keras 3 ``model.fit`` on hvrep: what ``horovod.keras`` was, for Keras 3.

    repl = hvrep.Replicator()
    model.compile(optimizer=hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.01 * repl.num_replicas), repl),
                  loss=..., metrics=[...])
    model.fit(*hvrep.keras.shard_arrays((x, y), repl, per_replica_batch_size=32),
              batch_size=hvrep.keras.process_batch_size(repl, per_replica_batch_size=32),
              callbacks=[hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
                         hvrep.keras.callbacks.MetricAverageCallback(repl)])

``predict`` is Keras' own: each process predicts the rows it is given, in
order (this rank's shard); gather them with ``repl.all_gather``-free NumPy
(e.g. each rank saves its part) or predict on the chief only.
This module only re-exports.
"""

from hvrep.keras import callbacks
from hvrep.keras.data import process_batch_size, shard_arrays, shard_dataset
from hvrep.keras.optimizer import DistributedLossScaleOptimizer, DistributedOptimizer

__all__ = [
    "DistributedLossScaleOptimizer",
    "DistributedOptimizer",
    "callbacks",
    "process_batch_size",
    "shard_arrays",
    "shard_dataset",
]
