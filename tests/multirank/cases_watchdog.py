"""hvrep's watchdog under a real launcher, against a peer that can reach its port but holds no secret.

Rank 0 starts tests/multirank/attacker.py, a process of its own that gets only the watchdog's host and
port, while both ranks train with ``run`` and with Keras' ``fit`` (whose collectives the watchdog watches
too). The job must go on as if nothing happened: every step completes, no rank exits, the attack is counted
and dropped. test_multirank.py checks that the launch exits 0 and that nothing the attacker sent
(``MARKER``) is in its output. Runs last of the case files (alphabetical), as it leaves no state behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvrep
import hvrep.keras
from hvrep.replica import watchdog

MARKER = "INJECTED-by-a-peer-without-the-secret"
ATTACKER = Path(__file__).resolve().parent / "attacker.py"


def case_a_peer_without_the_secret_changes_nothing():
    repl = hvrep.Replicator("horovod")  # the default comm.timeout_s: a watchdog on every rank
    dog = watchdog.current()
    assert dog is not None
    with repl.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
        fitted = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        fitted.compile(optimizer=hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.01), repl), loss="mse")

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = hvrep.all_reduce(tape.gradient(loss, model.trainable_variables), "mean")
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    x = np.random.default_rng(repl.rank).normal(size=(64, 4)).astype(np.float32)
    # Traced before the attack, so that the attack overlaps steps rather than tracing.
    repl.run(step, args=(tf.constant(x[:8]),))
    fitted.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
    attacker = None
    if repl.is_chief:
        host, port = dog.address
        attacker = subprocess.Popen([sys.executable, str(ATTACKER), host, str(port), "--seconds", "8", "--marker",
                                     MARKER], stdout=subprocess.PIPE, text=True)
    steps, t0 = 0, time.monotonic()
    # Every rank trains until rank 0's attacker is done (one reduce a round decides it for all).
    while repl.reduce(tf.constant(int(attacker is not None and attacker.poll() is None)), "max"):
        repl.run(step, args=(tf.constant(x[:8]),))
        fitted.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
        steps += 1
        if time.monotonic() - t0 > 60:
            raise AssertionError("the attacker did not finish within 60 s")
    assert steps >= 3, steps
    if attacker is not None:
        sent = attacker.communicate(timeout=30)[0]
        assert '"forged_lines"' in sent, sent
        # Dropped and counted, not acted on: the watchdog still runs and has reached no verdict.
        assert dog.rejected_total >= 50, dog.rejected_total
        assert dog._verdict is None and not dog._ended
    assert watchdog.current() is dog
