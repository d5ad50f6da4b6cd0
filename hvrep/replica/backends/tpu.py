"""Replicas on a TPU's cores (tf.distribute.TPUStrategy).

Built to TensorFlow's TPU API; no TPU was available to run it (see docs/index.md, "Support matrix").
It shares all collective code with the local backend (``_ingraph.py``),
including the reduce-exactly-once guard (:class:`MarkingTPUStrategy`) and
the one-replica view inside ``run``; those are tested on MirroredStrategy,
which goes through the same mixins.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.distribute import tpu_strategy

from hvrep import _env
from hvrep.errors import SetupError
from hvrep.replica.backends._ingraph import InGraphBackend, _MarkingExtendedMixin, _Marks, _OneReplicaView
from hvrep.replica.comm import CommConfig


def _resolver() -> tf.distribute.cluster_resolver.TPUClusterResolver:
    return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=_env.tpu_name())


class _MarkingTPUExtended(_MarkingExtendedMixin, tpu_strategy.TPUExtended):
    pass


class MarkingTPUStrategy(_OneReplicaView, tf.distribute.TPUStrategy):
    """TPUStrategy whose SUM of an hvrep-reduced value is that value (see ``_ingraph``)."""

    def __init__(self, resolver: tf.distribute.cluster_resolver.TPUClusterResolver, marks: _Marks) -> None:
        super().__init__(resolver)
        # TPUStrategy builds its own TPUExtended; this makes that same object hvrep's subclass of it.
        self.extended.__class__ = _MarkingTPUExtended
        self.extended._hvrep_marks = marks


class TPUBackend(InGraphBackend):
    name = "tpu"

    def __init__(self, config: CommConfig, devices_per_replica: int = 1) -> None:
        # devices_per_replica > 1 (a TPU replica is one core here) is refused by the support table
        # (hvrep.replica.support) before the Replicator creates this backend.
        try:
            resolver = _resolver()
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, RuntimeError, tf.errors.NotFoundError) as e:
            raise SetupError(f"backend='tpu' but no TPU was found ({e}). Fix: run on a TPU VM, or use "
                             "backend='auto'.") from e
        marks = _Marks()
        super().__init__(config, MarkingTPUStrategy(resolver, marks), marks)

    @classmethod
    def available(cls) -> bool:
        # No resolver probe here: off a TPU VM it would query a cloud metadata
        # server over the network. A TPU VM shows /dev/accel*; a TPU node sets TPU_NAME.
        return bool(tf.config.list_logical_devices("TPU")) or _env.tpu_hint()
