"""One elastic worker, through the replica API with hvrep.elastic.run (see test_elastic.py); run by horovodrun.

    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S --network-interface lo \
        python tests/multirank/elastic_worker.py --out DIR --hosts HOSTS_FILE

The script S prints HOSTS_FILE. The workers drive the scenario themselves, at fixed points, so the run is
the same every time:

1. two workers train epoch 0; at its step 7 (the last commit at step 5) rank 0 makes HOSTS_FILE list only the
   other worker's host, waits for the driver to read it, then SIGKILLs itself: the survivor rolls back 2 steps
   and goes on alone;
2. at the survivor's step 4 of the new world it lists both hosts again and commits (every 0.2 s) until the
   driver's news arrives: the new worker joins at that commit, without a rollback;
3. 4 steps later rank 0 lists only its own host and commits until the other host is dropped: it leaves
   without a rollback; the last worker finishes the epochs and exits 0.

Each worker appends to DIR/trained.<host>.<pid>.jsonl one line per step trained (the epoch, the step's place
in the epoch, the reset count, the world, the sample ids) and one per reset and per first step after a sync (a
digest of the weights); the test reads them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvrep
from hvrep.data.plan import EpochPlan, EpochPosition, Segment

N, GLOBAL_BATCH, EPOCHS, COMMIT_EVERY = 192, 8, 2, 5
HOSTS = ("localhost", "127.0.0.1")


def features(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A fixed, learnable toy problem: a sample is a function of its id."""
    x = np.stack([np.random.default_rng(int(i)).normal(size=4) for i in ids]).astype(np.float32)
    return x, (x.sum(1) > 0).astype(np.int32)


def digest(variables) -> str:
    return hashlib.sha256(b"".join(np.asarray(v.numpy()).tobytes() for v in variables)).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hosts", type=Path, required=True)
    args = parser.parse_args()
    me = os.environ["HOROVOD_HOSTNAME"]
    log = (args.out / f"trained.{me}.{os.getpid()}.jsonl").open("a")

    def record(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    repl = hvrep.Replicator()  # "auto": horovod under the elastic driver
    record(event="start", backend=repl.backend, rank=repl.rank, size=repl.num_replicas)
    with repl.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    state = hvrep.elastic.State(repl, model, optimizer, epoch=0, segments=[], step=0)
    state.register_reset_callbacks([lambda: record(event="reset", at=time.time(), size=repl.num_replicas,
                                                   why=state.resets[-1].why)])

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = hvrep.all_reduce(tape.gradient(loss, model.trainable_variables), "mean")
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def write_hosts(hosts) -> None:
        tmp = args.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}:1\n" for h in hosts))
        tmp.replace(args.hosts)

    def commit_until_update(what: str) -> None:
        record(event="waiting", what=what, at=time.time())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state.commit()  # raises HostsUpdatedInterrupt once the driver's news arrives
            time.sleep(0.2)
        raise RuntimeError(f"no host update arrived within 90 s after {what}")

    @hvrep.elastic.run
    def train(state):
        size, rank = repl.num_replicas, repl.rank
        # Which part of the scenario: the resets the longest-lived worker has seen (a joining one has seen none).
        phase = int(repl.reduce(tf.constant(len(state.resets)), "max"))
        record(event="synced", resets=len(state.resets), world=phase, rank=rank, size=size, at=time.time(),
               weights=digest(state.variables),
               step=state.step, last_reset=[r.why for r in state.resets][-1:],
               rolled_back=state.resets[-1].rolled_back if state.resets else {})
        since_reset = 0
        while state.epoch < EPOCHS:
            plan = EpochPlan([N], seed=100 + state.epoch)
            segments = [Segment.from_json(s) for s in state.segments]
            position = EpochPosition.resume(segments, size, GLOBAL_BATCH)
            batch = GLOBAL_BATCH // size
            share = plan.share(rank, size, batch, position)
            before = sum(s.steps for s in position.done)
            for k in range(share.steps):
                ids = share.ids[k * batch:(k + 1) * batch]
                x, y = features(ids)
                repl.run(step_fn, args=(tf.constant(x), tf.constant(y)))
                state.step += 1
                since_reset += 1
                state.segments = [s.to_json() for s in position.segments(size, GLOBAL_BATCH, position.steps + k + 1)]
                record(event="step", epoch=state.epoch, k=before + position.steps + k, world=phase,
                       rank=rank, size=size, ids=ids.tolist())
                if phase == 0 and state.step == 7 and rank == 0:
                    write_hosts([h for h in HOSTS if h != me])
                    # The driver reads the script every second: once it no longer lists this host, the blacklist's
                    # cooldown cannot let it straight back in the failure's own reset.
                    time.sleep(2.5)
                    record(event="killing", at=time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
                if phase == 1 and since_reset == 4:
                    write_hosts(HOSTS)
                    commit_until_update("adding a host")
                if phase == 2 and since_reset == 4 and rank == 0:
                    write_hosts([me])
                if phase == 2 and since_reset >= 4:
                    commit_until_update("dropping a host")
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.segments = []
            state.commit()
        record(event="done", resets=[r.__dict__ for r in state.resets], rank=repl.rank, size=repl.num_replicas,
               weights=digest(state.variables), step=state.step, at=time.time())

    train(state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
