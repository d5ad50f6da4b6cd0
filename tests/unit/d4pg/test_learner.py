"""The D4PG learner (examples/d4pg/agent.py): 2 in-graph replicas x B equal 1 replica x 2B; the actors' NumPy
policy is the learner's; the categorical projection keeps the mass and the mean."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hvrep
from examples.d4pg import policy
from examples.d4pg.agent import D4PG, D4PGConfig, project
from tests.d4pg_data import ACT, HIGH, LOW, OBS, batches


def train(repl: hvrep.Replicator, cfg: D4PGConfig) -> list[np.ndarray]:
    agent = D4PG(repl, cfg, OBS, ACT, LOW, HIGH)
    for step, batch in enumerate(batches(), 1):
        repl.reduce(agent.train_step(batch, step), "mean")
    return [np.asarray(w.numpy()) for net in (agent.policy, agent.critic, agent.target_policy, agent.target_critic)
            for w in net.weights]


@pytest.mark.parametrize("cfg", [D4PGConfig(hidden=(16, 16)),
                                 D4PGConfig(hidden=(16, 16), optimizer="sgd", lr_policy=0.05, lr_critic=0.05,
                                            target_period=2)], ids=["adam-soft", "sgd-periodic"])
def test_two_in_graph_replicas_of_b_equal_one_replica_of_2b(cfg: D4PGConfig) -> None:
    two, one = hvrep.Replicator("local"), hvrep.Replicator("local", devices_per_replica=2)
    try:
        assert (two.num_replicas, one.num_replicas) == (2, 1)
        got, want = train(two, cfg), train(one, cfg)
    finally:
        two.close()
        one.close()
    start = D4PG(hvrep.Replicator("local", devices_per_replica=2), cfg, OBS, ACT, LOW, HIGH).policy.weights
    assert max(float(np.max(np.abs(w - s.numpy()))) for w, s in zip(want, start, strict=False)) > 1e-4  # it moved
    assert max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True)) <= 1e-5


def test_the_actors_numpy_policy_is_the_learners() -> None:
    repl = hvrep.Replicator("local", devices_per_replica=2)
    agent = D4PG(repl, D4PGConfig(hidden=(16, 16)), OBS, ACT, LOW, HIGH)
    obs = np.random.default_rng(0).normal(size=(5, OBS)).astype(np.float32)
    weights = policy.unflatten(agent.policy_weights(), policy.layer_shapes(OBS, ACT, (16, 16)))
    want = agent._act(agent.policy, tf.constant(obs)).numpy()
    np.testing.assert_allclose(policy.act(weights, obs, LOW, HIGH), want, atol=1e-5)


def test_the_projection_keeps_the_mass_and_moves_the_mean_by_the_reward() -> None:
    atoms = tf.constant(np.linspace(-10, 10, 21), tf.float32)
    probs = tf.nn.softmax(tf.random.stateless_normal([4, 21], seed=[1, 2]))
    r, d = tf.constant([0.5, -1.25, 0.0, 3.0]), tf.constant([0.9, 0.5, 0.0, 0.0])
    m = project(r, d, probs, atoms).numpy()
    np.testing.assert_allclose(m.sum(1), 1.0, atol=1e-6)
    mean = (m * atoms.numpy()).sum(1)
    # Inside the support the projection keeps the mean: r + d * E[Z] (tails here stay inside [-10, 10]).
    np.testing.assert_allclose(mean, r.numpy() + d.numpy() * (probs.numpy() * atoms.numpy()).sum(1), atol=1e-5)
    assert m[2, 10] == pytest.approx(1.0) and m[3, 13] == pytest.approx(1.0)  # terminal: all on r's atom
