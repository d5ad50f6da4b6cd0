"""hvrep's own reductions skip Horovod's fusion window; a user's own all-reduces keep it (run by test_horovod_flush.py).

``FLUSH_PROBE_MODE=flush``, run with a ``HOROVOD_CYCLE_TIME`` of seconds: a step of ``hvrep.all_reduce``, a
``wrap_optimizer`` step and two PowerSGD steps, exact (the sum, the mean applied, PowerSGD's numpy simulation);
the second call of the first two (traced already: only the step's own all-reduce goes to Horovod) is timed. Were
it to wait Horovod's fusion window it would take the cycle time; hvrep's build ends the window when one of
hvrep's pre-fused reductions is enqueued (hvrep/compat/horovod_patches.py, FLUSH_PATCHES). The Replicator's own
eager collectives (its set-up, the first call's checks) do wait it: an eager op's name does not reach Horovod.

``FLUSH_PROBE_MODE=fusion``: two of the user's own ``hvd.allreduce`` in one ``tf.function``, enqueued together,
with Horovod's timeline started at run time: the tensors Horovod fused into one response are those with a
``MEMCPY_IN_FUSION_BUFFER`` span. Each rank prints one JSON line.

    HOROVOD_CYCLE_TIME=4000 FLUSH_PROBE_MODE=flush horovodrun -np 2 -H localhost:2 --gloo \
        python tests/multirank/flush_probe.py
"""

import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvrep
from hvrep import compat

mode = os.environ["FLUSH_PROBE_MODE"]
repl = hvrep.Replicator("horovod")
rank = repl.rank
out: dict = {"rank": rank, "mode": mode, "cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME")}
t0 = time.perf_counter()
if mode == "flush":
    xs = [tf.constant(np.full(4096, 1.0 + rank, np.float32)), tf.constant(np.full(7, 10.0 * (rank + 1), np.float32))]

    def all_reduce_step(v):
        return hvrep.all_reduce(v, "sum")

    repl.run(all_reduce_step, args=(xs,))  # traced, checked
    t1 = time.perf_counter()
    sums = repl.run(all_reduce_step, args=(xs,))
    out["all_reduce"] = sorted({float(x) for s in sums for x in np.asarray(s)})
    out["all_reduce_s"] = time.perf_counter() - t1
    with repl.scope():
        var = keras.Variable(np.zeros(5, np.float32))
        opt = repl.wrap_optimizer(keras.optimizers.SGD(learning_rate=1.0))

    def apply(g):
        opt.apply_gradients([(g, var)])
        return tf.constant(0.0)

    g = tf.constant(np.full(5, 1.0 + rank, np.float32))
    repl.run(apply, args=(g,))
    t1 = time.perf_counter()
    repl.run(apply, args=(g,))
    out["wrap_optimizer_s"] = time.perf_counter() - t1
    out["wrap_optimizer"] = np.asarray(var.numpy()).tolist()  # twice -mean(1, 2) = -3
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import powersgd_sim as sim

    grads = sim.gradients(2)
    got, _, _ = sim.replicated(hvrep.Replicator("horovod", config=sim.config(2)), grads)
    out["powersgd_error"] = sim.max_error([g[0] for g in got], sim.simulate(grads, 2))
else:
    hvd = compat.import_horovod()
    # Rank 0 writes Horovod's timeline (HOROVOD_TIMELINE=DYNAMIC: started and stopped here); the path must be
    # the same on every rank.
    path = Path(os.environ["FLUSH_PROBE_DIR"]) / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=False)

    @tf.function
    def user_step(a, b):
        return (hvd.allreduce(a, op=hvd.Sum, name="user_a"), hvd.allreduce(b, op=hvd.Sum, name="user_b"))

    a, b = user_step(tf.constant([1.0 + rank] * 3), tf.constant([2.0 + rank] * 5))
    out["user_sums"] = [float(a[0]), float(b[0])]
    hvd.stop_timeline()
    if rank == 0:
        text = path.read_text().strip().rstrip(",")
        events = json.loads(text if text.endswith("]") else text + "]")
        # The timeline names each tensor's row in a metadata event; its activities refer to the row by pid.
        rows = {e["pid"]: e.get("args", {}).get("name", "?") for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name"}
        fused = {rows.get(e.get("pid"), "?") for e in events if e.get("name") == "MEMCPY_IN_FUSION_BUFFER"}
        out["fused"] = sorted(n for n in fused if "user_" in n)
        out["activities"] = sorted({e.get("name", "?") for e in events if e.get("ph") == "B"})
out["seconds"] = round(time.perf_counter() - t0, 2)
print("FLUSH_PROBE " + json.dumps(out), flush=True)
