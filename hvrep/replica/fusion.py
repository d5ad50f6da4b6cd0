"""Fused all-reduce: many tensors, few collectives.

Each collective has a fixed cost (on a GPU cluster: a NCCL launch and a ring
latency of 2(N-1) hops), so hvrep packs the tensors of one ``all_reduce``
call into contiguous buffers and reduces each buffer once. Buckets follow
the order the tensors are given in (for gradients, the order the backward
pass produced them, so the first bucket can start while later gradients are
still being computed, as in Horovod and PyTorch DDP) and never mix dtypes.
Each size and order choice is explained where it is made (STYLE.md: PyTorch
DDP's bucketing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from hvrep import kernels


def plan_buckets(
    nbytes: Sequence[int], dtypes: Sequence[object], threshold: int, num_groups: int = 0
) -> list[list[int]]:
    """Groups tensor indices into buckets.

    Args:
      nbytes: bytes of each tensor (on the wire).
      dtypes: dtype of each tensor; a bucket holds one dtype.
      threshold: a bucket's size limit in bytes; 0: one tensor per bucket. A
        tensor larger than the threshold gets a bucket of its own.
      num_groups: if > 0, ignore ``threshold`` and split each dtype's tensors
        into this many contiguous groups of about equal bytes.

    Returns:
      Lists of indices into the inputs, each list in input order.
    """
    by_dtype: dict[object, list[int]] = {}
    for i, dt in enumerate(dtypes):
        by_dtype.setdefault(dt, []).append(i)
    buckets: list[list[int]] = []
    for idx in by_dtype.values():
        if num_groups > 0:
            # Close group k once the running total reaches k/num_groups of the bytes.
            total = sum(nbytes[i] for i in idx)
            current, acc, k = [], 0, 1
            for i in idx:
                current.append(i)
                acc += nbytes[i]
                if acc * num_groups >= total * k:
                    buckets.append(current)
                    current, k = [], k + 1
            if current:
                buckets.append(current)
            continue
        current, size = [], 0
        for i in idx:
            if current and (threshold == 0 or size + nbytes[i] > threshold):
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes[i]
        if current:
            buckets.append(current)
    return buckets


# The most a bucket grows by the zeros that align its parts (see _gap_align).
MAX_GAP_SHARE = 0.01


def _gap_align(sizes: Sequence[int], dtype: tf.DType) -> int:
    """The pack's ``align`` for a bucket: 64 bytes, unless the gaps would grow it by over 1%.

    With every part starting 64-byte aligned (under 64 bytes of zeros between
    parts, reduced with them), the unpack hands back each part that needs no
    cast as a slice of the reduced buffer: one pass over the bucket's memory
    after the collective saved (measured: ~150 us of a 4 MB step on a CPU
    rank). A bucket of small tensors (biases, norms) would grow by more than
    the copy is worth, so it stays dense and is copied out as before.
    """
    align = kernels.align_for(dtype)
    dense = sum(sizes)
    return align if kernels.packed_length(sizes, align) - dense <= MAX_GAP_SHARE * dense else 1


def fused_reduce(
    tensors: Sequence[tf.Tensor],
    reduce_buffer: Callable[[tf.Tensor], tf.Tensor],
    threshold: int,
    num_groups: int = 0,
    wire_dtype: tf.DType | None = None,
    prescale: float | None = None,
    reduce_parts: Callable[[list[tf.Tensor], float, int], tf.Tensor | None] | None = None,
) -> list[tf.Tensor]:
    """Reduces ``tensors`` through one ``reduce_buffer`` call per bucket.

    Args:
      tensors: floating-point tensors of any shapes. One whose shape is not
        fully known when traced (a dynamic batch dimension) is reduced on its
        own, unfused: a fused buffer's layout is fixed when it is traced.
      reduce_buffer: reduces one rank-1 buffer across replicas (one collective).
      threshold: bucket size limit in bytes (see :func:`plan_buckets`).
      num_groups: see :func:`plan_buckets`.
      wire_dtype: cast buffers to this dtype for the collective (compression)
        and back afterwards; None keeps each tensor's dtype.
      prescale: multiply before the cast (e.g. 1/N for a mean, so fp16 sums
        of many replicas do not overflow).
      reduce_parts: where the collective can take the parts themselves
        (``reduce_parts(parts, scale, align)``: the reduced buffer that
        ``reduce_buffer(kernels.pack(parts, None, scale, align))`` gives, or
        None where it cannot), a bucket that needs no cast goes to it
        unpacked: hvrep's shared-memory all-reduce copies the parts into its
        own staging area, saving the pack's pass over the bucket.

    Returns:
      The reduced tensors, in input order, with their shapes and dtypes.
    """
    if not tensors:
        return []
    wire = [wire_dtype or t.dtype for t in tensors]
    out: list[tf.Tensor | None] = [None] * len(tensors)
    # Gradients arrive in variable (forward) order; the backward pass produces
    # them last layer first, so buckets are planned in reverse, as Horovod and
    # PyTorch DDP do: the first bucket is the first one whose gradients are ready.
    order = list(reversed(range(len(tensors))))
    fixed = [i for i in order if tensors[i].shape.is_fully_defined()]
    nbytes = [int(tensors[i].shape.num_elements()) * wire[i].size for i in fixed]
    plan = [[fixed[j] for j in b] for b in plan_buckets(nbytes, [wire[i] for i in fixed], threshold, num_groups)]
    plan += [[i] for i in order if not tensors[i].shape.is_fully_defined()]
    scale = 1.0 if prescale is None else prescale
    for bucket in plan:
        parts = [tensors[i] for i in bucket]
        uncast = all(t.dtype == wire[i] for i, t in zip(bucket, parts, strict=True))
        if len(parts) > 1:  # only fully known shapes share a bucket
            # One op packs (scale, cast, copy) the bucket and one unpacks it
            # (hvrep.kernels: fused C++/CUDA where built, the same TF ops as
            # below elsewhere), instead of 2-3 small ops per tensor.
            align = _gap_align([t.shape.num_elements() for t in parts], wire[bucket[0]])
            reduced = reduce_parts(parts, scale, align) if reduce_parts is not None and uncast else None
            if reduced is None:
                reduced = reduce_buffer(kernels.pack(parts, wire[bucket[0]], scale, align))
            pieces = kernels.unpack(reduced, [t.shape for t in parts], [t.dtype for t in parts], align=align)
            for i, piece in zip(bucket, pieces, strict=True):
                out[i] = piece
            continue
        # One tensor alone: reshaped with its runtime shape, so an unknown shape works too.
        (i,), (t,) = bucket, parts
        reduced = reduce_parts(parts, scale, 1) if reduce_parts is not None and uncast else None
        if reduced is not None:
            out[i] = tf.reshape(reduced, tf.shape(t))
            continue
        # The scale through float64 (tf.cast of a Python number would round it to float32 first), then to the
        # tensor's dtype as the pack rounds it.
        scaled = t if prescale is None else t * tf.cast(tf.constant(prescale, tf.float64), t.dtype)
        reduced = reduce_buffer(tf.reshape(tf.cast(scaled, wire[i]), [-1]))
        out[i] = tf.reshape(tf.cast(reduced, t.dtype), tf.shape(t))
    return out  # type: ignore[return-value]
