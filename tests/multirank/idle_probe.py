"""What Horovod's background thread does while no rank has a tensor to reduce (run by test_horovod_idle.py).

On 2 ranks: a Replicator starts Horovod, one reduce runs, then both ranks sleep 1 s with nothing enqueued while
the process's context switches (every thread's, from /proc/self/task/*/status) and CPU time are counted. Stock
Horovod 0.28.1 runs a cycle every millisecond regardless, each one a collective among the ranks (under Gloo, TCP
wake-ups of two threads); hvrep's build waits for work (hvrep/compat/horovod_patches.py). Then a reduce after
the idle second (the waiting thread wakes for it, with the right sum), one with rank 1 arriving 0.3 s late (rank
0's thread waits in the cycle's collective for it), 3 reduces on rank 0 while rank 1 has joined (``hvd.join()``),
and ``hvd.shutdown()``. Each rank prints one JSON line.

    horovodrun -np 2 -H localhost:2 --gloo python tests/multirank/idle_probe.py
"""

import json
import os
import resource
import time

import tensorflow as tf

import hvrep
from hvrep import compat


def switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except OSError:  # the thread ended meanwhile
            pass
    return total


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


repl = hvrep.Replicator("horovod")
first = float(repl.reduce(tf.constant(float(repl.rank + 1)), "sum"))
time.sleep(0.2)  # let the reduce's cycles end
s0, c0, t0 = switches(), cpu_s(), time.perf_counter()
time.sleep(1.0)
s1, c1, t1 = switches(), cpu_s(), time.perf_counter()
after_idle = float(repl.reduce(tf.constant(10.0 * (repl.rank + 1)), "sum"))
if repl.rank == 1:
    time.sleep(0.3)
late = float(repl.reduce(tf.constant(100.0 * (repl.rank + 1)), "sum"))
hvd = compat.import_horovod()
# Uneven work: rank 1 joins at once while rank 0 reduces 3 more times (a joined rank answers with zeros, so it
# must keep answering cycles with nothing of its own pending).
joined = [float(hvd.allreduce(tf.constant(1000.0), op=hvd.Sum, name=f"uneven{i}")) for i in range(3 - 3 * repl.rank)]
last_joined = int(hvd.join())
hvd.shutdown()
print("HOROVOD_IDLE " + json.dumps({
    "rank": repl.rank, "switches_per_s": (s1 - s0) / (t1 - t0), "cpu_per_s": (c1 - c0) / (t1 - t0),
    "sums": [first, after_idle, late], "joined": joined, "last_joined": last_joined,
    "idle_wait_ms": os.environ.get("HVREP_HOROVOD_IDLE_WAIT_MS")}), flush=True)
