"""Which samples each replica trains on in an epoch, as sample ids, and how an interrupted epoch goes on.

Sample ids number a split's samples 0..N-1 in listing order: a folder's files sorted by class then name
(one *block*), or the TFRecord shards in order and each shard's records in file order (one block per
shard). Both pipelines (tf.data and DALI) read exactly the ids the plan gives a replica, so they train on
the same samples in the same batches, and skipping batches already trained is dropping their ids: nothing
is read or decoded for them.

Order. The blocks are shuffled with the epoch's seed and cut into groups of ``group`` consecutive blocks,
and the ids of each group are shuffled. A folder is one block, so its order is a full shuffle. TFRecord
groups hold about ``DataConfig.shuffle_buffer`` records (ImageNet's 1,024 shards of ~1,250: 8 shards),
the mixing the shuffle buffer over 8 interleaved shards gave before, while a reader holds only one group
of shards at a time. Within each batch the ids are then sorted (by group, then id): the batch is the same
set of samples, and a reader visits each shard once per batch.

Dealing, to R replicas of per-replica batch b (global batch G = R*b), by one of two rules:

- strided (a folder; TFRecords whose shard count does not divide by R): one global order per epoch that
  does not depend on R; replica r takes positions r, r+R, ..., so step k trains on positions
  [kG, (k+1)G) whatever R is. ``floor(N / G)`` steps; fewer than G samples are left out.
- by file (TFRecords whose shard count divides by R): replica r reads only shards r, r+R, ... (at
  ImageNet scale a replica must not read every shard), grouped and shuffled as above with its own seed;
  every replica takes ``min_r floor(n_r / b)`` steps, so the surplus of the larger shares is left out too.

Resuming. An epoch is a sequence of :class:`Segment` s, each trained at one world size and global batch;
the training app records them in its checkpoints. A segment deals, by its own rule, the samples that the
earlier segments did not train on. A run resumed at the last segment's world size and global batch
continues that segment (its first ``steps`` batches are dropped, so it trains on exactly the batches the
interrupted run would have); at another world size or global batch it starts a new segment over what is
left. So within an epoch no sample is trained on twice and none is left out but the remainder a segment
cannot fill (above). Between two strided segments what is left is exactly the rest of the global order.

The remainder is the first segment's. The samples an epoch leaves out are fixed where it starts: those its
first segment would leave out had it run to the end. Every later segment deals them last (after the rest
of its order, in their groups), so its own truncation drops them first. A run resized mid-epoch with the
global batch kept (a requeue onto fewer nodes) whose new segment is strided or on one replica therefore
trains on every sample the uninterrupted run would have, and exactly those when that run left out less than
one global batch (always so when it was strided). A new segment dealt by file at several replicas keeps
each replica to its own shards; what the first segment took from them can leave the shares uneven, and the
surplus is left out as at the start of an epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvrep.data.config import DataConfig
from hvrep.data.files import FolderListing, ShardListing
from hvrep.errors import ConfigError, DataError

STRIDED, BY_FILE = "strided", "by file"
_SEED_BITS = (1 << 64) - 1  # NumPy seeds are non-negative; any int seed maps onto one


@dataclass(frozen=True)
class Segment:
    """Part of an epoch trained at one world size and global batch.

    Attributes:
      replicas: world size R.
      global_batch: samples per step over all replicas (a multiple of R).
      steps: steps trained in this segment.
    """

    replicas: int
    global_batch: int
    steps: int

    def __post_init__(self) -> None:
        for name in ("replicas", "global_batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < (name != "steps"):
                raise ConfigError(f"Segment.{name} must be an int >= {int(name != 'steps')}, got {value!r}.")
        if self.global_batch % self.replicas:
            raise ConfigError(f"Segment.global_batch={self.global_batch} must divide by replicas={self.replicas}.")

    @property
    def batch(self) -> int:
        """Samples per step on one replica."""
        return self.global_batch // self.replicas

    def to_json(self) -> list[int]:
        """``[replicas, global_batch, steps]``, as checkpoints store it (``from_json`` reads it back)."""
        return [int(self.replicas), int(self.global_batch), int(self.steps)]

    @classmethod
    def from_json(cls, value: Any) -> Segment:
        """A segment from ``to_json``'s ``[replicas, global_batch, steps]``."""
        if not isinstance(value, list | tuple) or len(value) != 3:
            raise ConfigError(f"a segment is [replicas, global_batch, steps], got {value!r}.")
        return cls(*value)


@dataclass(frozen=True)
class EpochPosition:
    """Where an epoch's data resumes.

    Attributes:
      done: the epoch's earlier segments (trained at another world size or global batch).
      steps: steps of the current segment already trained: their batches are dropped unread.
    """

    done: tuple[Segment, ...] = ()
    steps: int = 0

    @classmethod
    def resume(cls, segments: Sequence[Segment], replicas: int, global_batch: int) -> EpochPosition:
        """Continues the last of ``segments`` when it ran at this world size and global batch, else starts anew."""
        if segments and (segments[-1].replicas, segments[-1].global_batch) == (replicas, global_batch):
            return cls(tuple(segments[:-1]), segments[-1].steps)
        return cls(tuple(segments), 0)

    @property
    def is_start(self) -> bool:
        """Nothing of the epoch trained yet."""
        return not self.done and self.steps == 0

    def segments(self, replicas: int, global_batch: int, steps: int) -> list[Segment]:
        """The epoch's segments once the current one (at this size and batch) has trained ``steps`` in all."""
        return [*self.done, Segment(replicas, global_batch, steps)]


@dataclass(frozen=True)
class ReplicaShare:
    """The samples one replica reads for the rest of a segment.

    Attributes:
      ids: sample ids in reading order, ``steps * batch`` of them.
      groups: each id's group number (non-decreasing): a reader needs one group's blocks at a time.
      steps: batches left in the segment.
    """

    ids: np.ndarray
    groups: np.ndarray
    steps: int


class EpochPlan:
    """One epoch's samples, dealt to replicas (see the module docstring for the rules).

    Args:
      blocks: samples per block, in listing order (a folder: one block; TFRecords: one per shard).
      seed: the epoch's seed (the same on every replica).
      group: blocks per group (None: all of them).
      exclude: ids left out of the epoch (images known to be bad).
    """

    def __init__(self, blocks: Sequence[int], seed: int, group: int | None = None, exclude: Iterable[int] = ()) -> None:
        sizes = np.asarray(blocks, np.int64)
        if sizes.ndim != 1 or len(sizes) == 0 or (sizes < 0).any():
            raise ConfigError(f"blocks must be a non-empty list of sample counts >= 0, got {list(blocks)!r}.")
        self.blocks = sizes
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_samples = int(self.starts[-1])
        self.seed = int(seed)
        self.group = len(sizes) if group is None else max(1, min(int(group), len(sizes)))
        self._closed = np.zeros(self.num_samples, bool)
        excluded = np.fromiter(exclude, np.int64)
        if excluded.size and (excluded.min() < 0 or excluded.max() >= self.num_samples):
            raise ConfigError(f"exclude holds ids outside [0, {self.num_samples}).")
        self._closed[excluded] = True
        self._block_of = np.repeat(np.arange(len(sizes)), sizes)

    def rule(self, replicas: int) -> str:
        """``"by file"`` when there are several blocks and their number divides by ``replicas``, else ``"strided"``."""
        return BY_FILE if len(self.blocks) > 1 and len(self.blocks) % replicas == 0 else STRIDED

    def block_of(self, ids: np.ndarray) -> np.ndarray:
        """The block (shard) number of each id."""
        return self._block_of[ids]

    def steps(self, replicas: int, batch: int, position: EpochPosition = EpochPosition()) -> int:
        """Steps of the segment that ``position`` is in, those already trained included."""
        _check(replicas, batch)
        return self._steps(replicas, batch, self._open(position.done))

    def share(self, replica: int, replicas: int, batch: int, position: EpochPosition = EpochPosition()) -> ReplicaShare:
        """What replica ``replica`` of ``replicas`` reads from ``position`` to the end of the segment.

        Raises:
          hvrep.errors.DataError: ``position`` lies beyond what this data set holds (the
            checkpoint was written for other data).
        """
        _check(replicas, batch)
        if not 0 <= replica < replicas:
            raise ConfigError(f"replica must be in [0, {replicas}), got {replica}.")
        open_ = self._open(position.done)
        steps = self._steps(replicas, batch, open_)
        if position.steps > steps:
            raise self._beyond(len(position.done) + 1, position.steps, replicas, batch, steps)
        ids, groups = self._streams(replicas, open_, self._remainder(position.done), only=replica)[0]
        n = steps * batch
        ids, groups = ids[:n].reshape(steps, batch), groups[:n].reshape(steps, batch)
        order = np.lexsort((ids, groups), axis=-1)  # by group, then id, within each batch
        ids, groups = np.take_along_axis(ids, order, -1).ravel(), np.take_along_axis(groups, order, -1).ravel()
        skip = position.steps * batch
        return ReplicaShare(ids[skip:], groups[skip:], steps - position.steps)

    def trained(self, segments: Sequence[Segment]) -> np.ndarray:
        """The ids trained on by ``segments`` (an epoch's, in order), in the order of the global steps."""
        open_ = ~self._closed
        out = []
        for seg in segments:
            ids = self._trained_by(seg, open_, len(out) + 1, self._remainder(segments[:len(out)]))
            open_[ids] = False
            out.append(ids)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def left_out(self, replicas: int, global_batch: int) -> np.ndarray:
        """The ids (sorted) an epoch that starts at this world size and global batch leaves out, excluded ids aside."""
        return np.flatnonzero(self._remainder([Segment(replicas, global_batch, 0)]))

    def _open(self, done: Sequence[Segment]) -> np.ndarray:
        """A mask of the ids neither excluded nor trained on by ``done``."""
        open_ = ~self._closed
        for i, seg in enumerate(done):
            open_[self._trained_by(seg, open_, i + 1, self._remainder(done[:i]))] = False
        return open_

    def _remainder(self, done: Sequence[Segment]) -> np.ndarray | None:
        """A mask of the ids the epoch's first segment, run to its end, leaves out; None before it (see the module
        docstring: later segments deal these last)."""
        if not done:
            return None
        first = done[0]
        open_ = ~self._closed
        n = self._steps(first.replicas, first.batch, open_) * first.batch
        for ids, _ in self._streams(first.replicas, open_):
            open_[ids[:n]] = False
        return open_

    def _trained_by(self, seg: Segment, open_: np.ndarray, number: int, last: np.ndarray | None) -> np.ndarray:
        steps = self._steps(seg.replicas, seg.batch, open_)
        if seg.steps > steps:
            raise self._beyond(number, seg.steps, seg.replicas, seg.batch, steps)
        n = seg.steps * seg.batch
        streams = self._streams(seg.replicas, open_, last)
        # Step by step, replica by replica: the global batches in order.
        return np.stack([ids[:n].reshape(seg.steps, seg.batch) for ids, _ in streams], 1).ravel()

    def _beyond(self, number: int, trained: int, replicas: int, batch: int, steps: int) -> DataError:
        return DataError(
            f"segment {number} of the epoch trained {trained} steps of {replicas} x {batch} samples, but this data "
            f"set ({self.num_samples} samples in {len(self.blocks)} block(s)) has only {steps} such steps there: "
            "the checkpoint was written for other data. Fix: resume with the data set it was trained on."
        )

    def _steps(self, replicas: int, batch: int, open_: np.ndarray) -> int:
        if self.rule(replicas) == STRIDED:
            return int(open_.sum()) // (replicas * batch)
        per_block = np.bincount(self._block_of[open_], minlength=len(self.blocks))
        return min(int(per_block[r::replicas].sum()) for r in range(replicas)) // batch

    def _streams(self, replicas: int, open_: np.ndarray, last: np.ndarray | None = None,
                 only: int | None = None) -> list[tuple[np.ndarray, ...]]:
        """(ids, groups) of each replica (or of replica ``only``), in reading order, untruncated.

        The open ids in the mask ``last`` come after the others, in their groups renumbered past the last one,
        so a reader still holds one group of blocks at a time.
        """
        which = range(replicas) if only is None else [only]
        if self.rule(replicas) == STRIDED:
            ids, groups = self._last(*self._shuffled(np.arange(len(self.blocks)), self._rng()), open_, last)
            return [(ids[r::replicas], groups[r::replicas]) for r in which]
        return [self._last(*self._shuffled(np.arange(r, len(self.blocks), replicas), self._rng(replicas, r)),
                           open_, last) for r in which]

    @staticmethod
    def _last(ids: np.ndarray, groups: np.ndarray, open_: np.ndarray,
              last: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The open ones of ``ids`` (and their ``groups``), those in ``last`` moved to the end (order kept)."""
        keep = open_[ids]
        ids, groups = ids[keep], groups[keep]
        if last is None:
            return ids, groups
        tail = last[ids]
        if not tail.any():
            return ids, groups
        shift = int(groups.max()) + 1
        return (np.concatenate([ids[~tail], ids[tail]]), np.concatenate([groups[~tail], groups[tail] + shift]))

    def _rng(self, *tags: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & _SEED_BITS, *tags])

    def _shuffled(self, blocks: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``blocks``: blocks shuffled and cut into groups, each group's ids shuffled; and their group."""
        order = rng.permutation(blocks)
        ids, groups = [], []
        for g, first in enumerate(range(0, len(order), self.group)):
            members = order[first:first + self.group]
            chunk = np.concatenate([np.arange(self.starts[k], self.starts[k + 1]) for k in members])
            ids.append(rng.permutation(chunk))
            groups.append(np.full(len(chunk), g, np.int64))
        return np.concatenate(ids), np.concatenate(groups)


def _check(replicas: int, batch: int) -> None:
    if replicas < 1 or batch < 1:
        raise ConfigError(f"replicas and batch must be >= 1, got replicas={replicas}, batch={batch}.")


def plan_for(config: DataConfig, listing: FolderListing | ShardListing, exclude: Iterable[int] = ()) -> EpochPlan:
    """The plan of a split's ``listing`` with ``config.seed``.

    TFRecord groups hold about ``config.shuffle_buffer`` records (whole shards).
    """
    if isinstance(listing, FolderListing):
        return EpochPlan([len(listing.files)], config.seed, exclude=exclude)
    counts = listing.counts
    per_shard = max(1.0, sum(counts) / len(counts))
    return EpochPlan(counts, config.seed, group=max(1, round(config.shuffle_buffer / per_shard)), exclude=exclude)
