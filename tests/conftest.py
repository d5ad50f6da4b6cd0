"""Test-process set-up shared by every tier."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

# Two logical CPU devices, so the in-graph (local/TPU) code path runs with two
# replicas in one process. Must happen before TensorFlow initialises devices.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

