"""The shared-memory all-reduce's native side (kernels/tf/shm.cc): its op and the C functions that open it.

:mod:`hvrep.replica.shm` decides where it applies and opens it; this module only binds the library. None where
the kernels are not built, cannot load, are switched off (``HVREP_KERNELS=off``) or predate the transport.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvrep.kernels import loader

# The dtypes the op sums (half and bfloat16 in float, rounded once).
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

# hvrep_shm_stats' counters, in its order (kernels/tf/shm.cc, Stat): collectives and chunks done, bytes summed;
# nanoseconds summed over the collectives from the op's submission to its end ("latency": what the step waits),
# of the progress thread's work on them, waits for the peers included ("reduce"), and of waiting for another
# rank ("wait": the announcement, the peers' inputs, their sums); and the waits that slept on the futex.
STATS = ("ops", "chunks", "bytes", "latency_ns", "reduce_ns", "wait_ns", "sleeps")


class Native:
    """The op and the C functions of one process's transport (at most one open at a time)."""

    def __init__(self, ops: Any, lib: ctypes.CDLL) -> None:
        self._ops, self._lib = ops, lib
        i64, c_int, c_char_p = ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
        for name, args, res in (("hvrep_shm_file_bytes", [c_int, i64], i64),
                                ("hvrep_shm_open", [c_char_p, c_int, c_int, i64, c_int, c_char_p, c_int], c_int),
                                ("hvrep_shm_peers_seen", [], c_int), ("hvrep_shm_close", [], c_int),
                                ("hvrep_shm_is_open", [], c_int)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._stats = getattr(lib, "hvrep_shm_stats", None)  # None in a library built before it
        if self._stats is not None:
            self._stats.argtypes, self._stats.restype = [ctypes.POINTER(i64), c_int], c_int

    def file_bytes(self, size: int, cap: int) -> int:
        """Bytes the transport's file takes for ``size`` ranks and chunks of ``cap`` bytes."""
        return int(self._lib.hvrep_shm_file_bytes(size, cap))

    def open(self, path: str, rank: int, size: int, cap: int, create: bool) -> str:
        """Maps ``path`` and starts this process's progress thread; "" or the reason it could not."""
        err = ctypes.create_string_buffer(1024)
        rc = self._lib.hvrep_shm_open(path.encode(), rank, size, cap, int(create), err, len(err))
        return "" if rc == 0 else err.value.decode(errors="replace")

    def peers_seen(self) -> int:
        """Ranks whose process this one sees (their pid written and alive); -1 where none is open."""
        return int(self._lib.hvrep_shm_peers_seen())

    def close(self) -> bool:
        """Stops the progress thread (its pending ops fail) and unmaps the file; False where none was open."""
        return int(self._lib.hvrep_shm_close()) == 0

    def stats(self) -> dict[str, int] | None:
        """The open transport's counters since it opened (:data:`STATS`); None where none is open."""
        if self._stats is None:
            return None
        out = (ctypes.c_int64 * len(STATS))()
        n = int(self._stats(out, len(STATS)))
        return None if n < 0 else dict(zip(STATS[:n], (int(v) for v in out[:n]), strict=True))

    def is_open(self) -> bool:
        return bool(self._lib.hvrep_shm_is_open())

    def allreduce(self, t: tf.Tensor, key: str) -> tf.Tensor:
        """The sum of ``t`` over the ranks; ``key`` pairs the op across ranks (the same on each)."""
        return self._ops.hvrep_shm_allreduce(t, key=key)

    @property
    def gathers(self) -> bool:
        """Whether the library has :meth:`allreduce_parts` (one built before it has not)."""
        return hasattr(self._ops, "hvrep_shm_allreduce_parts")

    def allreduce_parts(self, parts: Sequence[tf.Tensor], key: str, scale: float = 1.0, align: int = 1) -> tf.Tensor:
        """The sum over the ranks of ``hvrep.kernels.pack(parts, None, scale, align)``, without the pack: the
        transport copies each part (times ``scale``, as the pack multiplies) straight into its staging area. The
        parts share one dtype of :data:`DTYPES`; the result is the packed buffer's sum, for
        ``hvrep.kernels.unpack``."""
        return self._ops.hvrep_shm_allreduce_parts(list(parts), tf.constant(scale, tf.float64), key=key, align=align)


@tf.RegisterGradient("HvrepShmAllreduce")
def _allreduce_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    """A sum over the ranks is linear: its gradient is the sum of the upstream gradients over the ranks (as
    Horovod's allreduce's gradient is), paired across ranks by the forward op's key."""
    nat = native()
    assert nat is not None  # the forward op ran, so the library is loaded
    return nat.allreduce(grad, key=op.get_attr("key").decode() + "/grad")


@tf.RegisterGradient("HvrepShmAllreduceParts")
def _allreduce_parts_grad(op: tf.Operation, grad: tf.Tensor) -> list[tf.Tensor | None]:
    """The packed sum's gradient summed over the ranks (as :func:`_allreduce_grad`), cut into the parts' pieces
    and multiplied by the scale: the pack's own gradient."""
    nat = native()
    assert nat is not None
    parts, scale = op.inputs[:-1], op.inputs[-1]
    summed = nat.allreduce(grad, key=op.get_attr("key").decode() + "/grad")
    sizes = [tf.size(p) for p in parts]
    starts, at = [], tf.constant(0, tf.int32)
    align = op.get_attr("align")
    for i, n in enumerate(sizes):
        if i:
            at = (at + align - 1) // align * align
        starts.append(at)
        at = at + n
    return [*(tf.reshape(summed[s:s + n] * tf.cast(scale, p.dtype), tf.shape(p))
              for p, s, n in zip(parts, starts, sizes, strict=True)), None]


@functools.cache
def native() -> Native | None:
    """The transport's native side, or None where the fused kernels are not loaded (or predate it)."""
    found = loader.with_library("hvrep_shm_allreduce")
    return None if found is None else Native(*found)
