"""Each Horovod rank binds to the GPU of its local rank (the rule; no GPU runs here)."""

from hvrep.replica.backends.horovod import gpu_for


def test_each_rank_gets_the_gpu_of_its_local_rank():
    assert [gpu_for(r, 8) for r in range(8)] == list(range(8))
    assert gpu_for(9, 8) == 1  # more ranks than GPUs on the node: wrap
    assert gpu_for(0, 0) is None  # CPU-only
