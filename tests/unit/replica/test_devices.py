"""Which GPU a replica uses, as CUDA (DALI's ``device_id``) and TensorFlow number it.

No GPU runs here: the rules are checked with fake device counts and names.
"""

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
