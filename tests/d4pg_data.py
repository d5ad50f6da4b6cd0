"""The D4PG learner's test data, shared by the in-graph test (tests/unit/d4pg/test_learner.py) and the 2-rank
cases (tests/multirank/cases_d4pg.py): the same batches must give the same weights on every backend."""

from __future__ import annotations

import numpy as np

OBS, ACT, B, STEPS = 3, 1, 8, 3
LOW, HIGH = np.array([-2.0], np.float32), np.array([2.0], np.float32)


def batches() -> list[np.ndarray]:
    """STEPS global batches of 2B rows (obs, action, reward, discount, next obs); replica r of 2 takes rows
    [rB, (r+1)B)."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(STEPS):
        o, o2 = rng.normal(size=(2 * B, OBS)), rng.normal(size=(2 * B, OBS))
        a = rng.uniform(-2, 2, size=(2 * B, ACT))
        r = rng.uniform(-16, 0, size=(2 * B, 1))
        d = rng.choice([0.0, 0.99 ** 3], size=(2 * B, 1))
        out.append(np.concatenate([o, a, r, d, o2], 1).astype(np.float32))
    return out
