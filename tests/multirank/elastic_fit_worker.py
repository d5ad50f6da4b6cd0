"""One elastic worker training with Keras' model.fit and hvrep's elastic callbacks (see test_elastic.py).

    horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S --network-interface lo \
        python tests/multirank/elastic_fit_worker.py --out DIR

The optimizer is an hvrep.keras.DistributedOptimizer (fit's own train step all-reduces through it). At epoch 1,
batch 8 (the last commit after batch 5, every 5 batches) rank 0 SIGKILLs itself: the survivor rolls back 3
batches, trains the rest of that epoch in a fit of its own (Keras 3 cannot shorten one epoch of a fit), then
the remaining epochs, and exits 0. DIR/fit.<host>.<pid>.jsonl gets a line per reset and one at the end (the
resets, the epoch reached, the accuracy on held-out samples, the batches each epoch trained).

With --hosts HOSTS_FILE (the file the discovery script prints; on 3 namespace hosts, with --host-names h1,h2,h3
--global-batch 24, tests/multihost/test_elastic_bed.py) the run also adds and drops a host: rank 0 lists the
other hosts only before it kills itself (so the driver's blacklist cooldown cannot let it straight back); at
epoch 2, batch 4 the survivors list every host and commit until the new worker joins (no rollback); at epoch 3,
batch 4 rank 0 lists every host but the last other one and all commit until its worker leaves (no rollback).

With --powersgd RANK the DistributedOptimizer reduces by PowerSGD of that rank (every matrix); the last line
then says how many reductions PowerSGD's state counts (the rolled-back batches' undone by the rollback).

With --stop-test nobody kills itself: each batch takes 0.25 s more, every epoch's end is recorded, and the
test SIGSTOPs rank 1 (comm.timeout_s=8): the watchdog ends only the stopped worker, and the survivor goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import hvrep
from tests.multirank.elastic_hosts import HostsFile

STEPS, EPOCHS, COMMIT_EVERY = 12, 4, 5


def features(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([np.random.default_rng(int(i)).normal(size=4) for i in ids]).astype(np.float32)
    return x, (x.sum(1) > 0).astype(np.int32)


class _Trace(keras.callbacks.Callback):
    """Counts the batches each epoch trains here; rank 0 of the first world kills itself at epoch 1, batch 8;
    with ``hosts`` (see the module docstring) a host is added at epoch 2, batch 4 and one dropped at epoch 3,
    batch 4."""

    def __init__(self, state, repl, counts: dict, stop_test: bool, record, hosts: HostsFile | None) -> None:
        super().__init__()
        self.state, self.repl, self.counts, self.stop_test, self.record = state, repl, counts, stop_test, record
        self.hosts, self.first_size = hosts, repl.num_replicas

    def on_epoch_end(self, epoch, logs=None):
        self.record(event="epoch", epoch=int(self.state.epoch), size=self.repl.num_replicas, at=time.time())

    def on_train_batch_end(self, batch, logs=None):
        epoch = int(self.state.epoch)
        self.counts[epoch] = self.counts.get(epoch, 0) + 1
        if self.stop_test:
            time.sleep(0.25)
        elif not self.state.resets and self.repl.num_replicas == self.first_size and self.repl.rank == 0 and \
                (epoch, self.state.batch) == (1, 8):
            if self.hosts is not None:
                self.hosts.write(self.hosts.others)
                time.sleep(2.5)  # the driver reads the script every second
            self.record(event="killing", at=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.hosts is not None and (epoch, self.state.batch) == (2, 4) and self.state.resets:
            self.hosts.write(self.hosts.all)
            self.hosts.commit_until_update(self.state, "adding a host")
        elif self.hosts is not None and (epoch, self.state.batch) == (3, 4):
            if self.repl.rank == 0:
                self.hosts.write([h for h in self.hosts.all if h != self.hosts.others[-1]])
            self.hosts.commit_until_update(self.state, "dropping a host")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-test", action="store_true")
    parser.add_argument("--hosts", type=Path, help="the discovery script's file: also add and drop a host")
    parser.add_argument("--host-names", default="localhost,127.0.0.1", help="every host, comma-separated")
    parser.add_argument("--global-batch", type=int, default=16, help="divisible by every world size")
    parser.add_argument("--powersgd", type=int, default=0, help="PowerSGD's rank (0: exact all-reduce)")
    args = parser.parse_args()
    global_batch = args.global_batch
    kind = "stop" if args.stop_test else "fit"
    log = (args.out / f"{kind}.{os.environ['HOROVOD_HOSTNAME']}.{os.getpid()}.jsonl").open("a")

    def record(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    powersgd = dict(compression="powersgd", powersgd_rank=args.powersgd, powersgd_min_compression_rate=0) \
        if args.powersgd else {}
    repl = hvrep.Replicator(config=hvrep.CommConfig(**({"timeout_s": 8.0} if args.stop_test else {}), **powersgd))
    with repl.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
    optimizer = hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), repl)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvrep.elastic.State(repl, model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: record(event="reset", at=time.time(), size=repl.num_replicas,
                                                   why=state.resets[-1].why)])
    hosts = HostsFile(args.hosts, args.host_names, record) if args.hosts else None
    counts: dict[int, int] = {}
    callbacks = [hvrep.keras.callbacks.UpdateBatchStateCallback(state),
                 hvrep.keras.callbacks.UpdateEpochStateCallback(state),
                 hvrep.keras.callbacks.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 _Trace(state, repl, counts, args.stop_test, record, hosts)]

    def data(epoch: int, skip: int) -> tf.data.Dataset:
        # The epoch's global batches, from batch `skip` on; this rank's part of each (the world's, now).
        b = global_batch // repl.num_replicas
        ids = np.random.default_rng(epoch).permutation(STEPS * global_batch).reshape(STEPS, global_batch)[skip:]
        x, y = features(ids[:, repl.rank * b:(repl.rank + 1) * b].ravel())
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(b)

    @hvrep.elastic.run
    def train(state):
        if state.batch:  # a reset mid-epoch: the rest of that epoch first
            model.fit(data(state.epoch, state.batch), initial_epoch=state.epoch, epochs=state.epoch + 1,
                      callbacks=callbacks, verbose=0)
        while state.epoch < EPOCHS:
            model.fit(data(state.epoch, 0), initial_epoch=state.epoch, epochs=state.epoch + 1, callbacks=callbacks,
                      verbose=0)

    train(state)
    x, y = features(np.arange(10_000, 10_500))
    accuracy = float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))
    record(event="done", resets=[r.__dict__ for r in state.resets], epoch=int(state.epoch), size=repl.num_replicas,
           accuracy=accuracy, batches=counts,
           powersgd_step=int(optimizer.powersgd.step.numpy()) if optimizer.powersgd is not None else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
