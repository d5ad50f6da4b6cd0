"""Where the learning-rate schedule stands: samples trained, the same rule in both training loops.

``hvrep train`` defines warmup and decay in epochs (``hvrep.schedules.EpochSchedule``)
and anchors the schedule at every epoch's start to what was trained: the
epochs before it, the samples of the epoch's earlier segments (another world
size or global batch) and the steps of the current one. A run resumed with
half or double the global batch therefore goes on from the epoch it reached,
at the LR an uninterrupted run with the new batch has there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hvrep.data import EpochPosition
from hvrep.schedules import EpochSchedule


def trained_samples(epoch: int, at: EpochPosition, global_batch: int, samples_per_epoch: int) -> int:
    """Samples trained before ``at`` in epoch ``epoch`` (counting each earlier epoch as ``samples_per_epoch``)."""
    return epoch * samples_per_epoch + sum(s.steps * s.global_batch for s in at.done) + at.steps * global_batch


@dataclasses.dataclass
class SchedulePosition:
    """An :class:`EpochSchedule` and the optimizer whose step count it is called with.

    Attributes:
      schedule: the schedule (its ``schedule`` may be replaced before the first step, e.g. a recipe for
        another batch on resume).
      optimizer: any optimizer in the wrapping chain (loss scaling, distribution): all share ``iterations``.
      samples_per_step: samples one optimizer step trains (global batch x accumulation steps).
    """

    schedule: EpochSchedule
    optimizer: Any
    samples_per_step: int

    def _step(self) -> int:
        return int(self.optimizer.iterations.numpy())

    def anchor(self, samples: int) -> float:
        """Anchors the schedule at ``samples`` trained (outside the compiled step); returns the next step's LR."""
        self.schedule.anchor(self._step(), samples, self.samples_per_step)
        return self.lr()

    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return float(self.schedule(self._step()))

    def epochs(self) -> float:
        """Epochs trained, as the schedule counts them."""
        return float(self.schedule.epochs_at(self._step()))


def announce(metrics: Any, metadata: dict[str, Any], *, step: int, global_batch: int, lr: float,
             epochs_trained: float, rule: str) -> None:
    """Records where the schedule resumed (event ``schedule``); says so on the console when the batch changed.

    Args:
      metadata: the restored checkpoint's ``checkpoint.json`` (``global_batch``, and ``lr``: the LR its next step
        would have used, when it was saved by a version that records it).
      rule: how the LR after the resume was set, for people.
    """
    old_batch = metadata.get("global_batch")
    before = metadata.get("lr")
    metrics.write("schedule", step, epochs_trained=epochs_trained, global_batch=[old_batch, global_batch],
                  lr=[before, lr], rule=rule)
    if old_batch is not None and old_batch != global_batch:
        was = f"{before:.6g}" if isinstance(before, (int, float)) else "not recorded"
        metrics.say(f"resumed after {epochs_trained:.3f} epochs with global batch {old_batch} -> {global_batch}: "
                    f"learning rate {was} -> {lr:.6g} ({rule}).")
