"""Replicas on a TPU's cores (tf.distribute.TPUStrategy).

Built to TensorFlow's TPU API; no TPU was available to run it (see README).
It shares all collective code with the local backend (``_ingraph.py``); the
double-reduction guard is not wired into TPUStrategy, so on TPU use
``repl.wrap_optimizer`` or a step that leaves the summation to Keras.
"""

from __future__ import annotations

import tensorflow as tf

from hvrep import _env
from hvrep.errors import SetupError
from hvrep.replica.backends._ingraph import InGraphBackend, _Marks
from hvrep.replica.comm import CommConfig


def _resolver() -> tf.distribute.cluster_resolver.TPUClusterResolver:
    return tf.distribute.cluster_resolver.TPUClusterResolver(tpu=_env.tpu_name())


class TPUBackend(InGraphBackend):
    name = "tpu"

    def __init__(self, config: CommConfig) -> None:
        try:
            resolver = _resolver()
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, RuntimeError, tf.errors.NotFoundError) as e:
            raise SetupError(f"backend='tpu' but no TPU was found ({e}). Fix: run on a TPU VM, or use "
                             "backend='auto'.") from e
        super().__init__(config, tf.distribute.TPUStrategy(resolver), _Marks())

    @classmethod
    def available(cls) -> bool:
        # No resolver probe here: off a TPU VM it would query a cloud metadata
        # server over the network. A TPU VM shows /dev/accel*; a TPU node sets TPU_NAME.
        return bool(tf.config.list_logical_devices("TPU")) or _env.tpu_hint()
