"""One elastic worker, through the replica API with hvrep.elastic.run (see test_elastic.py); run by horovodrun.

    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S --network-interface lo \
        python tests/multirank/elastic_worker.py --out DIR --hosts HOSTS_FILE
    # on 3 namespace hosts (tests/multihost/test_elastic_bed.py): -np 3 --min-np 2 --max-np 3 and
        ... --host-names h1,h2,h3 --global-batch 12

The script S prints HOSTS_FILE. The workers drive the scenario themselves, at fixed points, so the run is
the same every time:

1. one worker per host trains epoch 0; at its step 7 (the last commit at step 5) rank 0 makes HOSTS_FILE list
   the other workers' hosts only, waits for the driver to read it, then SIGKILLs itself: the survivors roll
   back 2 steps and go on without it;
2. at the survivors' step 4 of the new world they list every host again and commit (every 0.2 s) until the
   driver's news arrives: the new worker joins at that commit, without a rollback;
3. 4 steps later rank 0 lists every host but one other worker's (the last in --host-names) and all commit
   until that host is dropped: its worker leaves without a rollback; the others finish the epochs, exit 0.

Each worker appends to DIR/trained.<host>.<pid>.jsonl one line per step trained (the epoch, the step's place
in the epoch, the reset count, the world, the sample ids) and one per reset and per first step after a sync (a
digest of the weights); the test reads them.

With --accumulation-steps K and --powersgd RANK the updates go through ``repl.wrap_optimizer`` (K micro-batches
per update, PowerSGD of that rank on every matrix): a commit then falls mid-update (every 5 steps) and the
kill's rollback must put back the accumulated gradients and PowerSGD's state. The first sync's line then holds
the initial weights and the last line the final ones, for the test's one-process replay (elastic_checks.py).
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
from tests.multirank.elastic_hosts import HostsFile

N, EPOCHS, COMMIT_EVERY = 192, 2, 5


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
    parser.add_argument("--host-names", default="localhost,127.0.0.1", help="every host, comma-separated")
    parser.add_argument("--global-batch", type=int, default=8, help="divisible by every world size")
    parser.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per update")
    parser.add_argument("--powersgd", type=int, default=0, help="PowerSGD's rank (0: exact all-reduce)")
    args = parser.parse_args()
    wrapped = args.accumulation_steps > 1 or args.powersgd > 0
    global_batch = args.global_batch
    me = os.environ["HOROVOD_HOSTNAME"]
    log = (args.out / f"trained.{me}.{os.getpid()}.jsonl").open("a")

    def record(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    hosts = HostsFile(args.hosts, args.host_names, record)

    config = hvrep.CommConfig(accumulation_steps=args.accumulation_steps,
                              **(dict(compression="powersgd", powersgd_rank=args.powersgd,
                                      powersgd_min_compression_rate=0) if args.powersgd else {}))
    repl = hvrep.Replicator(config=config)  # "auto": horovod under the elastic driver
    record(event="start", backend=repl.backend, rank=repl.rank, size=repl.num_replicas)
    with repl.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    updates = repl.wrap_optimizer(optimizer) if wrapped else optimizer
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    state = hvrep.elastic.State(repl, model, updates, epoch=0, segments=[], step=0)

    def weights() -> list | None:
        return [v.numpy().tolist() for v in model.trainable_variables] if wrapped else None
    state.register_reset_callbacks([lambda: record(event="reset", at=time.time(), size=repl.num_replicas,
                                                   why=state.resets[-1].why)])

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if not wrapped:
            grads = hvrep.all_reduce(grads, "mean")
        updates.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @hvrep.elastic.run
    def train(state):
        size, rank = repl.num_replicas, repl.rank
        # Which part of the scenario: the resets the longest-lived worker has seen (a joining one has seen none).
        phase = int(repl.reduce(tf.constant(len(state.resets)), "max"))
        record(event="synced", resets=len(state.resets), world=phase, rank=rank, size=size, at=time.time(),
               weights=digest(state.variables), initial=weights() if phase == 0 else None,
               step=state.step, last_reset=[r.why for r in state.resets][-1:],
               rolled_back=state.resets[-1].rolled_back if state.resets else {})
        since_reset = 0
        while state.epoch < EPOCHS:
            plan = EpochPlan([N], seed=100 + state.epoch)
            segments = [Segment.from_json(s) for s in state.segments]
            position = EpochPosition.resume(segments, size, global_batch)
            batch = global_batch // size
            share = plan.share(rank, size, batch, position)
            before = sum(s.steps for s in position.done)
            for k in range(share.steps):
                ids = share.ids[k * batch:(k + 1) * batch]
                x, y = features(ids)
                repl.run(step_fn, args=(tf.constant(x), tf.constant(y)))
                state.step += 1
                since_reset += 1
                state.segments = [s.to_json() for s in position.segments(size, global_batch, position.steps + k + 1)]
                record(event="step", epoch=state.epoch, k=before + position.steps + k, world=phase,
                       rank=rank, size=size, ids=ids.tolist())
                if phase == 0 and state.step == 7 and rank == 0:
                    hosts.write(hosts.others)
                    # The driver reads the script every second: once it no longer lists this host, the blacklist's
                    # cooldown cannot let it straight back in the failure's own reset.
                    time.sleep(2.5)
                    record(event="killing", at=time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
                if phase == 1 and since_reset == 4:
                    hosts.write(hosts.all)
                    hosts.commit_until_update(state, "adding a host")
                if phase == 2 and since_reset == 4 and rank == 0:
                    hosts.write([h for h in hosts.all if h != hosts.others[-1]])
                if phase == 2 and since_reset >= 4:
                    hosts.commit_until_update(state, "dropping a host")
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.segments = []
            state.commit()
        record(event="done", resets=[r.__dict__ for r in state.resets], rank=repl.rank, size=repl.num_replicas,
               weights=digest(state.variables), final=weights(), step=state.step, at=time.time())

    train(state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
