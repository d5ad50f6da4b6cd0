"""Replicas of k devices on the local backend, in this process (its 2 logical CPU devices): k = 2 makes one
replica that owns both, a k that does not divide them is refused. Several replicas of k devices, and the horovod
backend, run in tests/multirank/test_model_parallel.py."""

from __future__ import annotations

import pytest
import tensorflow as tf

import hvrep
from hvrep.errors import CollectiveError, ConfigError

BOTH = ("/device:CPU:0", "/device:CPU:1")


def test_two_devices_per_replica_make_one_replica_owning_both():
    repl = hvrep.Replicator("local", devices_per_replica=2)
    try:
        assert repl.num_replicas == 1 and repl.devices_per_replica == 2
        contexts = []

        def input_fn(ctx):
            contexts.append(ctx)
            return tf.data.Dataset.range(2).batch(1)

        batches = list(repl.distribute_dataset(input_fn))
        assert [c.devices for c in contexts] == [BOTH]
        with repl.scope():
            in_scope = hvrep.replica_devices()
        assert in_scope == BOTH
        seen = []

        def step(x):
            seen.append(hvrep.replica_devices())
            with tf.device(hvrep.replica_devices()[1]):
                return hvrep.all_reduce(tf.cast(x, tf.float32) * 2.0, "sum")

        out = repl.reduce(repl.run(step, args=(batches[1],)), "sum")
        assert float(out[0]) == 2.0 and seen == [BOTH]
    finally:
        repl.close()


def test_one_device_per_replica_names_each_replicas_own_device():
    repl = hvrep.Replicator("local")
    try:
        seen = set()

        def step():
            seen.add(hvrep.replica_devices())
            return tf.constant(0)

        repl.run(step)
        assert seen == {("/device:CPU:0",), ("/device:CPU:1",)}
    finally:
        repl.close()


def test_a_k_that_does_not_divide_the_devices_is_refused_naming_both_and_the_fix():
    with pytest.raises(ConfigError, match=r"devices_per_replica=3 does not divide this machine's 2 logical CPU "
                                          r"devices \(/device:CPU:0, /device:CPU:1\).*Fix: a devices_per_replica "
                                          r"that divides 2"):
        hvrep.Replicator("local", devices_per_replica=3)
    with pytest.raises(ConfigError, match="devices_per_replica must be a whole number >= 1, got 0"):
        hvrep.Replicator("local", devices_per_replica=0)


def test_the_tpu_backend_refuses_more_than_one_device_per_replica():
    with pytest.raises(ConfigError, match=r"devices_per_replica=2 with backend='tpu' cannot be combined.*Fix: "
                                          "devices_per_replica=1"):
        hvrep.Replicator("tpu", devices_per_replica=2)


def test_replica_devices_outside_run_and_scope_says_where_to_call_it():
    with pytest.raises(CollectiveError, match=r"inside `with repl.scope\(\):`.*ctx.devices"):
        hvrep.replica_devices()


def test_an_input_context_takes_a_sequence_of_device_names():
    assert hvrep.InputContext(0, 1, devices=["/device:GPU:0", "/device:GPU:1"]).devices == ("/device:GPU:0",
                                                                                           "/device:GPU:1")
    assert hvrep.InputContext(0, 1).devices == ()
    with pytest.raises(ConfigError, match="devices must be a sequence of device names, got '/device:GPU:0'"):
        hvrep.InputContext(0, 1, devices="/device:GPU:0")
