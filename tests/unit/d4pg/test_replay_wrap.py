"""The learner never samples a row its actor has not published, also while the actor's ring wraps
(examples/d4pg/replay.py's promise).

An actor writes a chunk of rows, then raises its counter; stopped (SIGSTOP) or slow between the two, it leaves
rows in its ring that are not published yet, in the slots of the oldest rows. Here the test is that actor: it
fills a ring row by row (each row filled with its own number), writes the next chunk's rows without raising the
counter, and runs a sampling loop at every fill level around and past the wrap. Every row drawn must carry a
published number (below the counter) and be whole.
"""

from __future__ import annotations

import numpy as np

from examples.d4pg.replay import MARGIN, Replay

OBS, ACT = 8, 1


def _rows(first: int, n: int, width: int) -> np.ndarray:
    return (first + np.arange(n, dtype=np.float32))[:, None] * np.ones((1, width), np.float32)


def test_a_sampling_loop_never_draws_rows_written_but_not_yet_published(tmp_path):
    replay = Replay(tmp_path, 1, 2 * MARGIN, OBS, ACT, create=True)
    ring, rng = replay.per_actor, np.random.default_rng(0)
    bad = drawn = 0
    published = 0
    while published < 3 * ring:
        chunk = MARGIN // 2 if published < ring - MARGIN else 8  # fine steps through the wrap
        replay.add(0, _rows(published, chunk, replay.width))
        published += chunk
        # The next chunk, written as add() writes it, its counter not raised yet (the actor stopped there).
        pending = published + np.arange(MARGIN)
        replay.rows[0, pending % ring] = _rows(published, MARGIN, replay.width)
        rows = replay.sample(2000, rng)
        numbers = rows[:, 0]
        bad += int(((numbers >= published) | (rows != numbers[:, None]).any(axis=1)).sum())
        drawn += len(rows)
        assert replay.size() > 0
    assert bad == 0, f"{bad} of {drawn} rows sampled were not published"
