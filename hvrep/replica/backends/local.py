"""Replicas on this machine's devices, in one process (tf.distribute.MirroredStrategy).

Uses every GPU when there are GPUs, else every logical CPU device (tests make
two with ``tf.config.set_logical_device_configuration``), so the in-graph code
path that TPUs also take runs here with more than one replica. With
``devices_per_replica`` k the devices split into ``num_devices // k`` replicas
of k consecutive devices; the strategy runs (and mirrors the variables of)
replica i on its first device, and the step places ops on the others with
``tf.device``. Replica i's InputContext names its first GPU
(``hvrep.replica.devices.replica_gpus``) and all its devices.
"""

from __future__ import annotations

import tensorflow as tf

from hvrep.replica.backends._ingraph import InGraphBackend, MarkingMirroredStrategy, _Marks
from hvrep.replica.comm import CommConfig
from hvrep.replica.devices import count_cuda_devices, group_devices, replica_gpus


class LocalBackend(InGraphBackend):
    name = "local"

    def __init__(self, config: CommConfig, devices_per_replica: int = 1) -> None:
        gpus = tf.config.list_logical_devices("GPU")
        groups = group_devices([d.name for d in (gpus or tf.config.list_logical_devices("CPU"))], devices_per_replica)
        marks = _Marks()
        # The strategy runs replica i on its first device, and mirrors its variables there.
        super().__init__(config, MarkingMirroredStrategy([g[0] for g in groups], marks), marks,
                         replica_gpus(len(gpus), count_cuda_devices(), devices_per_replica), groups)

    @classmethod
    def available(cls) -> bool:
        return True
