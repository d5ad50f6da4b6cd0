"""Which devices a replica uses, and its GPU in the two numberings its consumers use.

A replica owns ``devices_per_replica`` (k) devices, named as
``tf.config.list_logical_devices`` names them ("/device:GPU:0",
"/device:CPU:1"): the step places parts of its model on them with
``tf.device``. A Horovod rank with local rank r owns the node's GPUs
r*k ... r*k+k-1 (:func:`rank_cuda_devices`), or, without GPUs, its process's
first k logical CPU devices; in-graph replica i owns the machine's devices
i*k ... i*k+k-1 (:func:`group_devices`).

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

from hvrep.errors import ConfigError

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


def replica_gpus(num_tf_gpus: int, num_cuda_devices: int, devices_per_replica: int = 1) -> list[ReplicaGpu]:
    """In-graph replicas' (first) GPUs: replica i on TensorFlow's ``/gpu:i*k``, CUDA device i*k
    (k = ``devices_per_replica``).

    Assumes TensorFlow's GPU i is CUDA device i, which holds unless the program
    narrowed TensorFlow's view itself (``tf.config.set_visible_devices``) or split
    a GPU into logical devices.
    """
    k = devices_per_replica
    return [ReplicaGpu(gpu_for(i, num_cuda_devices), f"/gpu:{i}") for i in range(0, num_tf_gpus - k + 1, k)]


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


def check_devices_per_replica(k: object) -> int:
    """``k`` if it is a whole number of devices (>= 1).

    Raises:
      hvrep.errors.ConfigError: anything else.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"devices_per_replica must be a whole number >= 1, got {k!r}. Fix: 1 (one device per "
                          "replica, the default) or the number of devices one replica's model is split across.")
    return k


def group_devices(devices: Sequence[str], k: int) -> list[tuple[str, ...]]:
    """In-graph replicas' devices: this machine's ``devices`` in consecutive groups of ``k``, one per replica.

    Raises:
      hvrep.errors.ConfigError: ``k`` does not divide the devices (or there are fewer than ``k``).
    """
    if not devices or len(devices) % k:
        kinds = "GPUs" if devices and "GPU" in devices[0].upper() else "logical CPU devices"
        raise ConfigError(
            f"devices_per_replica={k} does not divide this machine's {len(devices)} {kinds} ({', '.join(devices)}): "
            f"the local backend makes num_devices // {k} replicas of {k} devices each. Fix: a devices_per_replica "
            f"that divides {len(devices)}, or make a multiple of {k} devices visible (CUDA_VISIBLE_DEVICES, or "
            "tf.config.set_logical_device_configuration for CPU devices).")
    return [tuple(devices[i:i + k]) for i in range(0, len(devices), k)]


def rank_cuda_devices(local_rank: int, k: int, num_cuda_devices: int, local_size: int) -> list[int]:
    """The CUDA devices of a one-process-per-replica rank owning ``k`` GPUs.

    ``local_rank*k ... local_rank*k+k-1`` when the node's GPUs are all visible
    (the Slurm scripts' layout, so NCCL sees its peers); all of them when the
    process sees exactly ``k`` (the launcher gave each rank its own:
    ``srun --gpus-per-task=k``, or ``CUDA_VISIBLE_DEVICES`` set per rank). With
    ``k == 1`` a rank wraps when ranks outnumber GPUs (:func:`gpu_for`); with
    ``k > 1`` two ranks would split their models over the same GPUs, so a
    rank short of its ``k`` is refused. Empty without GPUs.

    Raises:
      hvrep.errors.ConfigError: ``k > 1`` and the rank's GPUs do not exist.
    """
    if not num_cuda_devices:
        return []
    if k == 1:
        return [gpu_for(local_rank, num_cuda_devices)]  # type: ignore[list-item]
    if (local_rank + 1) * k <= num_cuda_devices:
        return list(range(local_rank * k, local_rank * k + k))
    if num_cuda_devices == k:
        return list(range(k))
    raise ConfigError(
        f"devices_per_replica={k}: local rank {local_rank} owns GPUs {local_rank * k}..{local_rank * k + k - 1}, "
        f"but this process sees {num_cuda_devices} GPU(s), so it has fewer than {k}. Fix: start at most "
        f"{num_cuda_devices // k} rank(s) per node (here: {local_size}), or lower devices_per_replica, or make "
        f"{local_size * k} GPUs visible to every rank (or exactly {k} to each: srun --gpus-per-task={k}).")


def rank_cpu_devices(k: int, logical_cpus: Sequence[str]) -> tuple[str, ...]:
    """A CPU-only rank's devices: its process's first ``k`` logical CPU devices.

    Raises:
      hvrep.errors.ConfigError: the process has fewer than ``k``.
    """
    if len(logical_cpus) < k:
        raise ConfigError(
            f"devices_per_replica={k}, but this rank's process has {len(logical_cpus)} logical CPU device(s) "
            f"({', '.join(logical_cpus)}) and no GPU. Fix: split the CPU before creating the Replicator, "
            f"`tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0], "
            f"[tf.config.LogicalDeviceConfiguration()] * {k})`, or lower devices_per_replica.")
    return tuple(logical_cpus[:k])
