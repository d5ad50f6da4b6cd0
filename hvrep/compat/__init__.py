"""The one place hvrep bridges Horovod 0.28.1 and TensorFlow 2.21.

Horovod's last release predates TF 2.16; the pieces in this folder (see
README.md here) let it build and run against the pinned TensorFlow; the one
change to Horovod's sources is for speed (``horovod_patches.py``: its background
thread waits for work instead of cycling). At run time only one piece matters: the stream
shim of GPU (NCCL) builds, which must be loaded after TensorFlow and before
``horovod.tensorflow``. :func:`import_horovod` does that, and ``import hvrep``
calls :func:`load_runtime_shim` so users who import Horovod themselves after
hvrep get it too.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from types import ModuleType

HOROVOD_VERSION = "0.28.1"

_HERE = Path(__file__).resolve().parent
INCLUDE_DIR = _HERE / "include"
# Always on the include path: headers TensorFlow moved.
FORWARD_INCLUDE_DIR = INCLUDE_DIR / "forward"
# On the include path only when Debian's libfarmhash-dev/libhighwayhash-dev
# are absent (no root, as on most clusters).
STANDIN_INCLUDE_DIR = INCLUDE_DIR / "standins"
# Force-included into GPU builds only.
GPU_COMPAT_HEADER = INCLUDE_DIR / "gpu" / "hvrep_gpu_compat.h"
STREAM_SHIM_SOURCE = _HERE / "stream_shim.cc"

# Where build_horovod.py puts the compiled shim: inside the environment that
# holds the Horovod it was built for, so a venv and its shim travel together.
SHIM_NAME = "libhvrep_tf_stream_shim.so"


def shim_path(prefix: str | os.PathLike[str] | None = None) -> Path:
    """Path of the stream shim for the environment at ``prefix`` (default: this one)."""
    return Path(prefix or sys.prefix) / "lib" / "hvrep-compat" / SHIM_NAME


_shim_loaded = False


def load_runtime_shim() -> bool:
    """Loads the stream shim if this environment's Horovod needs one.

    Imports TensorFlow first (the shim resolves its symbols against it), and
    only when a shim exists, so CPU builds do not pay for a TensorFlow import.

    Returns:
      True if the shim is loaded (now or before), False if there is none.
    """
    global _shim_loaded
    if _shim_loaded:
        return True
    path = shim_path()
    if not path.is_file():
        return False
    import tensorflow  # noqa: F401  (must precede the shim, see stream_shim.cc)

    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    _shim_loaded = True
    return True


def import_horovod() -> ModuleType:
    """Imports ``horovod.tensorflow`` with the shim in place.

    Raises:
      hvrep.errors.SetupError: Horovod is not installed in this environment.
    """
    from hvrep.errors import SetupError

    load_runtime_shim()
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise SetupError(
            f"horovod.tensorflow cannot be imported ({e}). Fix: run `make setup`, which builds "
            f"Horovod {HOROVOD_VERSION} against this TensorFlow."
        ) from e
    return hvd


def in_xla_context() -> bool:
    """True while TF is tracing code that XLA will compile (``jit_compile=True``).

    hvrep's custom ops have no XLA kernels, so their callers take the pure-TF
    path there. TF has no public way to ask; this is its internal helper,
    which exists unchanged from TF 2.4 to 2.21.
    """
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
