"""hvrep: write the training step for one replica, run it on many.

This module only re-exports; see the submodules for the code.
"""

from hvrep import compat as _compat
from hvrep import errors
from hvrep._version import __version__
from hvrep.placement import Placement, resolve_placement

# GPU (NCCL) builds of Horovod need the stream shim loaded before
# horovod.tensorflow; doing it here lets users `import hvrep` and then import
# Horovod themselves. A no-op on CPU builds.
_compat.load_runtime_shim()

from hvrep import kernels, layers, models, optimizers, recipes, schedules  # noqa: E402
from hvrep.backends.base import InputContext  # noqa: E402
from hvrep.collectives import all_gather, all_reduce, broadcast, num_replicas, replica_id  # noqa: E402
from hvrep.config import CommConfig  # noqa: E402
from hvrep.replicator import Replicator  # noqa: E402

__all__ = [
    "CommConfig",
    "InputContext",
    "Placement",
    "Replicator",
    "__version__",
    "all_gather",
    "all_reduce",
    "broadcast",
    "errors",
    "kernels",
    "layers",
    "models",
    "num_replicas",
    "optimizers",
    "recipes",
    "replica_id",
    "resolve_placement",
    "schedules",
]
