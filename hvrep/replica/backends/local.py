"""Replicas on this machine's devices, in one process (tf.distribute.MirroredStrategy).

Uses every GPU when there are GPUs, else every logical CPU device (tests make
two with ``tf.config.set_logical_device_configuration``), so the in-graph code
path that TPUs also take runs here with more than one replica. Replica i's
InputContext names GPU i (``hvrep.replica.devices.replica_gpus``).
"""

from __future__ import annotations

import tensorflow as tf

from hvrep.replica.backends._ingraph import InGraphBackend, MarkingMirroredStrategy, _Marks
from hvrep.replica.comm import CommConfig
from hvrep.replica.devices import count_cuda_devices, replica_gpus


class LocalBackend(InGraphBackend):
    name = "local"

    def __init__(self, config: CommConfig) -> None:
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
        marks = _Marks()
        super().__init__(config, MarkingMirroredStrategy(devices, marks), marks,
                         replica_gpus(len(gpus), count_cuda_devices()))

    @classmethod
    def available(cls) -> bool:
        return True
