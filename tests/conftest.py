"""Test-process set-up shared by every tier."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

# Two logical CPU devices, so the in-graph (local/TPU) code path runs with two
# replicas in one process. Must happen before TensorFlow initialises devices.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


# pytest-xdist's workers ignore SIGINT, and an ignored signal stays ignored across exec: every launcher a test
# started (prterun, hvrep launch) would ignore the Ctrl-C a test sends it. Tests start their jobs as a terminal would.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
