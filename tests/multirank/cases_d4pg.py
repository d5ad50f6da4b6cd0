"""The D4PG example (examples/d4pg) on 2 ranks (see runner.py): its learner step on 2 ranks x B equals 1 x 2B,
and a rank's actors start without the launcher's job variables. Fails by raising.

Both ranks run every collective before they assert, so one rank's failure does not leave the other waiting.
"""

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

import hvrep
from examples.d4pg import policy
from examples.d4pg.actor import ActorSpec
from examples.d4pg.actors import ActorPool
from examples.d4pg.agent import D4PG, D4PGConfig
from examples.d4pg.replay import Board, Replay
from tests.d4pg_data import ACT, HIGH, LOW, OBS, B, batches

# The app's optimizer (Adam) and soft target updates; SGD and periodic updates are the in-graph unit test's
# second case (each configuration traces its steps again: seconds of the shared launch).
CONFIG = D4PGConfig(hidden=(16, 16))


def _train(repl: hvrep.Replicator, cfg: D4PGConfig, rows: slice) -> list[np.ndarray]:
    agent = D4PG(repl, cfg, OBS, ACT, LOW, HIGH)
    for step, batch in enumerate(batches(), 1):
        repl.reduce(agent.train_step(batch[rows], step), "mean")
    return [np.asarray(w.numpy()) for net in (agent.policy, agent.critic, agent.target_policy, agent.target_critic)
            for w in net.weights]


def case_d4pg_learner_step_on_2_ranks_of_b_equals_1_of_2b():
    dist, ref = hvrep.Replicator("horovod"), hvrep.Replicator("local")
    rank = dist.rank
    try:
        assert dist.num_replicas == 2 and ref.num_replicas == 1, (dist.num_replicas, ref.num_replicas)
        got = _train(dist, CONFIG, slice(rank * B, (rank + 1) * B))
        want = _train(ref, CONFIG, slice(0, 2 * B))
        worst = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True))
        moved = max(float(np.max(np.abs(w))) for w in want[-2:])  # the target critic's last layer: trained
        # Every rank learns every rank's verdict before asserting.
        worst_anywhere = dist.reduce(tf.constant(worst), "max")
    finally:
        ref.close()
        dist.close()
    assert moved > 0 and worst_anywhere <= 1e-5, (worst, worst_anywhere)


def case_d4pg_actors_start_without_the_launchers_job_variables():
    launcher = sorted(k for k in os.environ if k.startswith(("OMPI_", "PMIX_", "HOROVOD_")))
    with tempfile.TemporaryDirectory(prefix="hvrep-d4pg-case-") as tmp:
        folder = Path(tmp)
        Replay(folder, 1, 1024, OBS, ACT, create=True)
        board = Board(folder, policy.num_weights(OBS, ACT, (8,)), create=True)
        board.publish(np.zeros(board.weights.shape, np.float32), 0)
        pool = ActorPool([ActorSpec(folder=tmp, index=0, num_actors=1, capacity=1024, env="Pendulum-v1", seed=0,
                                    hidden=(8,), sigma=0.1, n_step=2, gamma=0.99, max_steps_per_sec=100)],
                         folder / "logs", "case")
        try:
            pool.start()
            time.sleep(0.2)
            raw = Path(f"/proc/{pool.pids()[0]}/environ").read_bytes()
        finally:
            pool.close()
    names = {item.split(b"=", 1)[0].decode() for item in raw.split(b"\0") if item}
    assert launcher, "the launcher set no OMPI_/PMIX_/HOROVOD_ variable: nothing to check"
    assert not sorted(n for n in names if n.startswith(("OMPI_", "PMIX_", "HOROVOD_"))), names
