"""benchmarks/d4pg.py --learner-only: one round of its four contenders (1 rank, 2 ranks under mpirun, 2 under
horovodrun --gloo, two 1-rank learners apart on a core each), each learning from a replay filled once with no
actors; the lines' schema and the ratios computed from the same round's launches; ``--env`` reaches every
launch's record; per-step CPU time and context switches, and the 2-rank step's all-reduce split into waiting
and the rest. ``--interleave``: the contenders launched once each and run in turn, each stopped while the others
run. No timing bounds: the figures are docs/performance.md's."""

from __future__ import annotations

import json
import sys

import pytest

from tests.multirank import harness

pytestmark = [pytest.mark.multirank]

CONTENDERS = ["1 rank", "2 ranks horovodrun", "2 ranks mpirun", "2 x 1 rank apart"]


def _learner_only(tmp_path, *args: str) -> tuple[list[dict], dict[str, dict]]:
    """benchmarks/d4pg.py --learner-only with ``args``: every line it wrote, and its per-contender lines by name."""
    out = tmp_path / "d4pg.jsonl"
    cmd = [sys.executable, str(harness.ROOT / "benchmarks" / "d4pg.py"), "--learner-only", *args,
           "--env", "HOROVOD_CYCLE_TIME=0.1", "--out", str(out)]
    rc = harness.run_logged(cmd, tmp_path / "log", timeout=420)
    assert rc == 0, (tmp_path / "log").read_text()[-4000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    kind = "learner_interleaved" if "--interleave" in args else "learner"
    learners = {r["contender"]: r for r in lines if r["kind"] == kind}
    assert sorted(learners) == CONTENDERS
    return lines, learners


def test_learner_only_round(tmp_path):
    lines, learners = _learner_only(tmp_path, "--rounds", "1", "--learner-steps", "5")
    for name, r in learners.items():
        assert r["rc"] == 0, r
        assert r["ranks"] == (1 if name == "1 rank" else 2)
        assert r["backend"] == {"1 rank": "local", "2 x 1 rank apart": "local (2 processes, no communication)"}.get(
            name, "horovod")
        assert r["transitions_per_sec"] == pytest.approx(r["steps_per_sec"] * r["per_replica_batch"] * r["ranks"],
                                                         rel=1e-3)
        assert r["env"] == {"HOROVOD_CYCLE_TIME": "0.1"}, r
        # A learner step computes: its CPU time is > 0 (how much is load-dependent: no bound).
        assert r["cpu_ms_per_step"] > 0 and r["voluntary_switches_per_step"] >= 0, r
        # The 2-rank learners' one all-reduce a step goes through hvrep's shared-memory transport (both ranks on
        # this host): its time per step, split into waiting for the other rank and the rest.
        parts = ("allreduce_ms_per_step", "allreduce_wait_ms_per_step", "allreduce_work_ms_per_step")
        if name != "2 x 1 rank apart":  # rank 0's CPU per step by thread (5 steps: in whole 10 ms ticks, maybe 0)
            threads = r["rank0_thread_cpu_ms_per_step"]
            assert isinstance(threads, dict) and all(v > 0 for v in threads.values()), r
            assert set(threads) <= {"main", "tf_Compute", "tf_graph_runner", "hvrep-shm", "python"}, r
        if r["backend"] == "horovod":
            assert r["allreduce_ms_per_step"] > 0, r
            assert r["allreduce_ms_per_step"] == pytest.approx(
                r["allreduce_wait_ms_per_step"] + r["allreduce_work_ms_per_step"], abs=2e-3), r
            assert 0 <= r["allreduce_wait_ms_per_step_least"] <= r["allreduce_wait_ms_per_step"], r
        else:
            assert not any(k in r for k in parts), r
    one = learners["1 rank"]["transitions_per_sec"]
    ceiling = learners["2 x 1 rank apart"]["transitions_per_sec"]
    assert len(set(learners["2 x 1 rank apart"]["cores"])) == 2  # a core each
    for r in (r for r in lines if r["kind"] == "learner_scaling"):
        two = learners[r["contender"]]["transitions_per_sec"]
        assert r["transitions_per_sec_2_over_1"] == pytest.approx(two / one, abs=1e-3)
        if r["contender"] != "2 x 1 rank apart":
            assert r["of_ceiling"] == pytest.approx(two / ceiling, abs=1e-3)
    assert sorted(r["contender"] for r in lines if r["kind"] == "learner_scaling") == [
        "2 ranks horovodrun", "2 ranks mpirun", "2 x 1 rank apart"]


def test_interleaved_contenders_each_run_only_in_their_own_windows(tmp_path):
    lines, learners = _learner_only(tmp_path, "--interleave", "0.3", "--cycles", "2")
    for name, r in learners.items():
        processes = 1 if name == "1 rank" else 2
        # 2 windows of 0.3 s less 0.1 s settling each, at a learner step of a few ms: steps were counted ...
        assert r["steps_counted"] > 0 and r["cycles"] == 2 and r["window_sec"] == 0.3, r
        # ... and none ended while another contender had the machine: SIGSTOP held every process of this one.
        assert r["steps_while_stopped"] == 0, r
        assert r["transitions_per_sec"] == pytest.approx(r["steps_per_sec"] * r["per_replica_batch"] * processes,
                                                         rel=1e-3)
        # 2 windows of 0.2 s after settling, each as long as the controller's sleep took (longer on a loaded
        # machine); the rate is the slower process's steps in them over that time.
        assert 0.4 <= r["seconds_counted"] < 1.0, r
        assert r["steps_counted"] == pytest.approx(r["steps_per_sec"] * r["seconds_counted"], abs=1), r
        assert r["env"] == {"HOROVOD_CYCLE_TIME": "0.1"}, r
        lo, hi = r["steps_per_sec_p10_p90"]
        assert lo <= hi and 0 < r["step_ms_median"] <= r["step_ms_p90_p99"][0] <= r["step_ms_p90_p99"][1], r
    one, apart = learners["1 rank"]["transitions_per_sec"], learners["2 x 1 rank apart"]["transitions_per_sec"]
    scaling = {r["contender"]: r for r in lines if r["kind"] == "learner_interleaved_scaling"}
    assert sorted(scaling) == ["2 ranks horovodrun", "2 ranks mpirun", "2 x 1 rank apart"]
    for name, r in scaling.items():
        assert r["transitions_per_sec_2_over_1"] == pytest.approx(learners[name]["transitions_per_sec"] / one,
                                                                  abs=1e-3), r
        lo, hi = r["cycle_p10_p90_2_over_1"]
        assert lo <= r["cycle_median_2_over_1"] <= hi, r
        if name != "2 x 1 rank apart":
            assert r["of_ceiling"] == pytest.approx(learners[name]["transitions_per_sec"] / apart, abs=1e-3), r
