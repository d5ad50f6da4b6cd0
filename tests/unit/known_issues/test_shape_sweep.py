"""One training step at ordinary shapes must not crash the process (issue 48).

Batch sizes (odd and even; global, and per replica on 2 in-graph replicas, including global batches that do
not divide by 2) x model widths x thread counts, for ``hvrep train``'s demo model (``small_resnet``) and
ResNet-50's stem, each shape one forward + backward + update step of ``hvrep.train.steps.Runner`` in a child
process (``tests/shape_sweep.py``): a crash fails the test with the shape and the signal, and the rest of the
group still runs. On TF 2.21 without ``hvrep.layers.SubsamplingConv2D`` the demo model at width 4, 8 or 12
and an odd batch per replica died of SIGSEGV or SIGABRT (``free(): invalid size``) on 2 or more threads.
benchmarks/shape_sweep.py sweeps wider.
"""

from __future__ import annotations

import math

import pytest

from tests.shape_sweep import sweep


def _demo(widths, batches):
    return [{"model": "demo", "width": w, "batch": b, "image": 32} for w in widths for b in batches]


def _stem(batches, image=64):
    return [{"model": "stem", "batch": b, "image": image} for b in batches]


# (threads, in-graph replicas) -> shapes. Batches are global; on 2 replicas 63 is 32 + 31, 65 is 33 + 32.
GROUPS = {
    (2, 1): _demo((4, 8, 16), (1, 63, 64)) + _demo((12,), (65,)) + _stem((31, 32)) + _stem((7,), image=224),
    (2, 2): _demo((8, 16), (3, 62, 63, 65)) + _stem((31, 62)),
    (4, 1): _demo((8, 12), (31, 63)) + _stem((63,)),
    (1, 2): _demo((8,), (63,)) + _stem((63,)),
}


@pytest.mark.parametrize(("threads", "replicas"), list(GROUPS), ids=[f"threads{t}-replicas{r}" for t, r in GROUPS])
def test_one_step_at_each_shape_runs(threads: int, replicas: int) -> None:
    results = sweep(GROUPS[threads, replicas], threads, replicas)
    bad = [str(r) for r in results if r.status != "ok"]
    assert not bad, f"{len(bad)} of {len(results)} shapes failed:\n" + "\n".join(bad)
    # A step that ran computed a finite cross-entropy over 10 classes, about ln 10 from a fresh model.
    assert all(math.isfinite(r.loss) and 0 < r.loss < 10 for r in results), [(str(r), r.loss) for r in results]
