"""``hvrep train --resume``: every rank restores the chief's checkpoint, or every rank fails saying why.

Each rank lists the checkpoint directory itself. On a file system that caches
listings (NFS) or with node-local output folders, ranks can see different
newest checkpoints, and restoring what each sees would train replicas that
start from different weights, in lockstep and without a word. So the ranks
gather what they found; the chief's newest decides; a rank that sees another
newest but can read the chief's follows it (logged); if any rank cannot read
the chief's checkpoint, every rank raises the same ``CheckpointError``
naming the ranks, the checkpoint each found and the fix. Nothing is restored
before all ranks agree, and every failure is agreed on first, so no rank is
left waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

import hvrep
from hvrep.data.plan import Segment
from hvrep.errors import CheckpointError
from hvrep.train.checkpoint import CheckpointManager, all_damaged_message, read_metadata, skipped_message

log = logging.getLogger(__name__)

# What a rank reports when it finds no checkpoint / cannot list the directory / finds only damaged ones.
_NONE, _UNREADABLE, _DAMAGED = -1, -2, -3

# The layout of the training app's checkpoints, in checkpoint.json's "format". 2: both loops save the same
# trackables (model, optimizer, step, epoch, position, [accumulation]), the optimizer as the custom loop holds
# it. 1 (no "format" key): the same, but the fit loop saved its DistributedOptimizer, the optimizer nested in it.
FORMAT = 2


def checkpoint_record(*, epoch: int, segments: list[Segment], world_size: int, global_batch: int,
                      train_examples: int, samples_per_epoch: int, epochs: int, lr: Callable[[float], float],
                      loop: str, accumulation: dict[str, int] | None = None,
                      local_sgd: dict[str, Any] | None = None,
                      powersgd: dict[str, Any] | None = None) -> dict[str, Any]:
    """What both training loops write into a checkpoint's ``checkpoint.json``.

    Args:
      epoch: epochs completed; ``segments``: what of the next one was trained (``hvrep.data.plan``).
      samples_per_epoch: the schedule's epoch (the training set's size): with the segments it gives the samples
        trained, which is where the learning-rate schedule stands.
      epochs: the run's length (a recipe's run keeps it on resume).
      lr: the schedule's LR after so many epochs (recorded: the LR the next step trains with).
      loop: "custom" or "fit".
      local_sgd: ``{"local_steps": H, "outer_optimizer": ...}`` of a local-SGD run (its checkpoints are taken at
        a synchronisation point: ``hvrep.train.steps.Runner.prepare_checkpoint``), else None.
      powersgd: :func:`powersgd_record` of a PowerSGD run (its state is saved averaged over the replicas), else
        None.
    """
    in_epoch = sum(s.steps * s.global_batch for s in segments)
    trained = epoch + in_epoch / samples_per_epoch
    return {"format": FORMAT, "loop": loop, "epoch": epoch, "position": sum(s.steps for s in segments),
            "world_size": world_size, "global_batch": global_batch, "segments": [s.to_json() for s in segments],
            "train_examples": train_examples, "trained_samples": epoch * samples_per_epoch + in_epoch,
            "epochs_trained": trained, "epochs": epochs, "lr": lr(trained),
            "accumulation": accumulation or {"steps": 1, "micro_step": 0}, "local_sgd": local_sgd,
            "powersgd": powersgd}


def powersgd_record(config: Any) -> dict[str, Any] | None:
    """What a checkpoint's metadata says about PowerSGD (``CommConfig(compression="powersgd")``), else None.

    Resume restores the saved PowerSGD state (error feedback, warm-start Q's, step counter) only into a run with
    the same record: another rank or compression rule gives other shapes, and without error feedback there is
    none to restore. A run at another world size restores it and the state resets itself at its next reduction
    (``hvrep.replica.powersgd.PowerSGDState``).
    """
    if config.compression != "powersgd":
        return None
    return {"rank": config.powersgd_rank, "start_step": config.powersgd_start_step,
            "error_feedback": config.powersgd_error_feedback, "warm_start": config.powersgd_warm_start,
            "min_compression_rate": config.powersgd_min_compression_rate}


class _NestedOptimizer(tf.Module):
    """Format 1 fit checkpoints: the optimizer was saved as ``DistributedOptimizer.inner_optimizer``."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(name="hvrep_nested_optimizer")
        self.inner_optimizer = optimizer


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint every rank restored, and what its ``checkpoint.json`` says.

    Attributes:
      folder: the checkpoint folder (as this rank reads it).
      metadata: its ``checkpoint.json``: step, epoch, position, world_size,
        global_batch, segments, train_examples, accumulation.
    """

    folder: Path
    metadata: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.metadata["step"])

    def segments(self, replicas: int, global_batch: int) -> list[Segment]:
        """The interrupted epoch's segments (a checkpoint from before they were recorded: this run's size)."""
        if "segments" in self.metadata:
            return [Segment.from_json(s) for s in self.metadata["segments"]]
        position = int(self.metadata.get("position", 0))
        return [Segment(replicas, global_batch, position)] if position else []


def _gather_rows(v: tf.Tensor) -> tf.Tensor:
    # Row r holds replica r's values: a sum of one-hot rows. (An all_gather of the same host tensor on
    # every replica of a MirroredStrategy returns it unchanged instead of stacking the copies.)
    rows = tf.one_hot(hvrep.replica_id(), hvrep.num_replicas(), dtype=v.dtype)[:, None] * v
    return hvrep.all_reduce(rows, "sum")


def gather(repl: hvrep.Replicator, values: list[int]) -> np.ndarray:
    """Every replica's ``values`` (ints), as a (num_replicas, len(values)) array on every rank, in rank order."""
    per_replica = repl.run(_gather_rows, args=(tf.constant([values], tf.int64),))
    # Every replica holds the same rows; reduce brings them to the host.
    return np.asarray(repl.reduce(per_replica, "max")).reshape(repl.num_replicas, len(values))


def _describe(view: np.ndarray) -> str:
    step = int(view[0])
    if step == _UNREADABLE:
        return "could not list the directory"
    if step == _DAMAGED:
        return "found only damaged checkpoints"
    return "found no checkpoint" if step == _NONE else f"found ckpt-{step:08d} (step {step}, save #{int(view[1])})"


def _views(views: np.ndarray) -> str:
    return ", ".join(f"rank {r}{' (chief)' if r == 0 else ''} {_describe(v)}" for r, v in enumerate(views))


def restore(repl: hvrep.Replicator, checkpoints: CheckpointManager, accumulation_steps: int = 1,
            local_sgd: dict[str, Any] | None = None, powersgd: dict[str, Any] | None = None) -> ResumePoint | None:
    """Restores the chief's newest checkpoint on every rank.

    Call on every rank, before training. ``accumulation_steps`` is this run's
    ``CommConfig.accumulation_steps``: a checkpoint saved between two updates
    (gradients pending) must be resumed with the same value; otherwise the
    saved accumulation state is left out and the accumulators start empty.
    ``local_sgd`` is this run's local-SGD record (``checkpoint_record``'s): the
    saved local-SGD state (round counter, outer anchors and momenta) is restored
    only from a checkpoint with the same record; otherwise a new round starts
    from the restored model, which a checkpoint holds synchronised.
    ``powersgd`` is this run's :func:`powersgd_record`: the saved PowerSGD
    state is restored only from a checkpoint with the same record; otherwise
    it starts afresh (errors zero, Q's redrawn), as a run without it would.

    Returns:
      The checkpoint restored, or None when the chief finds none (a fresh start
      on every rank).

    Raises:
      hvrep.errors.CheckpointError: on every rank, when a rank cannot list the
        directory or read the chief's checkpoint (naming the ranks and what each
        found), when the restore fails on any rank, or when the checkpoint's
        pending accumulation cannot continue with ``accumulation_steps``.
    """
    where = checkpoints.directory
    skipped: list[tuple[Path, str]] = []
    try:
        # A checkpoint damaged after its save (a truncated data file) is skipped for the newest intact one.
        newest, skipped = checkpoints.newest_intact()
        for bad, why in skipped:
            log.warning("%s", skipped_message(bad, why, newest))
        record = read_metadata(newest) if newest is not None else None
        mine = [int(record["step"]), int(record["sequence"])] if record else [_DAMAGED if skipped else _NONE] * 2
    except CheckpointError as err:  # reported below, once every rank has said what it found
        log.error("%s", err)
        mine = [_UNREADABLE, _UNREADABLE]
    views = gather(repl, mine)
    if (views[:, 0] == _UNREADABLE).any():
        raise CheckpointError(
            f"not every rank can list the checkpoint directory {where}: {_views(views)}. Fix: make output_dir "
            "readable on every node (the ranks' own error is in their logs), then resume again."
        )
    chief = views[0]
    if chief[0] == _DAMAGED:
        raise CheckpointError(all_damaged_message(where, skipped) if skipped else
                              f"the chief found every checkpoint in {where} damaged (its log names each and why). Fix: "
                              "put back an intact copy of one, or start afresh with --overwrite or another output_dir.")
    for r, view in enumerate(views[1:], 1):
        if (view != chief).any():
            log.warning("rank %d %s; every rank follows the chief's: %s", r, _describe(view), _describe(chief))
    if chief[0] == _NONE:
        return None

    step, sequence = int(chief[0]), int(chief[1])
    try:
        found = _find(checkpoints, step, sequence)
    except CheckpointError as err:
        log.error("%s", err)
        found = None
    folder, metadata = found or (where / f"ckpt-{step:08d}", {})
    readable_on = gather(repl, [int(found is not None)])[:, 0]
    if not readable_on.all():
        missing = ", ".join(str(r) for r in np.flatnonzero(readable_on == 0))
        raise CheckpointError(
            f"the ranks see different checkpoints in {where}: {_views(views)}; rank(s) {missing} cannot read the "
            f"chief's ckpt-{step:08d} (save #{sequence}). Restoring what each sees would start the ranks from "
            f"different weights. Fix: give every rank the same view of output_dir (one shared file system, synced; "
            f"not node-local folders), e.g. copy ckpt-{step:08d} to where rank(s) {missing} read it, then resume "
            "again."
        )

    without = _accumulation_rule(metadata, accumulation_steps, folder)
    if "local_sgd" in checkpoints.trackables and metadata.get("local_sgd") != local_sgd:
        without += ("local_sgd",)
    if "powersgd" in checkpoints.trackables and metadata.get("powersgd") != powersgd:
        log.info("%s holds no PowerSGD state for %s (it has %s): PowerSGD starts afresh (errors zero, Q's redrawn).",
                 folder.name, powersgd, metadata.get("powersgd"))
        without += ("powersgd",)
    legacy = metadata.get("loop") == "fit" and "format" not in metadata and "optimizer" in checkpoints.trackables
    if legacy:
        log.warning("%s was written by the fit loop before checkpoint format %d: reading its optimizer from inside "
                    "the DistributedOptimizer it was saved in.", folder.name, FORMAT)
    try:
        checkpoints.restore(folder, without=without, replace={
            "optimizer": _NestedOptimizer(checkpoints.trackables["optimizer"])} if legacy else None)
        error = None
    except Exception as err:  # re-raised below, once every rank has said how its restore went
        error = err
    failed = np.flatnonzero(gather(repl, [int(error is not None)])[:, 0])
    if error is not None:
        raise error
    if failed.size:
        raise CheckpointError(
            f"rank(s) {', '.join(map(str, failed))} could not restore {folder.name} (their error is in their "
            "logs); no rank continues."
        )
    return ResumePoint(folder, metadata)


def _find(checkpoints: CheckpointManager, step: int, sequence: int) -> tuple[Path, dict[str, Any]] | None:
    """This rank's folder of the chief's save (``step``, save #``sequence``) and its metadata, or None."""
    for folder in reversed(checkpoints.all()):  # also a step's previous version left by a killed overwrite
        metadata = read_metadata(folder)
        if (metadata.get("step"), metadata.get("sequence")) == (step, sequence):
            return folder, metadata
    return None


def _accumulation_rule(metadata: dict[str, Any], steps: int, folder: Path) -> tuple[str, ...]:
    """Which trackables to leave out when restoring, given the saved and the current accumulation steps."""
    saved = metadata.get("accumulation") or {"steps": 1, "micro_step": 0}
    k, micro = int(saved["steps"]), int(saved["micro_step"])
    if k > 1 and micro % k and k != steps:
        raise CheckpointError(
            f"{folder.name} was saved after micro-step {micro} with comm.accumulation_steps={k}: the gradients of "
            f"{micro % k} micro-batch(es) are pending and cannot go on with accumulation_steps={steps}. Fix: "
            f"resume with comm.accumulation_steps={k}."
        )
    # No pending gradients: a run with another k (or none saved) starts its accumulators empty.
    return ("accumulation",) if steps > 1 and k != steps else ()
