"""TensorFlow 2.21 (oneDNN 3.7.3, x86-64 with AVX-512) crashes in the gradient of a strided 1x1 convolution.

The filter gradient (Conv2DBackpropFilter, oneDNN's ``jit_1x1:avx512_core`` backward_weights) of a 1x1
convolution with stride 2 over fewer than 16 input channels, at an odd batch size, with 2 or more intra-op
threads, corrupts the heap: the process dies with SIGSEGV or ``free(): invalid size`` (SIGABRT). It needs
no hvrep; run it after a TensorFlow upgrade:

    python tests/unit/known_issues/onednn_strided_1x1.py; echo $?

0 and "no crash" means the build is fixed (hvrep.layers.SubsamplingConv2D can go); 139 or 134, it still
crashes. docs/troubleshooting.md, "Known issues", has the shapes that crash and the avoidance.
"""

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(2)  # 1 thread does not crash
x = tf.random.normal([63, 32, 32, 8])  # odd batch, 8 channels (any of 1..15 crash; 16 does not)
w = tf.random.normal([1, 1, 8, 16])
for _ in range(10):
    with tf.GradientTape() as tape:
        tape.watch(w)
        y = tf.nn.conv2d(x, w, strides=2, padding="VALID")
    tape.gradient(y, w)
print("no crash")
