"""TF-Replicator's ``wrap_optimizer``: an optimizer whose apply_gradients all-reduces first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hvrep import collectives


class CrossReplicaOptimizer:
    """Wraps a Keras optimizer: ``apply_gradients`` averages the gradients across replicas first.

    Everything else (``learning_rate``, ``iterations``, ``variables``, checkpointing
    through ``.inner``) is the wrapped optimizer's. Use it from inside
    ``Replicator.run`` like the optimizer itself.
    """

    def __init__(self, optimizer: Any) -> None:
        self.inner = optimizer

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        grads = collectives.all_reduce([g for g, _ in pairs], "mean")
        return self.inner.apply_gradients(zip(grads, [v for _, v in pairs], strict=True), **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
