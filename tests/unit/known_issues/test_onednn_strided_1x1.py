"""The known oneDNN crash (onednn_strided_1x1.py, a few lines of plain TensorFlow) and hvrep's avoidance of it.

The reproduction runs in a child: on this TensorFlow build it either dies of a signal (the bug is still
there: hvrep.layers.SubsamplingConv2D is needed) or prints "no crash" (the bug is fixed: a warning says the
avoidance can go). Anything else (an exception: the script no longer runs on this TensorFlow) fails.
SubsamplingConv2D at the same shapes and threads must run, and compute what Keras' Conv2D computes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvrep.layers import SubsamplingConv2D

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
FATAL = {-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS}

AVOIDED = """
import tensorflow as tf
from hvrep.layers import SubsamplingConv2D
tf.config.threading.set_intra_op_parallelism_threads(2)
layer = SubsamplingConv2D(16, 1, strides=2, use_bias=False)
x = tf.random.normal([63, 32, 32, 8])
layer.build(x.shape)
for _ in range(10):
    with tf.GradientTape() as tape:
        y = layer(x)
    tape.gradient(y, layer.kernel)
print("no crash")
"""


def _child(args: list[str]) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_the_standalone_reproduction_says_whether_this_tensorflow_still_crashes():
    proc = _child([str(HERE / "onednn_strided_1x1.py")])
    if proc.returncode == 0:
        assert proc.stdout.strip().endswith("no crash"), proc.stdout
        warnings.warn(f"TensorFlow {tf.__version__} no longer crashes in onednn_strided_1x1.py: "
                      "hvrep.layers.SubsamplingConv2D and its entry in docs/troubleshooting.md can go.", stacklevel=1)
    else:
        assert proc.returncode in FATAL, f"exit {proc.returncode}, not a crash:\n{proc.stderr[-3000:]}"


def test_subsampling_conv_runs_the_shapes_that_crash():
    proc = _child(["-c", AVOIDED])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("no crash"), \
        f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(("channels", "strides", "padding"), [(8, 2, "valid"), (3, 2, "same"), (12, (2, 3), "same"),
                                                              (16, 2, "valid"), (8, 1, "same")])
def test_subsampling_conv_computes_what_keras_conv2d_does(channels, strides, padding):
    # An even batch and odd spatial sizes: Keras' own layer does not crash here, and "same" pads nothing at 1x1.
    x = tf.random.stateless_normal([4, 15, 17, channels], seed=[1, 2])
    ours = SubsamplingConv2D(6, 1, strides=strides, padding=padding)
    theirs = keras.layers.Conv2D(6, 1, strides=strides, padding=padding)
    ours.build(x.shape)
    theirs.build(x.shape)
    theirs.set_weights(ours.get_weights())
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        a, b = ours(x), theirs(x)
        la, lb = tf.reduce_sum(a * a), tf.reduce_sum(b * b)
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    grads_a = tape.gradient(la, [x, ours.kernel, ours.bias])
    grads_b = tape.gradient(lb, [x, theirs.kernel, theirs.bias])
    for ga, gb in zip(grads_a, grads_b, strict=True):
        np.testing.assert_allclose(ga.numpy(), gb.numpy(), rtol=1e-4, atol=1e-4)


def test_no_strided_1x1_convolution_of_a_narrow_input_is_left_in_the_graph():
    layer = SubsamplingConv2D(16, 1, strides=2, use_bias=False)
    x = tf.zeros([3, 32, 32, 8])
    layer.build(x.shape)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = layer(x)
        return tape.gradient(y, layer.kernel)

    graph = step.get_concrete_function(x).graph
    convs = [op for op in graph.get_operations() if op.type.startswith("Conv2D")]
    assert convs and all(list(op.get_attr("strides")) == [1, 1, 1, 1] for op in convs), \
        [(op.type, op.get_attr("strides")) for op in convs]


def test_subsampling_conv_round_trips_through_keras_serialization():
    layer = SubsamplingConv2D(6, 1, strides=2, name="res3a_branch1")
    again = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(again) is SubsamplingConv2D and again.get_config() == layer.get_config()
