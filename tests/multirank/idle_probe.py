"""What Horovod's background thread does while no rank has a tensor to reduce (run by test_horovod_idle.py).

On 2 ranks: a Replicator starts Horovod, one reduce runs, then both ranks sleep 1 s with nothing enqueued while
the process's context switches (every thread's, from /proc/self/task/*/status) and CPU time are counted. Stock
Horovod 0.28.1 runs a cycle every millisecond regardless, each one a collective among the ranks (under Gloo, TCP
wake-ups of two threads); hvrep's build waits for work (hvrep/compat/horovod_patches.py). Then a reduce after
the idle second (the waiting thread wakes for it, with the right sum), one with rank 1 arriving 0.3 s late (rank
0's thread waits in the cycle's collective for it), and ``hvd.shutdown()``. Each rank prints one JSON line.

    horovodrun -np 2 -H localhost:2 --gloo python tests/multirank/idle_probe.py
"""

import json
import os
import resource
import time

import tensorflow as tf

import hvrep


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
from horovod.tensorflow import shutdown  # noqa: E402 - hvrep imported Horovod through its compat layer

s_start = time.perf_counter()
shutdown()
print("HOROVOD_IDLE " + json.dumps({
    "rank": repl.rank, "switches_per_s": (s1 - s0) / (t1 - t0), "cpu_per_s": (c1 - c0) / (t1 - t0),
    "sums": [first, after_idle, late], "shutdown_s": time.perf_counter() - s_start,
    "idle_wait_ms": os.environ.get("HVREP_HOROVOD_IDLE_WAIT_MS")}), flush=True)
