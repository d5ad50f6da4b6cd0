"""Input pipelines: DALI and tf.data behind one interface, and the demo data set.

    config = hvrep.data.DataConfig("/data/imagenet-tfrecord", format="tfrecord", backend="dali")
    dataset = repl.distribute_dataset(
        lambda ctx: hvrep.data.make_dataset(config, "train", ctx), global_batch_size=1024)
"""

from __future__ import annotations

import tensorflow as tf

from hvrep.backends.base import InputContext
from hvrep.data.config import PAD_LABEL, DataConfig
from hvrep.data.demo import write_demo
from hvrep.data.prepare import prepare
from hvrep.data.tfdata import synthetic_dataset, tfdata_dataset


def make_dataset(config: DataConfig, split: str, ctx: InputContext | None = None, batch_size: int | None = None,
                 training: bool | None = None) -> tf.data.Dataset:
    """One replica's ``(images, labels)`` batches for one epoch, from ``config.backend``.

    Both backends apply the same augmentation and sharding rules (see
    ``hvrep.data.tfdata`` and ``hvrep.data.dali``); evaluation pads with
    label ``PAD_LABEL`` (-1) rows that must not count.
    """
    if config.backend == "dali":
        from hvrep.data.dali import dali_dataset

        return dali_dataset(config, split, ctx, batch_size, training)
    return tfdata_dataset(config, split, ctx, batch_size, training)


__all__ = ["PAD_LABEL", "DataConfig", "make_dataset", "prepare", "synthetic_dataset", "tfdata_dataset",
           "write_demo"]
