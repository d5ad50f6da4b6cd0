"""``hvrep train`` whose training step kills its own process with SIGSEGV (a stand-in for a native crash).

Usage: python segv_in_step.py RANK STEP hvrep-train-args...: the rank RANK (of mpirun or horovodrun; 0 alone)
sends the thread running its STEP-th training step SIGSEGV (counted from 1), from inside the compiled
step (a ``tf.py_function`` the step runs before its forward pass).
"""

import os
import signal
import sys
import threading

import tensorflow as tf

from hvrep.train import steps
from hvrep.train.main import main

die_rank, die_step = int(sys.argv[1]), int(sys.argv[2])
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("HOROVOD_RANK") or 0)
executed = 0


def _tick() -> int:
    global executed
    executed += 1
    if rank == die_rank and executed == die_step:
        # To this thread, as a native crash is delivered to the thread that faults. os.kill's signal goes to any
        # thread of the process, and one interrupted in the middle of building a Python frame can cut
        # faulthandler's dump short before it reaches this stack (CI, 2026-11-29: "File ???", then nothing).
        signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)
    return executed


_train_step = steps.Runner._train_step


def _dying_train_step(self, x, y):
    with tf.control_dependencies([tf.py_function(_tick, [], tf.int64)]):
        x = tf.identity(x)
    return _train_step(self, x, y)


steps.Runner._train_step = _dying_train_step
sys.exit(main(sys.argv[3:]))
