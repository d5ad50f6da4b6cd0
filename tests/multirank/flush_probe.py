"""hvrep's own reductions skip Horovod's fusion window; a user's own all-reduces keep it (run by test_horovod_flush.py).

``FLUSH_PROBE_MODE=flush``, run with ``HOROVOD_CYCLE_TIME`` of minutes: a step of ``hvrep.all_reduce``, a
``wrap_optimizer`` step and two PowerSGD steps, each of which, were it to wait Horovod's fusion window, would
wait minutes (hvrep's build ends the window when one of hvrep's pre-fused reductions is enqueued:
hvrep/compat/horovod_patches.py, FLUSH_PATCHES). Their results are exact: the sum, the mean applied, PowerSGD's
numpy simulation.

``FLUSH_PROBE_MODE=fusion``: two of the user's own ``hvd.allreduce`` in one ``tf.function``, enqueued together,
with Horovod's timeline started at run time: the tensors Horovod fused into one response are those with a
``MEMCPY_IN_FUSION_BUFFER`` span. Each rank prints one JSON line.

    HOROVOD_CYCLE_TIME=600000 FLUSH_PROBE_MODE=flush horovodrun -np 2 -H localhost:2 --gloo \
        python tests/multirank/flush_probe.py
"""

import json
import os
import sys
import tempfile
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
    sums = repl.run(lambda v: hvrep.all_reduce(v, "sum"), args=(xs,))
    out["all_reduce"] = sorted({float(x) for s in sums for x in np.asarray(s)})
    with repl.scope():
        var = keras.Variable(np.zeros(5, np.float32))
        opt = repl.wrap_optimizer(keras.optimizers.SGD(learning_rate=1.0))

    def apply(g):
        opt.apply_gradients([(g, var)])
        return tf.constant(0.0)

    repl.run(apply, args=(tf.constant(np.full(5, 1.0 + rank, np.float32)),))
    out["wrap_optimizer"] = np.asarray(var.numpy()).tolist()  # -mean(1, 2) = -1.5
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import powersgd_sim as sim

    grads = sim.gradients(2)
    got, _, _ = sim.replicated(hvrep.Replicator("horovod", config=sim.config(2)), grads)
    out["powersgd_error"] = sim.max_error([g[0] for g in got], sim.simulate(grads, 2))
else:
    hvd = compat.import_horovod()
    with tempfile.TemporaryDirectory(prefix="flush-probe-") as tmp:
        path = Path(tmp) / "timeline.json"
        hvd.start_timeline(str(path), mark_cycles=False)

        @tf.function
        def user_step(a, b):
            return (hvd.allreduce(a, op=hvd.Sum, name="user_a"), hvd.allreduce(b, op=hvd.Sum, name="user_b"))

        a, b = user_step(tf.constant([1.0 + rank] * 3), tf.constant([2.0 + rank] * 5))
        out["user_sums"] = [float(a[0]), float(b[0])]
        hvd.stop_timeline()
        text = path.read_text().strip().rstrip(",")
        events = json.loads(text if text.endswith("]") else text + "]")
    # The timeline names each tensor's row in a metadata event; activities refer to the row by its tid/pid.
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    fused = {rows.get(e.get("pid"), "?") for e in events if e.get("name") == "MEMCPY_IN_FUSION_BUFFER"}
    out["fused"] = sorted(n for n in fused if "user_" in n)
out["seconds"] = round(time.perf_counter() - t0, 2)
print("FLUSH_PROBE " + json.dumps(out), flush=True)
