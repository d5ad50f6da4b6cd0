"""hvrep's own reductions skip Horovod's fusion window; a user's own all-reduces keep it (flush_probe.py).

Under each launcher, two launches side by side: ``HOROVOD_CYCLE_TIME`` of 4 s, where a traced step of hvrep's
all-reduce or ``wrap_optimizer`` takes at least the cycle time if it waits the window, and well under it when it
does not (no bound on how fast: only that it does not wait 4 s; today's build takes it); PowerSGD's steps stay
exact; and the user's two ``hvd.allreduce`` in one step, which still come out of one fused response.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import harness

PROBE = str(Path(__file__).with_name("flush_probe.py"))
pytestmark = [pytest.mark.multirank]

CYCLE_MS = 4000
# Both ranks on one host: hvrep's reductions would take its shared-memory all-reduce, which has no fusion window;
# these probes ask how its Horovod build serves them (as on several hosts), so they go through Horovod.
VARIANTS = {"flush": {"FLUSH_PROBE_MODE": "flush", "HOROVOD_CYCLE_TIME": str(CYCLE_MS),
                      "HVREP_LOCAL_TRANSPORT": "horovod"},
            "fusion": {"FLUSH_PROBE_MODE": "fusion", "HOROVOD_CYCLE_TIME": "100", "HOROVOD_TIMELINE": "DYNAMIC",
                       "HVREP_LOCAL_TRANSPORT": "horovod"}}


@pytest.fixture(scope="module", params=["mpirun", "horovodrun"])
def probe(request, tmp_path_factory) -> dict[str, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp(f"horovod-flush-{request.param}")
    variants = {**VARIANTS, "fusion": {**VARIANTS["fusion"], "FLUSH_PROBE_DIR": str(tmp)}}
    runs = harness.side_by_side_runs(harness.two_ranks(request.param, [PROBE]), variants, tmp, "FLUSH_PROBE",
                                     timeout=240)
    got = {variant: {r["rank"]: r for r in lines} for variant, lines in runs.items()}
    for variant, lines in got.items():
        assert sorted(lines) == [0, 1], (variant, runs)
    return got


def test_hvrep_reductions_do_not_wait_the_fusion_window(probe):
    for rank, r in probe["flush"].items():
        assert r["cycle_time_ms"] == str(CYCLE_MS), r
        assert r["all_reduce"] == [3.0, 30.0], (rank, r)  # 1 + 2; 10 + 20
        assert r["wrap_optimizer"] == [-3.0] * 5, (rank, r)  # two steps of lr 1 times the mean of 1 and 2
        # Waiting the window, each would take >= 4 s (measured on main: 4.0 s); half of that leaves room for load.
        assert r["all_reduce_s"] < CYCLE_MS / 2000 and r["wrap_optimizer_s"] < CYCLE_MS / 2000, (rank, r)
        assert r["powersgd_error"] <= 1e-5, (rank, r)


def test_a_users_own_allreduces_still_fuse(probe):
    for rank, r in probe["fusion"].items():
        assert r["user_sums"] == [3.0, 5.0], (rank, r)
    fused = probe["fusion"][0]["fused"]  # rank 0 writes the timeline
    assert any("user_a" in n for n in fused) and any("user_b" in n for n in fused), probe["fusion"][0]
