"""The SN-GAN app (examples/sngan) on 2 ranks (see runner.py): its step on 2 ranks x B equals 1 process x 2B,
every generator, discriminator and EMA variable (trainable and not: spectral norm's u, batch norm's moving
statistics) to 1e-4 after a few SGD steps. The in-graph side (2 local replicas against Horovod's one rank) needs
two logical CPU devices from the process's start: tests/multirank/test_sngan.py launches it on its own.

Both ranks run every collective before they assert, so one rank's failure does not leave the other waiting.
"""

import numpy as np
import tensorflow as tf

import hvrep
from tests.multirank.sngan_worker import TOL, _train


def case_sngan_step_on_2_ranks_of_b_equals_1_of_2b_for_every_weight():
    dist, ref = hvrep.Replicator("horovod"), hvrep.Replicator("local")
    try:
        assert dist.num_replicas == 2 and ref.num_replicas == 1, (dist.num_replicas, ref.num_replicas)
        want, got = _train(ref), _train(dist)
        assert len(want) == len(got), (len(want), len(got))
        diffs = {k: float(np.max(np.abs(w - g))) for (k, w), g in zip(want.items(), got.values(), strict=True)}
        moved = sum(float(np.max(np.abs(w))) > 0 for w in want.values())
        # Every rank learns every rank's verdict before asserting.
        worst_anywhere = float(dist.reduce(tf.constant(max(diffs.values())), "max"))
    finally:
        ref.close()
        dist.close()
    assert len(diffs) > 60 and moved > 60, (len(diffs), moved)  # G, D, EMA: weights, SN u's, BN statistics
    bad = sorted(((d, k) for k, d in diffs.items() if d > TOL), reverse=True)
    assert not bad and worst_anywhere <= TOL, f"{len(bad)} variables differ by more than {TOL}, worst {bad[:5]}; " \
        f"largest difference on any rank {worst_anywhere}"
