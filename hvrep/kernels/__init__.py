"""hvrep's fused kernels (kernels/ in the repository) and their pure-TF references.

Three ops for training, each with a CPU kernel, a CUDA kernel and a reference written in
plain TensorFlow that gives the same result:

* :func:`fused_lars_apply`: one LARS step (``hvrep.optimizers.LARS``) for a
  whole list of variables and their momentum slots, in one op instead of
  about ten per variable.
* :func:`pack` / :func:`unpack`: a list of tensors to one rank-1 buffer and
  back, with a cast (e.g. to fp16 for the wire) and a scale (e.g. 1/N before a
  sum across N replicas), for the fused all-reduce (``hvrep.replica.fusion``).

And the hang watchdog's two marker ops (``watch.py``, CPU only, no reference: where they are not loaded the
watchdog marks collectives with ``tf.py_function``). One file per op family (``lars.py``, ``packing.py``,
``watch.py``) and one that finds and loads the built library (``loader.py``).

The kernels are built by ``make setup`` (``python kernels/build.py``) into
``hvrep/_lib``. Where they were not built, could not load, are switched off
(``HVREP_KERNELS=off``) or cannot run (inside an XLA cluster; a GPU variable
without the CUDA library), every function here runs its reference instead:
hvrep always works. :func:`status` (and ``hvrep doctor``) says which path is
active and why.
"""

from hvrep.kernels.lars import LARS_DTYPES, fused_lars_apply, lars_update, reference_lars_apply
from hvrep.kernels.loader import CPU_LIB, CUDA_LIB, LIB_DIR, KernelStatus, available, gpu_problem, status, tf_identity
from hvrep.kernels.packing import PACK_DTYPES, align_for, pack, packed_length, reference_pack, reference_unpack, unpack

__all__ = [
    "CPU_LIB",
    "CUDA_LIB",
    "LARS_DTYPES",
    "LIB_DIR",
    "PACK_DTYPES",
    "KernelStatus",
    "align_for",
    "available",
    "fused_lars_apply",
    "gpu_problem",
    "lars_update",
    "pack",
    "packed_length",
    "reference_lars_apply",
    "reference_pack",
    "reference_unpack",
    "status",
    "tf_identity",
    "unpack",
]
