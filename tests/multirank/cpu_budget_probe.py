"""A Replicator's default CPU budget, seen from inside a rank (run by test_cpu_budget.py on 2 ranks).

Creates ``hvrep.Replicator()`` before any TensorFlow op, runs one step and one reduce (so TensorFlow's pools and
Horovod's thread exist), then prints one JSON line per rank: the pools' sizes, the budget the Replicator chose,
and the cores every thread of the process may run on.
"""

import json
import os

import tensorflow as tf

import hvrep

repl = hvrep.Replicator()
repl.reduce(repl.run(lambda: hvrep.all_reduce(tf.ones([64, 64]) @ tf.ones([64, 64]), "sum")), "sum")
threads = {}
for tid in os.listdir("/proc/self/task"):
    try:
        threads[tid] = sorted(os.sched_getaffinity(int(tid)))
    except ProcessLookupError:  # ended meanwhile
        pass
budget = getattr(repl, "cpu_budget", None)  # None: a Replicator without one
print("CPU_BUDGET " + json.dumps({
    "rank": repl.rank, "local_size": repl.local_size,
    "intra": tf.config.threading.get_intra_op_parallelism_threads(),
    "inter": tf.config.threading.get_inter_op_parallelism_threads(),
    "budget": None if budget is None else {"threads": budget.threads, "bind": budget.bind, "why": budget.why},
    "threads": threads}), flush=True)
