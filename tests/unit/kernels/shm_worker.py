"""One rank of hvrep's shared-memory all-reduce without Horovod (test_shm.py starts two).

    python shm_worker.py RANK SIZE FILE MODE OUT

Rank 0 creates FILE (private, as hvrep.replica.shm does) and opens the transport; the others wait for it and
open it. Each writes one JSON object to OUT. Chunks are 4 KiB, so anything over 1,024 floats goes in several.
"""

import json
import os
import sys
import threading
import time

import numpy as np
import tensorflow as tf

from hvrep.kernels import shm

CAP = 4096


def inputs(rank: int, n: int, dtype: tf.DType) -> tf.Tensor:
    # Values exact in every dtype (small integers), different per rank and element.
    x = (np.arange(n) % 97 + 1) * (rank + 1) + rank
    return tf.constant(x.astype(np.float64), dtype)


def main() -> None:
    rank, size, path, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    nat = shm.native()
    assert nat is not None, "kernels not loaded"
    if rank == 0:
        tmp = path + ".new"
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        err = nat.open(tmp, 0, size, CAP, create=True)
        os.rename(tmp, path)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert time.monotonic() < deadline, "rank 0 never created the file"
            time.sleep(0.01)
        err = nat.open(path, rank, size, CAP, create=False)
    assert not err, err
    result: dict = {"rank": rank}
    if mode == "sums":
        sums = {}
        for dtype in shm.DTYPES:
            for n in (0, 1, 17, 1024, 1025, 5000, 100003):
                key = f"sum_{dtype.name}_{n}"
                got = tf.function(lambda t, key=key: nat.allreduce(t, key=key))(inputs(rank, n, dtype))
                # The inputs are small integers (rounded to bfloat16's 8 bits), so their sum is exact in float (the
                # op's accumulator for half and bfloat16) and in the dtype for float and double: the one rounding is
                # the sum's, to the dtype.
                exact = sum(tf.cast(inputs(r, n, dtype), tf.float64) for r in range(size))  # bfloat16 rounds inputs
                want = tf.cast(exact, dtype).numpy()
                sums[f"{dtype.name}/{n}"] = {"wrong": int(np.sum(got.numpy().view(np.uint8) != want.view(np.uint8))),
                                             "bits": got.numpy().tobytes().hex(), "shape": list(got.shape)}
        result["sums"] = sums
    elif mode == "parts":
        # allreduce_parts against the pack it replaces, nat.allreduce(pack(...)): the same bits, and for a scale
        # of 1 or 0.5 (exact on these small integers) the exact sum. Parts of 100, 300, 7, 0, 1,500 and 3 elements
        # at 64-byte alignment: gaps between them, a chunk boundary (1,024 floats) inside the 1,500.
        from hvrep import kernels

        sizes = (100, 300, 7, 0, 1500, 3)
        found = {}
        for dtype in shm.DTYPES:
            align = kernels.align_for(dtype)
            for scale in (1.0, 0.5, 1 / 3):
                parts = [inputs(rank, n, dtype) + i for i, n in enumerate(sizes)]
                tag = f"{dtype.name}_{scale:.3f}"

                @tf.function
                def both(parts, tag=tag, scale=scale, align=align):
                    return (nat.allreduce_parts(parts, key=f"parts_{tag}", scale=scale, align=align),
                            nat.allreduce(kernels.pack(parts, None, scale, align), key=f"packed_{tag}"))

                got, packed = both(parts)
                exact = sum(tf.cast(kernels.pack([inputs(r, n, dtype) + i for i, n in enumerate(sizes)], None,
                                                  1.0, align), tf.float64) for r in range(size)) * scale
                want = tf.cast(exact, dtype).numpy()
                found[tag] = {"shape": list(got.shape), "static": both.get_concrete_function(parts)
                              .structured_outputs[0].shape.as_list(),
                              "same_as_packed": bool(np.array_equal(got.numpy().view(np.uint8),
                                                                    packed.numpy().view(np.uint8))),
                              "wrong": int(np.sum(got.numpy().view(np.uint8) != want.view(np.uint8))),
                              "bits": got.numpy().tobytes().hex()}
        # A part of unknown shape when traced, and the gradient: the pack's, summed over the ranks.
        spec = [tf.TensorSpec([None], tf.float32), tf.TensorSpec([2, 3], tf.float32)]

        @tf.function(input_signature=[spec])
        def grad(parts):
            with tf.GradientTape() as tape:
                tape.watch(parts)
                y = nat.allreduce_parts(parts, key="g", scale=0.5, align=16)
                loss = float(rank + 1) * tf.reduce_sum(y * tf.range(tf.size(y), dtype=tf.float32))
            return y, tape.gradient(loss, parts)

        y, (ga, gb) = grad([tf.ones([5]), tf.ones([2, 3])])
        found["grad"] = {"y": y.numpy().tolist(), "a": ga.numpy().tolist(), "b": gb.numpy().tolist()}
        result["parts"] = found
    elif mode == "order":
        # Rank 0 submits b first, rank 1 submits a first: the ranks' executors issue the two in opposite orders.
        late = "a" if rank == 0 else "b"

        def slow(x):
            time.sleep(0.3)
            return x

        @tf.function
        def step(a, b):
            a = tf.numpy_function(slow, [a], tf.float32, stateful=True) if late == "a" else a
            b = tf.numpy_function(slow, [b], tf.float32, stateful=True) if late == "b" else b
            return nat.allreduce(tf.ensure_shape(a, [3000]), key="a"), nat.allreduce(tf.ensure_shape(b, [10]), key="b")

        t0 = time.monotonic()
        ra, rb = step(tf.fill([3000], float(rank + 1)), tf.fill([10], float(10 * (rank + 1))))
        result.update(seconds=time.monotonic() - t0, a=float(ra[0]), b=float(rb[0]), a_len=int(ra.shape[0]))
    elif mode == "grad":
        # y = the sum over the ranks of x; rank r's loss is (r + 1) * sum(y): dloss/dx on every rank is the sum over
        # the ranks of their upstream gradients, 1 + 2 = 3 (Horovod's allreduce has the same gradient).
        @tf.function
        def grad(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = float(rank + 1) * tf.reduce_sum(nat.allreduce(x, key="g"))
            return tape.gradient(loss, x)

        result["grad"] = grad(tf.ones([6])).numpy().tolist()
    elif mode == "stats":
        # Two collectives (1,025 floats: 2 chunks of 1,024; 3,000: 3) and an empty one, which never reaches the
        # transport; rank 1 comes to the second 0.3 s late, so rank 0 waits for it there.
        reduce = tf.function(lambda t, key: nat.allreduce(t, key=key))
        result["before"] = nat.stats()
        reduce(tf.ones([0]), key="empty")
        reduce(tf.ones([1025]), key="a")
        if rank == 1:
            time.sleep(0.3)
        reduce(tf.ones([3000]), key="b")
        result["after"] = nat.stats()
    elif mode in ("mismatch", "dead", "close"):
        n = 5 if (mode == "mismatch" and rank == 1) else 4
        if mode == "dead" and rank == 1:
            time.sleep(0.5)
            os._exit(0)  # gone without reducing
        if mode == "close":
            if rank == 1:
                time.sleep(3)  # never reduces; rank 0 closes its transport meanwhile
                nat.close()
                json.dump(result, open(out, "w"))
                return
            threading.Timer(0.5, nat.close).start()
        t0 = time.monotonic()
        try:
            tf.function(lambda t: nat.allreduce(t, key="x"))(tf.ones([n]))
            result["error"] = None
        except tf.errors.OpError as e:
            result["error"] = e.message
        result["seconds"] = time.monotonic() - t0
        if mode == "mismatch":  # the transport stays broken: a later op fails at once, with the first reason
            try:
                tf.function(lambda t: nat.allreduce(t, key="y"))(tf.ones([4]))
                result["later"] = None
            except tf.errors.OpError as e:
                result["later"] = e.message
    nat.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
