"""Which GPU a replica uses, in the two numberings its consumers use.

TensorFlow numbers the GPUs it shows the process; CUDA, and so DALI's
``device_id``, numbers the devices ``CUDA_VISIBLE_DEVICES`` leaves visible.
``tf.config.set_visible_devices`` narrows only the first: a Horovod rank with
local rank 5, on a node whose 8 GPUs are all visible (as the Slurm scripts
arrange, so NCCL can see its peers), is TensorFlow's ``/gpu:0`` once
:func:`hvrep.replica.backends.horovod.bind_gpu` has run, but CUDA device 5.
Backends compute both numbers once and hand them to ``input_fn`` in
:class:`hvrep.InputContext` (``cuda_device``, ``tf_device``).

No GPU was available to run this: the rules below are tested with fake device
counts and names (``tests/unit/replica/test_devices.py``), never on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

import tensorflow as tf

_T = TypeVar("_T")


class ReplicaGpu(NamedTuple):
    """A replica's GPU: its CUDA device number and TensorFlow's name for it; both None without a GPU."""

    cuda_device: int | None
    tf_device: str | None


NO_GPU = ReplicaGpu(None, None)


def gpu_for(local_rank: int, num_gpus: int) -> int | None:
    """The GPU a replica uses: its local rank (wrapping when ranks outnumber GPUs), or None without GPUs."""
    return local_rank % num_gpus if num_gpus else None


def rank_gpu(local_rank: int, num_cuda_devices: int) -> ReplicaGpu:
    """A one-process-per-replica rank's GPU once ``bind_gpu`` has run: CUDA device
    ``local_rank % num_cuda_devices``, which TensorFlow then shows as its only GPU, ``/gpu:0``.

    Args:
      local_rank: the process's rank on its node.
      num_cuda_devices: CUDA devices the process can see (:func:`count_cuda_devices`).
    """
    cuda = gpu_for(local_rank, num_cuda_devices)
    return NO_GPU if cuda is None else ReplicaGpu(cuda, "/gpu:0")


def replica_gpus(num_tf_gpus: int, num_cuda_devices: int) -> list[ReplicaGpu]:
    """In-graph replicas' GPUs: replica i on TensorFlow's ``/gpu:i``, CUDA device i.

    Assumes TensorFlow's GPU i is CUDA device i, which holds unless the program
    narrowed TensorFlow's view itself (``tf.config.set_visible_devices``) or split
    a GPU into logical devices.
    """
    return [ReplicaGpu(gpu_for(i, num_cuda_devices), f"/gpu:{i}") for i in range(num_tf_gpus)]


def first_visible_gpu(physical: Sequence[_T], visible: Sequence[_T]) -> ReplicaGpu:
    """The GPU TensorFlow shows this process first (``/gpu:0``) and its CUDA number: its place in ``physical``.

    For an InputContext that no Replicator made: it is where TensorFlow puts the
    process's ops, so DALI decodes on the same GPU whether or not a GPU was bound.
    """
    return ReplicaGpu(list(physical).index(visible[0]), "/gpu:0") if visible else NO_GPU


def count_cuda_devices() -> int:
    """The CUDA devices this process can see: TensorFlow's physical GPU list.

    CUDA applies ``CUDA_VISIBLE_DEVICES`` before TensorFlow enumerates, and the
    list is in CUDA's order, so its length counts the devices DALI can number,
    UUID and MIG entries included (parsing the variable here would have to
    redo CUDA's rules). ``tf.config.set_visible_devices`` (``bind_gpu``) leaves
    this list whole. Not ``nvidia-smi``: it ignores ``CUDA_VISIBLE_DEVICES``.
    A CPU-only TensorFlow counts 0, and hvrep decodes on the CPU there.
    """
    return len(tf.config.list_physical_devices("GPU"))


def process_gpu() -> ReplicaGpu:
    """:func:`first_visible_gpu` for this process, from TensorFlow's device lists."""
    return first_visible_gpu(tf.config.list_physical_devices("GPU"), tf.config.get_visible_devices("GPU"))
