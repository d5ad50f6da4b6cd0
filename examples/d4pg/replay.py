"""A learner rank's replay and its policy board: files in shared memory that actors write without locks.

Why files and no queue: an actor may be stopped (SIGSTOP) or killed at any instant. A lock or a pipe message it
held half-written would then stop the learner too; here nothing an actor does can make the learner wait.

- **Replay**: one bounded ring per actor (``capacity // num_actors`` rows each) and a counter per actor of the
  rows it ever wrote. An actor writes at most ``MARGIN`` rows, then raises its counter (one aligned 8-byte
  store), so the learner never reads a row whose counter is not up. Sampling is uniform over the newest
  ``ring - MARGIN`` published rows of each ring (all of them while fewer): the ``MARGIN`` slots after the
  newest row, which the actor's next write fills, are never read, also while the ring wraps for the first time
  and while an actor is stopped between its rows and its counter. After its copy the learner reads the counters
  again and draws anew any row a fast actor may have overwritten meanwhile.
  A restarted actor takes over its ring and counter.
- **Board**: the learner's newest policy weights under a sequence lock (one writer: the learner). The sequence is
  odd while the learner writes; an actor copies the weights and keeps the copy only if the sequence was even
  and unchanged around its copy.

A row is ``obs, action, n-step reward, discount (gamma^n, 0 at a terminal state), next obs, the learner step
of the policy that acted`` (float32; the step is exact up to 2^24).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MARGIN = 64  # rows of a full ring left out of sampling: > the rows an actor writes between two counter updates
_COUNTERS = 4  # per actor: rows written, environment steps, episodes, the last episode's return (x1000, int)


def row_width(obs_dim: int, act_dim: int) -> int:
    return 2 * obs_dim + act_dim + 3


class Replay:
    """The rings of ``num_actors`` actors in ``folder`` (``create``: the learner makes the files; an actor
    attaches with ``create=False``)."""

    def __init__(self, folder: Path, num_actors: int, capacity: int, obs_dim: int, act_dim: int,
                 create: bool) -> None:
        self.folder, self.num_actors, self.obs_dim, self.act_dim = folder, num_actors, obs_dim, act_dim
        self.per_actor = max(capacity // num_actors, 2 * MARGIN)
        self.width = row_width(obs_dim, act_dim)
        mode = "w+" if create else "r+"
        self.counters = np.memmap(folder / "counters.bin", np.int64, mode, shape=(num_actors, _COUNTERS))
        self.rows = np.memmap(folder / "rows.bin", np.float32, mode, shape=(num_actors, self.per_actor, self.width))

    # --- the actor's side
    def add(self, actor: int, rows: np.ndarray) -> None:
        """Appends ``rows`` (k <= MARGIN, width) to ``actor``'s ring, then publishes them (raises the counter)."""
        if len(rows) > MARGIN:
            raise ValueError(f"an actor writes at most MARGIN={MARGIN} rows before raising its counter, got "
                             f"{len(rows)}: the learner may be reading the slots past them")
        count = int(self.counters[actor, 0])
        idx = (count + np.arange(len(rows))) % self.per_actor
        self.rows[actor, idx] = rows
        self.counters[actor, 0] = count + len(rows)

    def note(self, actor: int, env_steps: int, episodes: int, last_return: float) -> None:
        self.counters[actor, 1] = env_steps
        self.counters[actor, 2] = episodes
        self.counters[actor, 3] = round(last_return * 1000)

    # --- the learner's side
    def inserted(self) -> int:
        """Rows ever written, all actors."""
        return int(self.counters[:, 0].sum())

    def env_steps(self) -> int:
        return int(self.counters[:, 1].sum())

    def _valid(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows ever published, rows that may be read) per actor: the newest ring - MARGIN published rows."""
        counts = np.array(self.counters[:, 0])
        return counts, np.minimum(counts, self.per_actor - MARGIN)

    def size(self) -> int:
        """Rows that can be sampled now."""
        return int(self._valid()[1].sum())

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` rows (n, width) drawn uniformly, with replacement, from the rows that may be read."""
        out = np.empty((n, self.width), np.float32)
        todo = np.arange(n)
        while todo.size:
            counts, valid = self._valid()
            total = int(valid.sum())
            if total == 0:
                raise ValueError("the replay is empty")
            draw = rng.integers(0, total, size=todo.size)
            ends = np.cumsum(valid)
            actor = np.searchsorted(ends, draw, side="right")
            # Each row's number in its actor's stream: the oldest readable one plus the offset into the readable.
            number = counts[actor] - valid[actor] + draw - (ends[actor] - valid[actor])
            out[todo] = self.rows[actor, number % self.per_actor]
            # An actor that wrote more than MARGIN rows during the copy (it published some) may have overwritten
            # a row read: those numbers are below its new count + MARGIN - ring. Drawn again.
            now = np.array(self.counters[:, 0])
            todo = todo[number < now[actor] + MARGIN - self.per_actor]
        return out


class Board:
    """The learner's newest policy weights (``num_weights`` float32) and the learner step they are from."""

    def __init__(self, folder: Path, num_weights: int, create: bool) -> None:
        mode = "w+" if create else "r+"
        self.header = np.memmap(folder / "board-header.bin", np.int64, mode, shape=(2,))  # sequence, step
        self.weights = np.memmap(folder / "board-weights.bin", np.float32, mode, shape=(num_weights,))

    def publish(self, flat: np.ndarray, step: int) -> None:
        self.header[0] += 1  # odd: being written
        self.weights[:] = flat
        self.header[1] = step
        self.header[0] += 1

    def sequence(self) -> int:
        return int(self.header[0])

    def read(self) -> tuple[np.ndarray, int, int] | None:
        """(weights copy, step, sequence), or None if none were published yet or the learner was writing."""
        seq = int(self.header[0])
        if seq == 0 or seq % 2:
            return None
        flat, step = np.array(self.weights), int(self.header[1])
        return (flat, step, seq) if int(self.header[0]) == seq else None
