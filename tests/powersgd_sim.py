"""PowerSGD's checks shared by the in-graph and multi-rank tests: a NumPy simulation of Vogels et al.'s
Algorithm 1 (with error feedback and warm start) for W workers, and the same gradients reduced through hvrep.

The simulation is written from the paper, not from hvrep's code: P = mean_w(M_w Q), P^ = Gram-Schmidt(P),
Q = mean_w(M_w^T P^), M^ = P^ Q^T, e_w = M_w - M^. Only the random draws of Q (a zero Q at the first step,
or after a zero gradient) come from hvrep (``hvrep.replica.powersgd.random_q``): the RNG is not the algorithm.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import hvrep
from hvrep.replica import powersgd
from hvrep.replica.comm import powersgd_matrix

STEPS = 5
# A Dense kernel, a Conv2D kernel ([3*3*2, 4]), a bias (exact) and a wide matrix.
SHAPES = [(6, 5), (3, 3, 2, 4), (5,), (3, 7)]


def gradients(workers: int, zero_first: int | None = None) -> np.ndarray:
    """grads[step][worker][variable]: different on every worker and step (``zero_first``: that variable's gradient
    is 0 on every worker at step 0, as a zero-initialised gamma's layer gets)."""
    rng = np.random.default_rng(38)
    out = [[[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(workers)] for _ in range(STEPS)]
    if zero_first is not None:
        for w in range(workers):
            out[0][w][zero_first] = np.zeros(SHAPES[zero_first], np.float32)
    return out


def config(rank: int, **kw) -> hvrep.CommConfig:
    return hvrep.CommConfig(compression="powersgd", powersgd_rank=rank, powersgd_min_compression_rate=0, **kw)


def _gram_schmidt(p: np.ndarray) -> np.ndarray:
    out = np.zeros_like(p)
    for j in range(p.shape[1]):
        c = p[:, j].copy()
        for k in range(j):
            c -= (out[:, k] @ c) * out[:, k]
        norm = np.linalg.norm(c)
        out[:, j] = c / norm if norm > 0 else 0.0
    return out


class Algorithm1:
    """Algorithm 1 for ``workers`` workers, one step at a time: :meth:`step` takes every worker's gradients of
    ``shapes`` and returns what every worker receives; ``errors[w][i]`` and ``qs[i]`` are its state (float64)."""

    def __init__(self, shapes, workers: int, rank: int, error_feedback: bool = True, warm_start: bool = True,
                 start_step: int = 0) -> None:
        self.shapes, self.workers, self.error_feedback, self.warm_start = list(shapes), workers, error_feedback, \
            warm_start
        self.start_step, self.t = start_step, 0
        self.plans = [powersgd_matrix(s, rank, 0) for s in self.shapes]
        self.errors = [[None if p is None else np.zeros(p[:2]) for p in self.plans] for _ in range(workers)]
        self.qs = [None if p is None else np.zeros((p[1], p[2])) for p in self.plans]

    def step(self, grads) -> list[np.ndarray]:
        """``grads[worker][variable]`` -> the reduced gradient of every variable (float64); before
        ``start_step`` the exact mean (PyTorch's start_powerSGD_iter)."""
        errors, qs, t = self.errors, self.qs, self.t
        step_out = []
        for i, p in enumerate(self.plans):
            gs = [np.asarray(grads[w][i], np.float64) for w in range(self.workers)]
            if p is None or t < self.start_step:
                step_out.append(np.mean(gs, axis=0))
                continue
            rows, cols, r = p
            ms = [g.reshape(rows, cols) + (errors[w][i] if self.error_feedback else 0) for w, g in enumerate(gs)]
            draw = powersgd.random_q(cols, r, i, t).numpy().astype(np.float64)
            if self.warm_start:
                q = qs[i].copy()
                norms = np.linalg.norm(q, axis=0)
                bad = ~(norms > 1e-6 * norms.max())  # a column with no direction is redrawn
                q[:, bad] = draw[:, bad]
            else:
                q = draw
            p_hat = _gram_schmidt(np.mean([m @ q for m in ms], axis=0))
            q = np.mean([m.T @ p_hat for m in ms], axis=0)
            approx = p_hat @ q.T
            for w in range(self.workers):
                errors[w][i] = ms[w] - approx
            qs[i] = q
            step_out.append(approx.reshape(self.shapes[i]))
        self.t += 1
        return step_out


def simulate(grads, rank: int, error_feedback: bool = True, warm_start: bool = True,
             start_step: int = 0) -> list[list[np.ndarray]]:
    """What every worker receives at each step: out[step][variable] (float64); before ``start_step`` the exact
    mean (PyTorch's start_powerSGD_iter)."""
    algorithm = Algorithm1(SHAPES, len(grads[0]), rank, error_feedback, warm_start, start_step)
    return [algorithm.step(grads[t]) for t in range(STEPS)]


def replicated(repl: hvrep.Replicator, grads, state=None) -> tuple[list[list[list[np.ndarray]]], object, int]:
    """Reduces every step's gradients through ``hvrep.all_reduce(..., powersgd=state)`` on ``repl``.

    Returns out[step][replica of this process][variable], the state, and the bytes the first step's trace asked
    the backend to reduce (over the replicas this process traces).
    """
    n = repl.num_replicas
    with repl.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
        if state is None:
            state = powersgd.PowerSGDState(variables, repl.config, n)
    me = repl.rank  # horovod: this rank's gradients; in-graph: picked per replica below

    def step(stacked):
        who = hvrep.replica_id() if repl.num_processes == 1 else 0
        mine = [tf.gather(s, who) for s in stacked]
        return hvrep.all_reduce(mine, "mean", compress=True, powersgd=state)

    out, before, traced = [], repl.collective_bytes, None
    for t in range(len(grads)):
        rows = range(n) if repl.num_processes == 1 else [me]
        stacked = [tf.constant(np.stack([grads[t][w][i] for w in rows])) for i in range(len(SHAPES))]
        result = repl.run(step, args=(stacked,))
        if traced is None:
            traced = repl.collective_bytes - before
        strategy = getattr(repl._backend, "strategy", None)
        per = [strategy.experimental_local_results(r) if strategy else (r,) for r in result]
        out.append([[np.asarray(per[i][k]) for i in range(len(SHAPES))] for k in range(len(per[0]))])
    return out, state, traced


def factor_bytes(rank: int) -> tuple[int, int]:
    """(bytes of the P's, Q's and exact tensors one replica sends per step; bytes of the full gradients)."""
    compressed, full = 0, 0
    for s in SHAPES:
        full += 4 * int(np.prod(s))
        p = powersgd_matrix(s, rank, 0)
        compressed += 4 * (int(np.prod(s)) if p is None else (p[0] + p[1]) * p[2])
    return compressed, full


def max_error(got_steps, want_steps) -> float:
    return max(float(np.max(np.abs(g - w))) for gs, ws in zip(got_steps, want_steps, strict=True)
               for g, w in zip(gs, ws, strict=True))
