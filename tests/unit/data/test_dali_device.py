"""Where a DALI pipeline decodes: the replica's CUDA device, placed on its TensorFlow GPU.

No GPU here: these check which numbers the pipeline is given, not a GPU decode.
"""

import pytest

from hvrep.data import DataConfig
from hvrep.data.dali import _device
from hvrep.errors import ConfigError
from hvrep.replica.context import InputContext
from hvrep.replica.devices import NO_GPU, ReplicaGpu


def _config(dali_device: str) -> DataConfig:
    return DataConfig("/unused", format="folder", backend="dali", dali_device=dali_device)


def test_gpu_decoding_uses_the_contexts_cuda_device_not_tensorflows_index():
    # Rank 5 of a node with 8 visible GPUs: TensorFlow's /gpu:0 (after bind_gpu) is CUDA device 5.
    ctx = InputContext(13, 16, 32, cuda_device=5, tf_device="/gpu:0")
    for setting in ("auto", "mixed"):
        assert _device(_config(setting), ctx) == ("mixed", ReplicaGpu(5, "/gpu:0"))


def test_cpu_setting_and_a_context_without_gpu():
    gpu_ctx = InputContext(0, 2, 4, cuda_device=1, tf_device="/gpu:1")
    assert _device(_config("cpu"), gpu_ctx) == ("cpu", NO_GPU)
    plain = InputContext(0, 2, 4)  # no devices, and TensorFlow sees no GPU here
    assert _device(_config("auto"), plain) == ("cpu", NO_GPU)
    with pytest.raises(ConfigError, match="dali_device='mixed' needs a GPU"):
        _device(_config("mixed"), plain)
