"""Rank 0 reduces in a process set of its own while rank 1 has nothing to do (run by test_horovod_idle.py).

Horovod started with a second process set, [0]. Rank 0 times 30 all-reduces in it while rank 1 sleeps with
nothing enqueued; then both meet in a global all-reduce. Each of rank 0's cycles also runs the global set's
coordination, which rank 1 must answer: a rank 1 that waited for work would hold each cycle up to
``HVREP_HOROVOD_IDLE_WAIT_MS``. Each rank prints one JSON line.

    horovodrun -np 2 -H localhost:2 --gloo python tests/multirank/process_set_probe.py
"""

import json
import os
import time

import tensorflow as tf

from hvrep import compat

hvd = compat.import_horovod()
alone = hvd.ProcessSet([0])
hvd.init(process_sets=[alone])
rank = hvd.rank()
hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="warm")
seconds, sums = None, []
if rank == 0:
    hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="alone_warm", process_set=alone)
    start = time.perf_counter()
    sums = [float(hvd.allreduce(tf.constant(float(i)), op=hvd.Sum, name=f"alone{i}", process_set=alone))
            for i in range(30)]
    seconds = time.perf_counter() - start
else:
    time.sleep(1.5)  # nothing enqueued here while rank 0 reduces on its own
together = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="together"))
hvd.shutdown()
print("PROCESS_SET " + json.dumps({"rank": rank, "seconds": seconds, "sums": sums, "together": together,
                                   "idle_wait_ms": os.environ.get("HVREP_HOROVOD_IDLE_WAIT_MS")}), flush=True)
