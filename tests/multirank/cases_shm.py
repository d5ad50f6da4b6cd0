"""hvrep's shared-memory all-reduce on a launcher's ranks (see runner.py; every case calls the same collectives
on every rank before it asserts). Both ranks run on this host, so the default Replicator uses it: every other
case file's all-reduces go through it too (their fidelity cases are its N x B = 1 x N.B checks); these cases
check that it is the one used, that it gives Horovod's bits, and that Horovod still serves what it does not
take.
"""

import numpy as np
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError


def _reduce_bits(repl, tensors):
    out = repl.run(lambda *ts: hvrep.all_reduce(list(ts), "mean"), args=tuple(tensors))
    return [o.numpy() for o in out]


def _tensors(rank=None):
    rank = hvrep.resolve_placement().rank if rank is None else rank
    rng = np.random.default_rng(1234 + rank)
    # One small bucket, one of 50 tensors, and one tensor larger than a 4 MiB chunk.
    sizes = [7, *([1000] * 50), 1_500_000]
    return [tf.constant(rng.standard_normal(n).astype(np.float32)) for n in sizes]


def case_on_one_host_the_default_replicator_uses_it():
    repl = hvrep.Replicator("horovod")
    try:
        assert repl._backend._shm is not None, "the shared-memory all-reduce is not open on one host"
    finally:
        repl.close()


def case_it_gives_horovods_bits():
    ts = _tensors()
    shm_repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="shm"))
    try:
        assert shm_repl._backend._shm is not None, "the shared-memory all-reduce is not open on one host"
        got = _reduce_bits(shm_repl, ts)
    finally:
        shm_repl.close()
    hvd_repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="horovod"))
    try:
        assert hvd_repl._backend._shm is None
        want = _reduce_bits(hvd_repl, ts)
    finally:
        hvd_repl.close()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tobytes() == w.tobytes(), f"tensor {i}: {np.max(np.abs(g - w))}"


def case_float_sums_go_through_it_and_integer_sums_through_horovod():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="shm"))
    backend = repl._backend
    real, traced = backend._shm, []

    class Spy:  # records what the step traces into hvrep's ops; the ops themselves run
        gathers = True

        def allreduce(self, t, key):
            traced.append(t.dtype.name)
            return real.allreduce(t, key=key)

        def allreduce_parts(self, parts, key, scale, align):
            traced.extend(t.dtype.name for t in parts)
            return real.allreduce_parts(parts, key=key, scale=scale, align=align)

    backend._shm = Spy()
    try:
        out = repl.run(lambda t: hvrep.all_reduce([t, tf.cast(t, tf.int32)], "sum"), args=(tf.ones([5]),))
        assert traced == ["float32"], traced
        assert [float(v) for v in out[0]] == [2.0] * 5 and [int(v) for v in out[1]] == [2] * 5, out
    finally:
        backend._shm = real
        repl.close()


def case_its_buckets_are_not_packed_first():
    # A bucket goes to the transport as its parts, which it copies into its staging area itself: no pack op (a
    # pass over the bucket) in the step. The unpack hands back slices of the sum as before.
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="shm"))
    real, calls = repl._backend._shm, []

    class Spy:
        gathers = True

        def allreduce(self, t, key):
            calls.append(("packed", 1))
            return real.allreduce(t, key=key)

        def allreduce_parts(self, parts, key, scale, align):
            calls.append(("parts", len(parts)))
            return real.allreduce_parts(parts, key=key, scale=scale, align=align)

    repl._backend._shm = Spy()
    try:
        ts = _tensors()
        step = tf.function(lambda *xs: hvrep.all_reduce(list(xs), "mean"))
        out = repl.run(step, args=tuple(ts))
        ops = {op.type for op in step.get_concrete_function(*ts).graph.get_operations()}
    finally:
        repl._backend._shm = real
        repl.close()
    assert calls and all(kind == "parts" for kind, _ in calls), calls
    assert sum(n for _, n in calls) == len(ts), calls
    assert "HvrepShmAllreduceParts" in ops and "HvrepPack" not in ops, sorted(ops)
    # The mean of the two ranks' tensors, to float32's rounding (each half is exact, the sum rounds once).
    mine, other = ts, _tensors(1 - hvrep.resolve_placement().rank)
    for t, u, o in zip(mine, other, out, strict=True):
        assert o.shape == t.shape
        np.testing.assert_array_equal(o.numpy(), (t.numpy() * np.float32(0.5)) + (u.numpy() * np.float32(0.5)))


def case_local_transport_is_validated_and_shm_can_be_required():
    try:
        hvrep.CommConfig(local_transport="nccl")
        raise AssertionError("a bad local_transport was accepted")
    except ConfigError as e:
        assert "local_transport must be one of" in str(e), e
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="shm"))
    try:
        assert repl._backend._shm is not None
    finally:
        repl.close()


def case_eager_reduce_and_broadcast_still_go_through_horovod():
    repl = hvrep.Replicator("horovod", config=hvrep.CommConfig(local_transport="shm"))
    try:
        rank = hvrep.resolve_placement().rank
        assert float(repl.reduce(tf.constant(float(rank + 1)), "sum")) == 3.0
        out = repl.run(lambda: hvrep.broadcast(tf.constant(float(rank + 5)), root=1))
        assert float(out) == 6.0, out
    finally:
        repl.close()

