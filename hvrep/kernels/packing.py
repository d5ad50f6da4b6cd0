"""Fused pack/unpack (many tensors to one rank-1 buffer and back) and their pure-TF references.

With a cast (e.g. to fp16 for the wire) and a scale (e.g. 1/N before a sum
across N replicas), for the fused all-reduce (``hvrep.replica.fusion``).
pack and unpack are each other's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.kernels.loader import choose

PACK_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

def _scale64(scale: Any) -> tf.Tensor:
    s = tf.cast(scale, tf.float64)
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


def reference_pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0) -> tf.Tensor:
    """:func:`pack` in plain TF: ``concat([reshape(cast(t * cast(scale, t.dtype), dtype), [-1]) ...])``."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    s = _scale64(scale)
    parts = [tf.reshape(tf.cast(t * tf.cast(s, t.dtype), out), [-1]) for t in tensors]
    if not parts:
        return tf.zeros([0], out)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0, *, use_kernel: bool | None = None) -> tf.Tensor:
    """Packs tensors into one rank-1 buffer: each multiplied by ``scale`` in its own dtype, cast to ``dtype``.

    Args:
      tensors: float16/bfloat16/float32/float64 tensors, dtypes may differ.
      dtype: the buffer's dtype (e.g. tf.float16 to halve the bytes on the
        wire); None: the tensors' common dtype.
      scale: a scalar, e.g. 1/N before summing over N replicas (so fp16 sums
        do not overflow). 1 leaves values unchanged.
      use_kernel: as in :func:`fused_lars_apply`.

    Returns:
      A rank-1 tensor of ``sum(t.size)`` elements, the tensors in order.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    bad = sorted({t.dtype.name for t in tensors if t.dtype not in PACK_DTYPES} |
                 ({out.name} if out not in PACK_DTYPES else set()))
    problem = f"the fused pack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = choose(use_kernel, "pack", [t.device for t in tensors], problem)
    if module is None:
        return reference_pack(tensors, out, scale)
    return module.hvrep_pack(tensors=tensors, scale=_scale64(scale), out_type=out)


def _unpack_args(buffer: tf.Tensor, shapes: Sequence[Any], dtypes: Any) -> tuple[list[tf.TensorShape], list[tf.DType]]:
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
    total = sum(s.num_elements() for s in shapes)
    if buffer.shape.rank == 1 and buffer.shape[0] is not None and buffer.shape[0] != total:
        raise ConfigError(f"unpack: the buffer has {buffer.shape[0]} elements but the {len(shapes)} shapes "
                          f"need {total}.")
    return shapes, dtypes


def reference_unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0) -> list[tf.Tensor]:
    """:func:`unpack` in plain TF: ``[reshape(cast(piece, dtype) * cast(scale, dtype), shape) ...]``."""
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes)
    s = _scale64(scale)
    pieces = tf.split(buffer, [s_.num_elements() for s_ in shapes]) if shapes else []
    return [tf.reshape(tf.cast(p, d) * tf.cast(s, d), sh) for p, d, sh in zip(pieces, dtypes, shapes, strict=True)]


def unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0, *,
           use_kernel: bool | None = None) -> list[tf.Tensor]:
    """Splits a rank-1 buffer into tensors: each piece cast to its dtype, then multiplied by ``scale``.

    Args:
      buffer: rank 1, as :func:`pack` made it.
      shapes: the tensors' shapes (fully defined), in buffer order.
      dtypes: one dtype per shape, or one for all; None: the buffer's dtype.
      scale: a scalar multiplied in after the cast (1 leaves values unchanged).
      use_kernel: as in :func:`fused_lars_apply`.
    """
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes)
    bad = sorted({d.name for d in [*dtypes, buffer.dtype] if d not in PACK_DTYPES})
    problem = f"the fused unpack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = choose(use_kernel, "unpack", [buffer.device], problem)
    if module is None:
        return reference_unpack(buffer, shapes, dtypes, scale)
    return module.hvrep_unpack(packed=buffer, scale=_scale64(scale), Tout=dtypes, shapes=shapes)


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
        return [pack(dense, op.inputs[0].dtype, op.inputs[1]), None]


_register_gradients()
