"""InputContext: what input_fn gets, old positional form included."""

import dataclasses

import pytest
import tensorflow as tf

from hvrep import InputContext
from hvrep.errors import ConfigError


def test_positional_form_still_works_and_devices_default_to_none():
    ctx = InputContext(1, 4, 8)
    assert (ctx.replica_id, ctx.num_replicas, ctx.per_replica_batch_size) == (1, 4, 8)
    assert ctx.cuda_device is None and ctx.tf_device is None
    assert InputContext(0, 1).per_replica_batch_size is None


def test_devices_are_keyword_fields():
    ctx = InputContext(5, 16, 32, cuda_device=5, tf_device="/gpu:0")
    assert (ctx.cuda_device, ctx.tf_device) == (5, "/gpu:0")
    with pytest.raises(TypeError):
        InputContext(5, 16, 32, 5)  # a fourth positional would be easy to mistake for a batch size
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.cuda_device = 0


def test_a_gpu_needs_both_numbers():
    with pytest.raises(ConfigError, match="cuda_device=3 and tf_device=None name one GPU"):
        InputContext(0, 1, cuda_device=3)
    with pytest.raises(ConfigError, match="cuda_device must be >= 0, got -1"):
        InputContext(0, 1, cuda_device=-1, tf_device="/gpu:0")


def test_shard_ignores_the_devices():
    ctx = InputContext(1, 2, cuda_device=1, tf_device="/gpu:1")
    assert list(ctx.shard(tf.data.Dataset.range(6)).as_numpy_iterator()) == [1, 3, 5]
