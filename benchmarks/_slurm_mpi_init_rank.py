"""One rank of benchmarks/slurm_mpi_init.py: Horovod's start-up as plain Horovod does it, or as hvrep does it.

    srun --mpi=pmix python benchmarks/_slurm_mpi_init_rank.py horovod|mpi4py

``horovod``: ``hvd.init()`` starts MPI in Horovod's background thread. ``mpi4py``: ``from mpi4py import MPI``
starts it in the main thread first (MPI_THREAD_MULTIPLE), as hvrep's horovod backend does under an MPI
launcher. Both import TensorFlow first, as hvrep does, then all-reduce once and print ``ok rank=...``.
"""

import sys

variant = sys.argv[1]
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

if variant == "mpi4py":
    from mpi4py import MPI

    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
elif variant != "horovod":
    raise SystemExit(f"variant {variant!r}: expected horovod or mpi4py")
hvd.init()
s = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
print(f"ok rank={hvd.rank()} size={hvd.size()} sum={float(s[0])}", flush=True)
