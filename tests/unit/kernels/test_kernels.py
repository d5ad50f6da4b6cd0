"""hvrep's fused ops (hvrep.kernels) against their pure-TF references.

CI builds the kernels (`make setup`), so the fused path must be active here:
a missing build fails these tests instead of quietly testing the reference
against itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep import kernels
from hvrep.errors import ConfigError, KernelError
from hvrep.kernels import loader
from hvrep.models import resnet50_variable_shapes
from hvrep.optimizers import DEFAULT_EXCLUDE, LARS, MomentumSGD

SHAPES = resnet50_variable_shapes()
HYPER = dict(momentum=0.9, weight_decay=5e-4, eta=0.001, epsilon=1e-9)


def test_the_fused_path_is_active():
    st = kernels.status()
    assert st.path == "fused", st.describe()
    assert "CPU" in st.devices and kernels.available("CPU")


def _flags(paths):
    excluded = [any(re.search(p, path) for p in DEFAULT_EXCLUDE) for path in paths]
    return [not e for e in excluded], [not e for e in excluded]


def _lars_vars(rng, shapes, dtype, zero=()):
    ws, vs = [], []
    for i, s in enumerate(shapes):
        w = np.zeros(s, dtype) if i in zero else rng.normal(size=s).astype(dtype)
        ws.append(tf.Variable(w))
        vs.append(tf.Variable(rng.normal(scale=0.01, size=s).astype(dtype)))
    return ws, vs


def _run_lars(dtype, nesterov, steps, shapes=None, zero_w=(), zero_g_at=None):
    """Runs fused and reference from the same start; returns both (weights, slots) after `steps`."""
    shapes = shapes or [s for _, s in SHAPES]
    paths = [p for p, _ in SHAPES] if shapes is None or len(shapes) == len(SHAPES) else [f"v{i}" for i in
                                                                                          range(len(shapes))]
    decay, adapt = _flags(paths)
    out = []
    for use_kernel in (True, False):
        rng = np.random.default_rng(0)
        ws, vs = _lars_vars(rng, shapes, dtype, zero_w)
        for step in range(steps):
            grads = [tf.constant(np.zeros(s, dtype) if zero_g_at == (step, i) else rng.normal(size=s).astype(dtype))
                     for i, s in enumerate(shapes)]
            fn = kernels.fused_lars_apply if use_kernel else kernels.reference_lars_apply
            kwargs = {"use_kernel": True} if use_kernel else {}
            fn(ws, vs, grads, tf.constant(0.7, dtype), **HYPER, nesterov=nesterov, decay=decay, adapt=adapt,
               **kwargs)
        out.append(([w.numpy() for w in ws], [v.numpy() for v in vs]))
    return out


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_equals_the_reference_on_resnet50_float32(nesterov):
    (fw, fv), (rw, rv) = _run_lars(np.float32, nesterov, steps=3, zero_w=(0, 1), zero_g_at=(1, 3))
    for (p, _), a, b, va, vb in zip(SHAPES, fw, rw, fv, rv, strict=True):
        # float32 rounds each element; the norms are summed in another order
        # (the kernel accumulates in double): compare each tensor relative to its norm.
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        verr = np.linalg.norm(va - vb) / max(np.linalg.norm(vb), 1e-30)
        assert err <= 1e-6 and verr <= 1e-6, (p, err, verr)
        assert np.all(np.isfinite(a)), p


def test_lars_equals_the_reference_element_by_element_in_float64():
    shapes = [s for _, s in SHAPES[:40]]  # float64 doubles the memory; 40 tensors cover every kind
    (fw, fv), (rw, rv) = _run_lars(np.float64, False, steps=3, shapes=shapes, zero_w=(2,), zero_g_at=(0, 5))
    for a, b in zip(fw + fv, rw + rv, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)


def test_lars_on_zero_tensors_uses_ratio_one_and_stays_finite():
    w, v = tf.Variable(np.zeros(70000, np.float32)), tf.Variable(np.zeros(70000, np.float32))
    g = tf.ones(70000)
    kernels.fused_lars_apply([w], [v], [g], 0.5, **HYPER, decay=[True], adapt=[True], use_kernel=True)
    # |w| = 0: ratio 1, so v = lr * (g + wd * 0) = 0.5 and w = -0.5 exactly.
    np.testing.assert_array_equal(v.numpy(), np.full(70000, 0.5, np.float32))
    np.testing.assert_array_equal(w.numpy(), np.full(70000, -0.5, np.float32))


def test_lars_empty_list_and_empty_tensors():
    kernels.fused_lars_apply([], [], [], 0.1, **HYPER, decay=[], adapt=[], use_kernel=True)
    w, v = tf.Variable(np.zeros((0, 3), np.float32)), tf.Variable(np.zeros((0, 3), np.float32))
    x, y = tf.Variable([1.0, 2.0]), tf.Variable([0.0, 0.0])
    kernels.fused_lars_apply([w, x], [v, y], [tf.zeros((0, 3)), tf.constant([1.0, 1.0])], 0.1, **HYPER,
                             decay=[True, False], adapt=[True, False], use_kernel=True)
    np.testing.assert_allclose(x.numpy(), [0.9, 1.9], rtol=1e-6)


def test_lars_mixed_dtypes_go_one_op_per_dtype_and_half_takes_the_reference():
    rng = np.random.default_rng(1)
    dtypes = [np.float32, np.float64, np.float32, np.float16]
    results = []
    for use_kernel in (None, False):
        ws = [tf.Variable(rng.normal(size=(5, 7)).astype(d)) for d in dtypes]
        vs = [tf.Variable(np.zeros((5, 7), d)) for d in dtypes]
        gs = [tf.constant(np.arange(35, dtype=d).reshape(5, 7) / 7) for d in dtypes]
        kernels.fused_lars_apply(ws, vs, gs, 0.3, **HYPER, decay=[True] * 4, adapt=[True] * 4,
                                 use_kernel=use_kernel)
        results.append([w.numpy() for w in ws])
        rng = np.random.default_rng(1)
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6 if a.dtype != np.float16 else 0)
    ws = [tf.Variable(np.ones(3, np.float16))]
    with pytest.raises(KernelError, match="float16"):
        kernels.fused_lars_apply(ws, ws, [tf.ones(3, tf.float16)], 0.1, **HYPER, decay=[True], adapt=[True],
                                 use_kernel=True)


def test_lars_is_deterministic():
    runs = [_run_lars(np.float32, False, steps=2, shapes=[(3, 3, 256, 256), (512,), (1000, 2048)])[0][0]
            for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lars_copies_a_variable_whose_old_value_is_still_held():
    w, v = tf.Variable(np.ones(100000, np.float32)), tf.Variable(np.zeros(100000, np.float32))
    before = w.read_value()  # may alias w's buffer: the update must not write into it
    kernels.fused_lars_apply([w], [v], [tf.ones(100000)], 0.5, **HYPER, decay=[False], adapt=[False],
                             use_kernel=True)
    np.testing.assert_array_equal(before.numpy(), np.ones(100000, np.float32))
    np.testing.assert_array_equal(w.numpy(), np.full(100000, 0.5, np.float32))


def test_lars_bad_arguments_are_named():
    w, v = tf.Variable(np.ones((2, 3), np.float32)), tf.Variable(np.zeros((2, 3), np.float32))
    with pytest.raises(ConfigError, match=r"variable 0 .* shape \(2, 3\).* gradient \(3, 2\)"):
        kernels.fused_lars_apply([w], [v], [tf.ones((3, 2))], 0.1, **HYPER, decay=[True], adapt=[True])
    with pytest.raises(ConfigError, match="lengths"):
        kernels.fused_lars_apply([w], [v], [tf.ones((2, 3))], 0.1, **HYPER, decay=[True, True], adapt=[True])
    with pytest.raises(ConfigError, match=r"gradient 0 .* is None"):
        kernels.fused_lars_apply([w], [v], [None], 0.1, **HYPER, decay=[True], adapt=[True])


def _raw():
    module = loader._load()[0]
    assert module is not None
    return module


def test_the_op_itself_validates_shapes_duplicates_and_hyper_parameters():
    op = _raw().hvrep_fused_lars_apply
    w, v = tf.Variable(np.ones((2, 3), np.float32)), tf.Variable(np.zeros((2, 3), np.float32))
    hyper = tf.constant([0.9, 0.0, 0.001, 0.0], tf.float64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variable 0 has shape \[2,3\].*gradient \[6\]"):
        op(var=[w.handle], mom=[v.handle], grad=[tf.ones(6)], lr=tf.constant(0.1), hyper=hyper, flags=[3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="appears twice"):
        op(var=[w.handle], mom=[w.handle], grad=[tf.ones((2, 3))], lr=tf.constant(0.1), hyper=hyper, flags=[3])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"momentum=1.5"):
        op(var=[w.handle], mom=[v.handle], grad=[tf.ones((2, 3))], lr=tf.constant(0.1),
           hyper=tf.constant([1.5, 0.0, 0.001, 0.0], tf.float64), flags=[3])
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="flags"):
        op(var=[w.handle], mom=[v.handle], grad=[tf.ones((2, 3))], lr=tf.constant(0.1), hyper=hyper, flags=[3, 3])
    np.testing.assert_array_equal(w.numpy(), np.ones((2, 3)))  # nothing was half-applied


def test_under_xla_the_reference_runs_and_use_kernel_true_says_why():
    w, v = tf.Variable(np.ones(4, np.float32)), tf.Variable(np.zeros(4, np.float32))

    @tf.function(jit_compile=True)
    def step(use_kernel):
        kernels.fused_lars_apply([w], [v], [tf.ones(4)], 0.5, **HYPER, decay=[False], adapt=[False],
                                 use_kernel=use_kernel)

    step(None)
    np.testing.assert_allclose(w.numpy(), np.full(4, 0.5))
    with pytest.raises(KernelError, match="XLA"):
        step(True)


# ---------------------------------------------------------------------------
# pack / unpack


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _same(a: tf.Tensor, b: tf.Tensor) -> bool:
    a, b = a.numpy(), b.numpy()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == "f" and a.dtype.itemsize >= 2 and a.dtype.name != "bfloat16":
        return bool(np.all((_bits(a) == _bits(b)) | (np.isnan(a) & np.isnan(b))))
    return bool(np.all(_bits(a) == _bits(b)) or np.array_equal(a, b, equal_nan=True))


def _grads(rng, dtype=np.float32):
    return [tf.constant(rng.normal(size=s).astype(dtype)) for _, s in SHAPES]


@pytest.mark.parametrize("out", [tf.float32, tf.float16, tf.bfloat16, tf.float64])
@pytest.mark.parametrize("scale", [1.0, 0.125, 1 / 3])
def test_pack_and_unpack_equal_the_reference_on_resnet50(out, scale):
    grads = _grads(np.random.default_rng(2))
    fused = kernels.pack(grads, out, scale, use_kernel=True)
    assert _same(fused, kernels.reference_pack(grads, out, scale))
    shapes, dtypes = [g.shape for g in grads], [g.dtype for g in grads]
    back = kernels.unpack(fused, shapes, dtypes, 1 / scale, use_kernel=True)
    ref = kernels.reference_unpack(fused, shapes, dtypes, 1 / scale)
    assert all(_same(a, b) for a, b in zip(back, ref, strict=True))
    if out == tf.float32 and scale == 0.125:  # a power of two: exact round trip
        assert all(_same(a, b) for a, b in zip(back, grads, strict=True))


def test_pack_and_unpack_mixed_dtypes_and_special_values():
    special = np.array([0.0, -0.0, 1e-8, -3e-42, 65504.0, 70000.0, np.inf, -np.inf, np.nan, 1 + 2**-11, 1 + 3 * 2**-11,
                        3.3895e38], np.float64)
    tensors = [tf.constant(special.astype(d)) for d in (np.float16, np.float32, np.float64)]
    tensors += [tf.constant(special.astype(np.float32), tf.bfloat16), tf.zeros((0, 4)), tf.zeros((2, 2))]
    for out in kernels.PACK_DTYPES:
        for scale in (1.0, 0.5, 3.0):
            fused = kernels.pack(tensors, out, scale, use_kernel=True)
            assert _same(fused, kernels.reference_pack(tensors, out, scale)), (out, scale)
            shapes, dtypes = [t.shape for t in tensors], [t.dtype for t in tensors]
            got = kernels.unpack(fused, shapes, dtypes, scale, use_kernel=True)
            ref = kernels.reference_unpack(fused, shapes, dtypes, scale)
            assert all(_same(a, b) for a, b in zip(got, ref, strict=True)), (out, scale)


def test_pack_and_unpack_empty_lists():
    packed = kernels.pack([], tf.float16, use_kernel=True)
    assert packed.shape == (0,) and packed.dtype == tf.float16
    assert kernels.unpack(packed, [], [], use_kernel=True) == []


def test_pack_and_unpack_bad_arguments_are_named():
    with pytest.raises(ConfigError, match=r"dtypes .*float16.*float32.*pass dtype="):
        kernels.pack([tf.zeros(2), tf.zeros(2, tf.float16)])
    with pytest.raises(ConfigError, match="buffer has 5 elements but the 2 shapes need 6"):
        kernels.unpack(tf.zeros(5), [(2,), (4,)])
    with pytest.raises(ConfigError, match=r"shape 0 is .*fully defined"):
        kernels.unpack(tf.zeros(5), [(None, 5)])
    with pytest.raises(ConfigError, match="2 shapes but 1 dtypes"):
        kernels.unpack(tf.zeros(6), [(2,), (4,)], [tf.float32])
    with pytest.raises(KernelError, match="int32"):
        kernels.pack([tf.zeros(2, tf.int32)], use_kernel=True)
    # int32 takes the reference path by default (the all-reduce packs any dtype).
    assert kernels.pack([tf.constant([1, 2], tf.int32)]).numpy().tolist() == [1, 2]
    # The op itself checks the runtime size (a dynamic buffer escapes the Python check).
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"buffer has shape \[5\].*need \[6\]"):
        _raw().hvrep_unpack(packed=tf.zeros(5), scale=tf.constant(1.0, tf.float64), Tout=[tf.float32] * 2,
                            shapes=[[2], [4]])


def test_pack_and_unpack_gradients_match_the_reference():
    a, b = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)), tf.constant([1.0, -2.0], tf.float64)
    grads = []
    for use_kernel in (True, False):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            packed = kernels.pack([a, b], tf.float32, 0.5, use_kernel=use_kernel)
            parts = kernels.unpack(packed * packed, [(2, 3), (2,)], [tf.float32, tf.float64], 2.0,
                                   use_kernel=use_kernel)
            loss = tf.reduce_sum(parts[0]) + tf.reduce_sum(tf.cast(parts[1], tf.float32))
        grads.append(tape.gradient(loss, [a, b]))
    for x, y in zip(*grads, strict=True):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6)
    # d/da sum(2 * (0.5 a)^2) = a
    np.testing.assert_allclose(grads[0][0].numpy(), a.numpy(), rtol=1e-6)


def _address(t: tf.Tensor) -> int:
    # The buffer's address, through DLPack (EagerTensor.numpy() may copy).
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return ctypes.cast(get(tf.experimental.dlpack.to_dlpack(t), b"dltensor"), ctypes.POINTER(ctypes.c_void_p))[0]


@pytest.mark.parametrize("use_kernel", [True, False])
def test_aligned_pack_puts_zeros_between_and_unpack_gives_the_pieces_back(use_kernel):
    sizes = [15, 16, 1, 33, 7]  # in float32: gaps of 1, 0, 15, 15 elements to 64-byte starts
    parts = [tf.constant(np.arange(1, n + 1, dtype=np.float32)) for n in sizes]
    buf = kernels.pack(parts, tf.float32, 2.0, align=16, use_kernel=use_kernel).numpy()
    starts = [0, 16, 32, 48, 96]
    assert buf.shape == (103,) and kernels.packed_length(sizes, 16) == 103
    expect = np.zeros(103, np.float32)
    for s, n in zip(starts, sizes, strict=True):
        expect[s:s + n] = 2 * np.arange(1, n + 1)
    np.testing.assert_array_equal(buf, expect)  # zeros in every gap
    for dtypes, scale in ((tf.float32, 1), (tf.float64, 0.5)):
        back = kernels.unpack(tf.constant(buf), [(n,) for n in sizes], dtypes, scale, align=16, use_kernel=use_kernel)
        for p, b in zip(parts, back, strict=True):
            np.testing.assert_array_equal(b.numpy(), p.numpy().astype(b.dtype.as_numpy_dtype) * 2 * scale)
    with pytest.raises(ConfigError, match="buffer has 101 elements but the 5 shapes need 103 with align=16"):
        kernels.unpack(tf.zeros(101), [(n,) for n in sizes], align=16, use_kernel=use_kernel)


def test_aligned_unpack_shares_the_buffer_only_where_no_cast_or_scale_is_needed():
    sizes = [1000, 1001, 17, 4096]
    buf = kernels.pack([tf.ones([n]) for n in sizes], tf.float32, align=16, use_kernel=True)
    base = _address(buf)
    starts = [0, 1008, 2016, 2048]
    shared = kernels.unpack(buf, [(n,) for n in sizes], align=16, use_kernel=True)
    assert [_address(t) - base for t in shared] == [4 * s for s in starts]
    dense = kernels.pack([tf.ones([n]) for n in sizes], tf.float32, use_kernel=True)
    copied = kernels.unpack(dense, [(n,) for n in sizes], use_kernel=True)  # align 1: copies, as before
    assert not any(0 <= _address(t) - _address(dense) < 4 * dense.shape[0] for t in copied)
    scaled = kernels.unpack(buf, [(n,) for n in sizes], scale=0.5, align=16, use_kernel=True)
    assert not any(0 <= _address(t) - base < 4 * buf.shape[0] for t in scaled)
    assert all(np.all(t.numpy() == 0.5) for t in scaled)
    # The op refuses share=true with a scale that is not 1 (it would not be applied).
    with pytest.raises(tf.errors.InvalidArgumentError, match="share=true needs a scale of 1"):
        _raw().hvrep_unpack(packed=buf, scale=tf.constant(0.5, tf.float64), Tout=[tf.float32] * 4,
                            shapes=[[n] for n in sizes], align=16, share=True)


def test_aligned_pack_and_unpack_gradients():
    a, b = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)), tf.constant(np.arange(20, dtype=np.float32))
    for use_kernel in (True, False):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            packed = kernels.pack([a, b], tf.float32, 0.5, align=16, use_kernel=use_kernel)
            assert packed.shape == (36,)
            parts = kernels.unpack(packed * packed, [(2, 3), (20,)], align=16, use_kernel=use_kernel)
            loss = tf.reduce_sum(parts[0]) + tf.reduce_sum(parts[1])
        ga, gb = tape.gradient(loss, [a, b])
        np.testing.assert_allclose(ga.numpy(), 0.5 * a.numpy(), rtol=1e-6)  # d/dx (x/2)^2 = x/2
        np.testing.assert_allclose(gb.numpy(), 0.5 * b.numpy(), rtol=1e-6)


def test_the_fused_all_reduce_aligns_a_bucket_only_where_the_gaps_are_small():
    from hvrep.replica.fusion import fused_reduce

    seen = []

    def reduce_buffer(buf):
        seen.append(buf.shape[0])
        return buf * 2.0

    # Packed last tensor first (the backward pass's order): 1003, 1002, 1001, 1000 elements,
    # gaps of 5, 6 and 7 to 64-byte starts: 18 of 4,006, under 1%.
    large = [tf.ones([1000 + i]) for i in range(4)]
    small = [tf.ones([3 + i]) for i in range(4)]  # gaps would more than double the bucket
    for tensors, length in ((large, 4024), (small, 18)):
        out = fused_reduce(tensors, reduce_buffer, threshold=1 << 20)
        assert seen[-1] == length
        assert all(np.all(o.numpy() == 2.0) and o.shape == t.shape for o, t in zip(out, tensors, strict=True))


def test_the_fused_all_reduce_packs_buckets_with_the_op():
    from hvrep.replica.fusion import fused_reduce

    tensors = [tf.constant(np.arange(n, dtype=np.float32)) for n in (3, 5, 7)]

    @tf.function
    def reduce(ts):
        return fused_reduce(ts, lambda buf: buf * 2.0, threshold=1 << 20, wire_dtype=tf.float16, prescale=0.5)

    out = reduce(tensors)
    for t, o in zip(tensors, out, strict=True):
        np.testing.assert_array_equal(o.numpy(), t.numpy())  # 0.5 * 2: exact in fp16 for these integers
    ops = {op.type for op in reduce.get_concrete_function(tensors).graph.get_operations()}
    assert {"HvrepPack", "HvrepUnpack"} <= ops, ops


@pytest.mark.parametrize("use_kernel", [True, False])
def test_a_float64_scale_is_not_rounded_to_float32(use_kernel):
    # A mean over 3 replicas multiplies by 1/3: in float64 that is 1/3 to 53 bits, not float32's 0.33333334.
    from hvrep.replica.fusion import fused_reduce

    x = np.arange(1, 8, dtype=np.float64)
    want = x * (1 / 3)
    packed = kernels.pack([tf.constant(x)], None, 1 / 3, use_kernel=use_kernel)
    np.testing.assert_array_equal(packed.numpy(), want)
    (back,) = kernels.unpack(tf.constant(x), [(7,)], tf.float64, 1 / 3, use_kernel=use_kernel)
    np.testing.assert_array_equal(back.numpy(), want)
    # The fused all-reduce's prescale, for a bucket and for a tensor alone.
    for tensors in ([tf.constant(x), tf.constant(x[:3])], [tf.constant(x)]):
        out = fused_reduce(tensors, tf.identity, threshold=1 << 20, prescale=1 / 3)
        np.testing.assert_array_equal(out[0].numpy(), want)


# ---------------------------------------------------------------------------
# The optimizer.


def _small_model_vars(seed):
    rng = np.random.default_rng(seed)
    out = []
    for path, shape in SHAPES[:12]:
        scope, name = path.split("/")
        with keras.name_scope(scope):
            out.append(keras.Variable(rng.normal(size=shape).astype(np.float32), name=name))
    return out


def _apply_fn(opt, variables):
    # A closure: tf.function would trace default arguments as symbolic inputs.
    def apply(grads):
        opt.apply_gradients(zip(grads, variables, strict=True))

    return apply


@pytest.mark.parametrize("cls", [LARS, MomentumSGD])
def test_optimizers_fused_and_per_variable_agree_in_tf_function(cls):
    results = []
    for fused in (True, False):
        variables = _small_model_vars(3)
        opt = cls(0.5, weight_decay=1e-4, nesterov=True, use_fused_kernel=fused)
        opt.build(variables)
        step = tf.function(_apply_fn(opt, variables))
        rng = np.random.default_rng(4)
        for _ in range(3):
            step([tf.constant(rng.normal(size=v.shape).astype(np.float32)) for v in variables])
        results.append([v.numpy() for v in variables])
        assert int(opt.iterations.numpy()) == 3
    for a, b in zip(*results, strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(b)


def test_optimizer_option_round_trips_and_is_refused_under_a_strategy():
    opt = LARS(0.1, use_fused_kernel=False)
    assert LARS.from_config(opt.get_config()).use_fused_kernel is False
    with pytest.raises(ConfigError, match="use_fused_kernel"):
        LARS(0.1, use_fused_kernel="yes")
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        v = keras.Variable(np.ones(3, np.float32), name="w")
        opt = LARS(0.1, use_fused_kernel=True)
        opt.build([v])
    with pytest.raises(KernelError, match="strategy"):
        strategy.run(lambda: opt.apply_gradients([(tf.ones(3), v)]))


def test_switched_off_by_the_environment():
    code = ("import tensorflow as tf; from hvrep import kernels; from hvrep.errors import KernelError\n"
            "st = kernels.status(); print(st.path, '|', st.reason)\n"
            "try:\n    kernels.pack([tf.zeros(2)], use_kernel=True)\n"
            "except KernelError as e:\n    print('KernelError', e)\n")
    env = {**os.environ, "HVREP_KERNELS": "off", "TF_CPP_MIN_LOG_LEVEL": "3"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "reference | switched off by HVREP_KERNELS=off" in res.stdout
    assert "KernelError pack: use_kernel=True but the fused kernel cannot run" in res.stdout
