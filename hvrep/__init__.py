"""hvrep: write the training step for one replica, run it on many.

This module only re-exports; see the submodules for the code.
"""

from hvrep import compat as _compat
from hvrep import errors
from hvrep._version import __version__
from hvrep.placement import Placement, resolve_placement

# GPU (NCCL) builds of Horovod need the stream shim loaded before
# horovod.tensorflow; doing it here lets users `import hvrep` and then import
# Horovod themselves. A no-op (and no TensorFlow import) on CPU builds.
_compat.load_runtime_shim()

__all__ = ["Placement", "__version__", "errors", "resolve_placement"]
