"""hvrep: write the training step for one replica, run it on many.

This module only re-exports; see the submodules for the code. Names that
need TensorFlow (everything but ``errors``, ``Placement``,
``resolve_placement`` and ``__version__``) are imported on first use, so
``hvrep --help``, ``hvrep doctor --quick``, ``hvrep launch`` and
``hvrep report`` start in a fraction of a second instead of paying
TensorFlow's import (5 s and more).
"""

import importlib
from typing import Any

from hvrep import compat as _compat
from hvrep import errors
from hvrep._version import __version__
from hvrep.replica.placement import Placement, resolve_placement

# GPU (NCCL) builds of Horovod need the stream shim loaded before
# horovod.tensorflow; doing it here lets users `import hvrep` and then import
# Horovod themselves. A no-op on CPU builds (no shim: TensorFlow is not imported).
_compat.load_runtime_shim()

# name -> (module, attribute; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "CommConfig": ("hvrep.replica.comm", "CommConfig"),
    "InputContext": ("hvrep.replica.context", "InputContext"),
    "Replicator": ("hvrep.replica.api", "Replicator"),
    "all_gather": ("hvrep.replica.collectives", "all_gather"),
    "all_reduce": ("hvrep.replica.collectives", "all_reduce"),
    "broadcast": ("hvrep.replica.collectives", "broadcast"),
    "num_replicas": ("hvrep.replica.collectives", "num_replicas"),
    "replica_devices": ("hvrep.replica.context", "replica_devices"),
    "replica_id": ("hvrep.replica.collectives", "replica_id"),
    "elastic": ("hvrep.elastic", None),
    "keras": ("hvrep.keras", None),
    "kernels": ("hvrep.kernels", None),
    "layers": ("hvrep.layers", None),
    "models": ("hvrep.models", None),
    "optimizers": ("hvrep.optimizers", None),
    "recipes": ("hvrep.recipes", None),
    "schedules": ("hvrep.schedules", None),
}

__all__ = [
    "CommConfig",
    "InputContext",
    "Placement",
    "Replicator",
    "__version__",
    "all_gather",
    "all_reduce",
    "broadcast",
    "elastic",
    "errors",
    "keras",
    "kernels",
    "layers",
    "models",
    "num_replicas",
    "optimizers",
    "recipes",
    "replica_devices",
    "replica_id",
    "resolve_placement",
    "schedules",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'hvrep' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
