"""The watchdog's activity table (hvrep.replica.activity): native markers (kernels/tf/watch.cc) and the Python
table they replace record the same things; traced and eager collectives share one call counter (the number ranks
compare); a traced marker records into the table it entered even when another is bound before it leaves.

CI builds the kernels (`make setup`), so the native table must be there: a test fails, it does not skip."""

from __future__ import annotations

import threading
import time
import types

import pytest
import tensorflow as tf

from hvrep import kernels
from hvrep.replica import activity


@pytest.fixture
def native():
    nat = activity.native_watch.native()
    if nat is None:
        pytest.fail(f"hvrep's kernels are not loaded ({kernels.status().describe()}): `make setup` builds them")
    return nat


@pytest.fixture(autouse=True)
def _unbind():
    yield
    activity.bind(None)


def _identity_collective():
    """A stand-in for Horovod's module whose allreduce returns its input (the markers are what is tested)."""
    return activity.Watched(types.SimpleNamespace(allreduce=tf.identity), lambda: "step")


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "python"])
def test_eager_and_traced_collectives_count_on_one_counter(use_native, native):
    act = activity.Activity(native=use_native)
    assert act.is_native is use_native
    activity.bind(act)
    hvd = _identity_collective()
    step = tf.function(lambda x: hvd.allreduce(x) + 1)
    with act.inside("eager: allreduce"):
        assert list(act.pending) == [1]
    assert act.last == (1, "eager: allreduce")
    assert step(tf.ones([2])).numpy().tolist() == [2.0, 2.0]
    assert act.last == (2, "step: allreduce float32[2]") and not act.pending
    step(tf.ones([2]))
    call = act.enter("eager: broadcast")
    snap = act.snapshot()
    assert snap["in"] and snap["call"] == 4 and snap["what"] == "eager: broadcast", snap
    assert 0 <= time.monotonic() - act.pending[4][1] < 5  # one clock on both sides
    act.leave(call)
    snap = act.snapshot()
    assert not snap["in"] and snap["call"] == 4 and snap["age"] < 5, snap


def test_a_traced_marker_leaves_the_table_it_entered(native):
    first, second = activity.Activity(), activity.Activity()
    activity.bind(first)

    def blocking(x):
        return tf.py_function(lambda t: (time.sleep(0.5), t)[1], [x], x.dtype)

    hvd = activity.Watched(types.SimpleNamespace(allreduce=blocking), lambda: "step")
    step = tf.function(lambda x: hvd.allreduce(x) * 2)
    step.get_concrete_function(tf.TensorSpec([1], tf.float32))
    worker = threading.Thread(target=lambda: step(tf.ones([1])))
    worker.start()
    deadline = time.monotonic() + 5
    while not first.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(first.pending) == [1]
    activity.bind(second)  # e.g. an elastic reset's new watchdog, while the old step is still inside
    worker.join(10)
    assert not first.pending and first.last == (1, "step: allreduce float32[1]")
    assert second.last == (0, "starting") and not second.pending


def test_markers_record_nothing_when_no_activity_is_bound(native):
    act = activity.Activity()
    activity.bind(act)
    hvd = _identity_collective()
    step = tf.function(hvd.allreduce)
    step.get_concrete_function(tf.TensorSpec([1], tf.float32))  # traced with markers
    activity.bind(None)
    assert step(tf.ones([1])).numpy().tolist() == [1.0]
    assert act.last == (0, "starting") and not act.pending
    # And a graph traced while none is bound has no markers at all.
    plain = tf.function(hvd.allreduce)
    graph = plain.get_concrete_function(tf.TensorSpec([1], tf.float32)).graph
    assert not [op for op in graph.get_operations() if "hvrep_watchdog" in op.name]


def test_a_snapshot_holds_every_pending_call(native):
    act = activity.Activity()
    calls = [act.enter(f"bucket {i}") for i in range(200)]  # more than the first read's buffer holds
    snap = act.snapshot()
    assert len(act.pending) == 200 and snap["call"] == calls[0] and snap["what"] == "bucket 0"
    assert snap["more"] and len(snap["waiting"]) == 16
    for call in calls:
        act.leave(call)
    assert act.last == (calls[-1], "bucket 199") and not act.pending


def test_a_closed_table_is_gone(native):
    act = activity.Activity()
    table = act._table
    act.close()
    with pytest.raises(ValueError, match=f"no watchdog table {table}"):
        native.snapshot(table)
    assert native.enter(table, 0) == 0  # a marker holding its token records nothing
