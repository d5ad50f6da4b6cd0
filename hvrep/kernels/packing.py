"""Fused pack/unpack (many tensors to one rank-1 buffer and back) and their pure-TF references.

With a cast (e.g. to fp16 for the wire) and a scale (e.g. 1/N before a sum
across N replicas), for the fused all-reduce (``hvrep.replica.fusion``).
pack and unpack are each other's gradient.

``align``: each piece after the first starts at a multiple of ``align``
elements, zeros between. With the pieces 64-byte aligned, :func:`unpack` hands
back the pieces that need no cast or scale as slices of the buffer (no copy),
as TensorFlow's own ``Split`` does for aligned pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.kernels.loader import choose

PACK_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

def _scale64(scale: Any) -> tf.Tensor:
    # A Python number straight to float64: tf.cast would make it a float32 tensor first (1/3 -> 0.33333334).
    s = tf.cast(scale, tf.float64) if isinstance(scale, tf.Tensor | tf.Variable) else tf.constant(scale, tf.float64)
    if s.shape.rank not in (0, None):
        raise ConfigError(f"scale must be a scalar, got shape {s.shape}.")
    return s


def _pack_dtype(tensors: Sequence[tf.Tensor], dtype: Any) -> tf.DType:
    if dtype is not None:
        return tf.as_dtype(dtype)
    kinds = sorted({t.dtype.name for t in tensors})
    if len(kinds) > 1:
        raise ConfigError(f"pack: the tensors have dtypes {kinds}; pass dtype= to say which the buffer is.")
    if not kinds:
        raise ConfigError("pack: dtype= is needed for an empty list (the buffer's dtype).")
    return tensors[0].dtype


ALIGN_BYTES = 64  # EIGEN_MAX_ALIGN_BYTES: where TensorFlow lets a slice share its buffer


def align_for(dtype: Any) -> int:
    """The ``align`` (in elements of ``dtype``) that starts every piece on a 64-byte boundary."""
    return max(1, ALIGN_BYTES // tf.as_dtype(dtype).size)


def packed_length(sizes: Sequence[int], align: int = 1) -> int:
    """Elements of a buffer that :func:`pack` makes of tensors of ``sizes`` elements, gaps included."""
    return _starts(sizes, align)[1]


def _starts(sizes: Sequence[int], align: int) -> tuple[list[int], int]:
    """Each piece's first element in the buffer, and the buffer's length."""
    if not isinstance(align, int) or align < 1:
        raise ConfigError(f"align must be an int >= 1 (elements), got {align!r}.")
    starts, at = [], 0
    for i, n in enumerate(sizes):
        if i:
            at = -(-at // align) * align
        starts.append(at)
        at += n
    return starts, at


def _with_gaps(tensors: Sequence[tf.Tensor], dtype: tf.DType, align: int) -> list[tf.Tensor]:
    if align == 1:
        return list(tensors)
    sizes = []
    for i, t in enumerate(tensors):
        if not t.shape.is_fully_defined():
            raise ConfigError(f"pack: tensor {i} has shape {t.shape}; align={align} needs fully defined shapes.")
        sizes.append(t.shape.num_elements())
    starts, _ = _starts(sizes, align)
    out: list[tf.Tensor] = []
    for i, t in enumerate(tensors):
        if i and starts[i] > starts[i - 1] + sizes[i - 1]:
            out.append(tf.zeros([starts[i] - starts[i - 1] - sizes[i - 1]], dtype))
        out.append(t)
    return out


def reference_pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0, align: int = 1) -> tf.Tensor:
    """:func:`pack` in plain TF: ``concat([reshape(cast(t * cast(scale, t.dtype), dtype), [-1]) ...])``."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    tensors = _with_gaps(tensors, out, align)
    s = _scale64(scale)
    parts = [tf.reshape(tf.cast(t * tf.cast(s, t.dtype), out), [-1]) for t in tensors]
    if not parts:
        return tf.zeros([0], out)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0, align: int = 1, *,
         use_kernel: bool | None = None) -> tf.Tensor:
    """Packs tensors into one rank-1 buffer: each multiplied by ``scale`` in its own dtype, cast to ``dtype``.

    Args:
      tensors: float16/bfloat16/float32/float64 tensors, dtypes may differ.
      dtype: the buffer's dtype (e.g. tf.float16 to halve the bytes on the
        wire); None: the tensors' common dtype.
      scale: a scalar, e.g. 1/N before summing over N replicas (so fp16 sums
        do not overflow). 1 leaves values unchanged.
      align: each tensor after the first starts at a multiple of this many
        elements, zeros between (:func:`align_for` gives 64 bytes); the
        shapes must then be fully defined.
      use_kernel: as in :func:`fused_lars_apply`.

    Returns:
      A rank-1 tensor of ``sum(t.size)`` elements (plus the gaps), the tensors in order.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    tensors = _with_gaps(tensors, out, align)
    bad = sorted({t.dtype.name for t in tensors if t.dtype not in PACK_DTYPES} |
                 ({out.name} if out not in PACK_DTYPES else set()))
    problem = f"the fused pack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = choose(use_kernel, "pack", [t.device for t in tensors], problem)
    if module is None:
        return reference_pack(tensors, out, scale)
    return module.hvrep_pack(tensors=tensors, scale=_scale64(scale), out_type=out)


def _unpack_args(buffer: tf.Tensor, shapes: Sequence[Any], dtypes: Any,
                 align: int = 1) -> tuple[list[tf.TensorShape], list[tf.DType]]:
    shapes = [tf.TensorShape(s) for s in shapes]
    if dtypes is None or isinstance(dtypes, tf.DType | str) or not isinstance(dtypes, Sequence):
        dtypes = [buffer.dtype if dtypes is None else dtypes] * len(shapes)
    dtypes = [tf.as_dtype(d) for d in dtypes]
    if len(dtypes) != len(shapes):
        raise ConfigError(f"unpack: {len(shapes)} shapes but {len(dtypes)} dtypes; give one dtype per shape.")
    for i, s in enumerate(shapes):
        if not s.is_fully_defined():
            raise ConfigError(f"unpack: shape {i} is {s}; every shape must be fully defined.")
    if buffer.shape.rank not in (1, None):
        raise ConfigError(f"unpack: the buffer must be rank 1, got shape {buffer.shape}.")
    _, total = _starts([s.num_elements() for s in shapes], align)
    if buffer.shape.rank == 1 and buffer.shape[0] is not None and buffer.shape[0] != total:
        gaps = f" with align={align}" if align > 1 else ""
        raise ConfigError(f"unpack: the buffer has {buffer.shape[0]} elements but the {len(shapes)} shapes "
                          f"need {total}{gaps}.")
    return shapes, dtypes


def reference_unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0,
                     align: int = 1) -> list[tf.Tensor]:
    """:func:`unpack` in plain TF: ``[reshape(cast(piece, dtype) * cast(scale, dtype), shape) ...]``."""
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes, align)
    s = _scale64(scale)
    sizes = [s_.num_elements() for s_ in shapes]
    starts, total = _starts(sizes, align)
    spans = [b - a for a, b in zip(starts, [*starts[1:], total], strict=True)]  # each piece and the gap after it
    pieces = [p[:n] for p, n in zip(tf.split(buffer, spans), sizes, strict=True)] if shapes else []
    return [tf.reshape(tf.cast(p, d) * tf.cast(s, d), sh) for p, d, sh in zip(pieces, dtypes, shapes, strict=True)]


def unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0, align: int = 1, *,
           use_kernel: bool | None = None) -> list[tf.Tensor]:
    """Splits a rank-1 buffer into tensors: each piece cast to its dtype, then multiplied by ``scale``.

    Args:
      buffer: rank 1, as :func:`pack` made it.
      shapes: the tensors' shapes (fully defined), in buffer order.
      dtypes: one dtype per shape, or one for all; None: the buffer's dtype.
      scale: a scalar multiplied in after the cast (1 leaves values unchanged).
      align: as the :func:`pack` that made the buffer. With align > 1 and a
        scale of the Python number 1, the fused op returns each piece of the
        buffer's dtype that starts 64-byte aligned as a slice of the buffer
        (no copy); the pieces share its memory, as ``tf.split``'s do.
      use_kernel: as in :func:`fused_lars_apply`.
    """
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes, align)
    bad = sorted({d.name for d in [*dtypes, buffer.dtype] if d not in PACK_DTYPES})
    problem = f"the fused unpack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = choose(use_kernel, "unpack", [buffer.device], problem)
    if module is None:
        return reference_unpack(buffer, shapes, dtypes, scale, align)
    # Shared only for a scale known to be 1 now: the GPU kernel cannot read a
    # scale tensor, which lives in device memory (the CPU kernel checks it).
    share = align > 1 and isinstance(scale, int | float) and not isinstance(scale, bool) and scale == 1
    return module.hvrep_unpack(packed=buffer, scale=_scale64(scale), Tout=dtypes, shapes=shapes, align=align,
                               share=share)


def _register_gradients() -> None:
    # pack and unpack are each other's gradient: d(cast(t*s))/dt = s (cast back).
    @tf.RegisterGradient("HvrepPack")
    def _pack_grad(op: tf.Operation, grad: tf.Tensor) -> list[tf.Tensor | None]:
        inputs = op.inputs[:-1]
        shapes = [t.shape if t.shape.is_fully_defined() else tf.shape(t) for t in inputs]
        if all(isinstance(s, tf.TensorShape) for s in shapes):
            parts = unpack(grad, shapes, [t.dtype for t in inputs], op.inputs[-1])
        else:
            sizes = [tf.size(t) for t in inputs]
            parts = [tf.reshape(tf.cast(p, t.dtype) * tf.cast(op.inputs[-1], t.dtype), tf.shape(t))
                     for p, t in zip(tf.split(grad, sizes), inputs, strict=True)]
        return [*parts, None]

    @tf.RegisterGradient("HvrepUnpack")
    def _unpack_grad(op: tf.Operation, *grads: tf.Tensor | None) -> list[tf.Tensor | None]:
        dense = [tf.zeros(o.shape, o.dtype) if g is None else g for g, o in zip(grads, op.outputs, strict=True)]
        return [pack(dense, op.inputs[0].dtype, op.inputs[1], op.get_attr("align")), None]


_register_gradients()
