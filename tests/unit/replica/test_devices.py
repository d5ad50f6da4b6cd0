"""Which GPU a replica uses, as CUDA (DALI's ``device_id``) and TensorFlow number it.

No GPU runs here: the rules are checked with fake device counts and names.
"""

import pytest

from hvrep.replica.devices import NO_GPU, ReplicaGpu, first_visible_gpu, gpu_for, rank_gpu, replica_gpus


def test_each_rank_gets_the_gpu_of_its_local_rank():
    assert [gpu_for(r, 8) for r in range(8)] == list(range(8))
    assert gpu_for(9, 8) == 1  # more ranks than GPUs on the node: wrap
    assert gpu_for(0, 0) is None  # CPU-only


def test_a_bound_rank_is_cuda_device_local_rank_but_tensorflows_gpu_0():
    # Slurm leaves all 8 of a node's GPUs visible to every rank; bind_gpu narrows only TensorFlow's view.
    assert rank_gpu(5, 8) == ReplicaGpu(cuda_device=5, tf_device="/gpu:0")
    # CUDA_VISIBLE_DEVICES=2,3: CUDA numbers the two visible devices 0 and 1, so local rank 3 wraps to 1.
    assert rank_gpu(3, 2) == ReplicaGpu(1, "/gpu:0")
    assert rank_gpu(0, 1) == ReplicaGpu(0, "/gpu:0")  # one GPU per rank (e.g. --gpus-per-task=1)
    assert rank_gpu(3, 0) == NO_GPU == ReplicaGpu(None, None)


def test_in_graph_replica_i_is_gpu_i_in_both_numberings():
    assert replica_gpus(4, 4) == [ReplicaGpu(i, f"/gpu:{i}") for i in range(4)]
    assert replica_gpus(0, 0) == []


def test_a_context_made_by_hand_gets_the_gpu_tensorflow_shows_first():
    physical = [f"/physical_device:GPU:{i}" for i in range(8)]
    assert first_visible_gpu(physical, physical) == ReplicaGpu(0, "/gpu:0")  # nothing narrowed
    assert first_visible_gpu(physical, [physical[5]]) == ReplicaGpu(5, "/gpu:0")  # after bind_gpu(5)
    assert first_visible_gpu([], []) == NO_GPU


# --- replicas of k devices (Replicator(devices_per_replica=k)) ---


def test_a_rank_of_k_gpus_owns_local_rank_times_k_onward_and_a_rank_short_of_k_is_refused():
    from hvrep.errors import ConfigError
    from hvrep.replica.devices import rank_cuda_devices

    assert rank_cuda_devices(0, 2, 8, 4) == [0, 1]
    assert rank_cuda_devices(3, 2, 8, 4) == [6, 7]
    assert rank_cuda_devices(1, 4, 8, 2) == [4, 5, 6, 7]
    assert rank_cuda_devices(9, 1, 8, 10) == [1]  # one device per replica wraps, as gpu_for does
    assert rank_cuda_devices(1, 2, 0, 2) == []  # no GPU
    # srun --gpus-per-task=2 (or CUDA_VISIBLE_DEVICES per rank): each rank sees its own two, numbered 0 and 1.
    assert rank_cuda_devices(3, 2, 2, 4) == [0, 1]
    # 3 ranks x 2 GPUs on a 4-GPU node: local rank 2 would own GPUs 4 and 5, which do not exist.
    with pytest.raises(ConfigError, match=r"devices_per_replica=2: local rank 2 owns GPUs 4\.\.5, but this "
                                          r"process sees 4 GPU\(s\).*at most 2 rank\(s\) per node"):
        rank_cuda_devices(2, 2, 4, 3)


def test_a_cpu_only_rank_takes_its_first_k_logical_cpus_and_needs_k_of_them():
    from hvrep.errors import ConfigError
    from hvrep.replica.devices import rank_cpu_devices

    cpus = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    assert rank_cpu_devices(2, cpus) == ("/device:CPU:0", "/device:CPU:1")
    with pytest.raises(ConfigError, match=r"devices_per_replica=4, but this rank's process has 3 logical CPU "
                                          r"device\(s\).*set_logical_device_configuration"):
        rank_cpu_devices(4, cpus)


def test_in_graph_devices_split_into_consecutive_groups_of_k_and_k_must_divide_them():
    from hvrep.errors import ConfigError
    from hvrep.replica.devices import group_devices

    gpus = [f"/device:GPU:{i}" for i in range(4)]
    assert group_devices(gpus, 2) == [tuple(gpus[:2]), tuple(gpus[2:])]
    assert group_devices(gpus, 1) == [(g,) for g in gpus]
    assert replica_gpus(4, 4, 2) == [ReplicaGpu(0, "/gpu:0"), ReplicaGpu(2, "/gpu:2")]  # each replica's first
    with pytest.raises(ConfigError, match=r"devices_per_replica=3 does not divide this machine's 4 GPUs"):
        group_devices(gpus, 3)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_devices_per_replica_must_be_a_whole_number_of_at_least_one(bad):
    from hvrep.errors import ConfigError
    from hvrep.replica.devices import check_devices_per_replica

    with pytest.raises(ConfigError, match=rf"devices_per_replica must be a whole number >= 1, got {bad!r}"):
        check_devices_per_replica(bad)
