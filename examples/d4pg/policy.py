"""The deterministic policy's shape, and its forward pass in NumPy (what an actor runs; no TensorFlow).

The learner's Keras policy (``agent.build_policy``) and this function agree on one layout: dense layers
``obs_dim -> hidden... -> act_dim``, ReLU between them, ``tanh`` at the end scaled to the action bounds. The
weights travel as one flat float32 vector in the order ``W1, b1, W2, b2, ...`` (Keras' ``Dense`` kernel is
(inputs, units)).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def layer_shapes(obs_dim: int, act_dim: int, hidden: Sequence[int]) -> list[tuple[int, ...]]:
    """The shapes of the flat vector's pieces, in order: kernel (in, out), then bias (out,), per layer."""
    sizes = [obs_dim, *hidden, act_dim]
    shapes: list[tuple[int, ...]] = []
    for n_in, n_out in itertools.pairwise(sizes):
        shapes += [(n_in, n_out), (n_out,)]
    return shapes


def num_weights(obs_dim: int, act_dim: int, hidden: Sequence[int]) -> int:
    return sum(int(np.prod(s)) for s in layer_shapes(obs_dim, act_dim, hidden))


def unflatten(flat: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Views of ``flat`` with ``shapes`` (the layout of :func:`layer_shapes`)."""
    out, at = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(flat[at:at + n].reshape(s))
        at += n
    return out


def act(weights: Sequence[np.ndarray], obs: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The deterministic action for ``obs`` (obs_dim,) or (N, obs_dim), in [low, high]."""
    x = obs.astype(np.float32)
    layers = len(weights) // 2
    for i in range(layers):
        x = x @ weights[2 * i] + weights[2 * i + 1]
        if i < layers - 1:
            x = np.maximum(x, 0.0)
    return low + (np.tanh(x) + 1.0) * 0.5 * (high - low)
