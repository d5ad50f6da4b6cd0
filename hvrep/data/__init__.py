"""Input pipelines: DALI and tf.data behind one interface, and the demo data set.

    config = hvrep.data.DataConfig("/data/imagenet-tfrecord", format="tfrecord", backend="dali")
    dataset = repl.distribute_dataset(
        lambda ctx: hvrep.data.make_dataset(config, "train", ctx), global_batch_size=1024)
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from hvrep.data.config import PAD_LABEL, DataConfig, renamed_batch
from hvrep.data.demo import write_demo
from hvrep.data.prepare import prepare  # the function, not its module (same name): imported, not lazy

if TYPE_CHECKING:
    import tensorflow as tf

    from hvrep.data.plan import EpochPlan, EpochPosition
    from hvrep.replica.context import InputContext

# name -> module: imported on first use, so that `hvrep train` parses and checks its configuration (which needs
# DataConfig) before TensorFlow is imported (3-4 s), as `hvrep` does for its own names.
_LAZY = {
    "EpochPlan": "hvrep.data.plan", "EpochPosition": "hvrep.data.plan", "Segment": "hvrep.data.plan",
    "synthetic_dataset": "hvrep.data.tfdata",
    "tfdata_dataset": "hvrep.data.tfdata", "tfdata_plan": "hvrep.data.tfdata",
    "tfdata_epochs": "hvrep.data.tfdata", "tfdata_epochs_apply": "hvrep.data.tfdata",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hvrep.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def _lazy(name: str) -> Any:
    """A lazy name as this package holds it now (imported on first use; what a test may have replaced)."""
    return globals()[name] if name in globals() else __getattr__(name)

def make_dataset(config: DataConfig, split: str, ctx: InputContext | None = None,
                 per_replica_batch_size: int | None = None, training: bool | None = None,
                 position: EpochPosition | None = None, threads: int | None = None, *,
                 batch_size: int | None = None) -> tf.data.Dataset:
    """One replica's ``(images, labels)`` batches for one epoch, from ``config.backend``.

    Both backends apply the same augmentation and sharding rules (see
    ``hvrep.data.tfdata`` and ``hvrep.data.dali``); training reads the samples
    of the epoch plan (``hvrep.data.plan``), from ``position`` on when an epoch
    resumes (at any world size or global batch); evaluation pads with label
    ``PAD_LABEL`` (-1) rows that must not count. A dataset is one epoch and the
    same order each time it is built: pass a config whose ``seed`` changes per
    epoch (``dataclasses.replace(config, seed=base + epoch)``, the same on
    every replica) for a new shuffle and new augmentation. ``threads``: the
    pipeline's CPU threads (tf.data's private pool; DALI's ``num_threads``);
    None: tf.data's shared pool, DALI's ``config.num_threads``. The batch is
    ``ctx.per_replica_batch_size``, else ``per_replica_batch_size``
    (``batch_size=``: its old name, deprecated).
    """
    b = renamed_batch(per_replica_batch_size, batch_size, "make_dataset")
    if config.backend == "dali":
        from hvrep.data.dali import dali_dataset

        if threads is not None:
            config = dataclasses.replace(config, num_threads=threads)
        return dali_dataset(config, split, ctx, b, training, position)
    return _lazy("tfdata_dataset")(config, split, ctx, b, training, position, threads)


def epoch_plan(config: DataConfig, split: str = "train") -> EpochPlan:
    """The plan ``make_dataset`` follows when training on ``split`` with ``config`` (its seed: the epoch's)."""
    if config.backend == "dali":
        from hvrep.data.dali import dali_plan

        return dali_plan(config, split)
    return _lazy("tfdata_plan")(config, split)


def num_examples(config: DataConfig, split: str) -> int:
    """Images in a split: files in the folder, or records in the shards (from their DALI indexes; tf.data also
    counts a shard without one by reading it)."""
    from hvrep.data.files import list_folder, list_shards

    if config.format == "folder":
        return len(list_folder(config.data_dir, split).files)
    return sum(list_shards(config.data_dir, split, require_index=config.backend == "dali").counts)


def data_errors(config: DataConfig, split: str):
    """Wrap iteration over a ``make_dataset`` dataset in this to get decode errors that name the file.

    Inside this context a bad image becomes one ``DataError`` naming the file and the fix, instead of
    TensorFlow's (or DALI's) traceback: DALI reports a bad JPEG without its file name (``dali_errors`` finds it);
    the tf.data pipeline names it in its check's message (``tfdata_errors`` keeps that and drops the rest).
    """
    if config.backend == "dali":
        from hvrep.data.dali import dali_errors

        return dali_errors(config, split)
    from hvrep.data.tfdata import tfdata_errors

    return tfdata_errors(config, split)

__all__ = ["PAD_LABEL", "DataConfig", "EpochPlan", "EpochPosition", "Segment", "data_errors", "epoch_plan",
           "make_dataset", "num_examples", "prepare", "synthetic_dataset", "tfdata_dataset", "tfdata_epochs",
           "tfdata_epochs_apply", "write_demo"]
