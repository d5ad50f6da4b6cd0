"""``model.fit`` on hvrep against ``model.fit`` in one process, shared by the in-process and multi-rank tests.

2 epochs of fit with N replicas x per-replica batch B (``hvrep.keras``) must
give the weights of 2 epochs of fit in one process with batch N x B (same
order, no shuffle) to 1e-5, and the same averaged epoch loss. The optimizer
kinds and the model are ``tests/fidelity.py``'s; each replica sees different
data, so a missing or doubled reduction shows.
"""

from __future__ import annotations

import keras
import numpy as np

import hvrep
import hvrep.keras
from tests import fidelity

EPOCHS, STEPS = 2, 3
B = fidelity.B


def data(num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    n = STEPS * num_replicas * B + 3  # 3 rows that cannot fill a global batch: dropped on every rank
    x = rng.normal(size=(n, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=(n,)).astype(np.int32)
    return x, y


def _compile(model: keras.Model, optimizer: keras.optimizers.Optimizer, **kwargs) -> None:
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **kwargs)


def reference(kind: str, num_replicas: int) -> tuple[list[np.ndarray], list[float]]:
    """Weights and per-epoch losses of fit in one process (no strategy), batch num_replicas x B."""
    x, y = data(num_replicas)
    gb = num_replicas * B
    rows = STEPS * gb
    model = fidelity.make_model()
    _compile(model, fidelity.make_optimizer(kind))
    history = model.fit(x[:rows], y[:rows], batch_size=gb, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.asarray(v.numpy()) for v in model.weights], history.history["loss"]


def replicated(repl: hvrep.Replicator, kind: str, *, init_seed: int = fidelity.SEED, in_scope: bool = True,
               steps_per_execution: int = 1, compile_kwargs: dict | None = None,
               optimizer: keras.optimizers.Optimizer | None = None) -> tuple[list[np.ndarray], dict]:
    """The same training through ``hvrep.keras``; returns the weights and fit's history (this process's)."""
    x, y = data(repl.num_replicas)
    build = repl.scope() if in_scope else _nothing()
    with build:
        model = fidelity.make_model(init_seed)
        opt = hvrep.keras.DistributedOptimizer(optimizer or fidelity.make_optimizer(kind), repl)
        _compile(model, opt, steps_per_execution=steps_per_execution, **(compile_kwargs or {}))
    xs, ys = hvrep.keras.shard_arrays((x, y), repl, B)
    callbacks = [hvrep.keras.callbacks.BroadcastGlobalVariablesCallback(repl),
                 hvrep.keras.callbacks.MetricAverageCallback(repl)]
    history = model.fit(xs, ys, batch_size=hvrep.keras.process_batch_size(repl, B), epochs=EPOCHS, shuffle=False,
                        verbose=0, callbacks=callbacks)
    return [np.asarray(v.numpy()) for v in model.weights], history.history


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
