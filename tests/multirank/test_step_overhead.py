"""benchmarks/step_overhead.py --quick under both launchers: one 2-rank launch each, its JSON lines' schema, and
each cost computed as the step with the all-reduce minus the same step without it, round by round.

No timing bounds: the machine is shared; the figures are docs/performance.md's, from a run on a quiet one.
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from tests.multirank import harness

SCRIPT = harness.ROOT / "benchmarks" / "step_overhead.py"
G = 16 << 10
ROUNDS = 3  # --quick's
pytestmark = [pytest.mark.multirank]


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("step-overhead")

    def one(launcher: str) -> dict:
        out = tmp / f"{launcher}.jsonl"
        cmd = [sys.executable, str(SCRIPT), "--quick", "--packed", "--launchers", launcher, "--sizes", str(G),
               "--out", str(out)]
        rc = harness.run_logged(cmd, tmp / f"{launcher}.log", timeout=300)
        assert rc == 0, f"{launcher}: exit {rc}\n{(tmp / f'{launcher}.log').read_text()[-4000:]}"
        return {"lines": [json.loads(x) for x in out.read_text().splitlines()]}

    got = harness.side_by_side({launcher: (lambda launcher=launcher: one(launcher)) for launcher in harness.LAUNCHERS})
    for launcher, result in got.items():
        assert "error" not in result, f"{launcher}:\n{result['error']}"
    return {launcher: result["lines"] for launcher, result in got.items()}


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_every_entry_and_tensor_count_has_a_cost_line(lines, launcher):
    costs = [r for r in lines[launcher] if r["kind"] == "cost"]
    # Each entry and tensor count three times, in the same rounds: the default (one host: hvrep's shared-memory
    # all-reduce), the same with the bucket packed first (--packed), and through Horovod's collectives.
    assert sorted((r["entry"], r["tensors"], r["variant"]) for r in costs) == sorted(
        (entry, n, variant) for entry in ("all_reduce", "wrap_optimizer") for n in (1, 50)
        for variant in ("default", "packed_first", "horovod_transport"))
    for r in costs:
        assert (r["benchmark"], r["launcher"], r["ranks"], r["bytes"]) == ("step_overhead", launcher, 2, G)
        assert len(r["with_us"]) == len(r["without_us"]) == len(r["cost_us"]) == ROUNDS


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_the_shared_memory_all_reduce_splits_its_own_time(lines, launcher):
    # The default variant goes through hvrep's shared-memory all-reduce (both ranks on this host), packed first or
    # not: its counters give each round's all-reduce per step, the part spent waiting for the other rank, and the
    # hand-over. The variant through Horovod's collectives has no such split.
    for r in (r for r in lines[launcher] if r["kind"] == "cost"):
        if r["variant"] not in ("default", "packed_first"):
            assert "shm_allreduce_us" not in r, r
            continue
        assert len(r["shm_allreduce_us"]) == len(r["shm_wait_us"]) == len(r["shm_handover_us"]) == ROUNDS, r
        for total, wait, handover in zip(r["shm_allreduce_us"], r["shm_wait_us"], r["shm_handover_us"],
                                         strict=True):
            assert total > 0 and 0 <= handover <= total and wait >= 0, r
        assert r["shm_allreduce_median_us"] == pytest.approx(statistics.median(r["shm_allreduce_us"]), abs=0.02), r


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_cost_is_with_minus_without_per_round(lines, launcher):
    for r in (r for r in lines[launcher] if r["kind"] == "cost"):
        for w, wo, c in zip(r["with_us"], r["without_us"], r["cost_us"], strict=True):
            assert w > 0 and wo > 0
            assert c == pytest.approx(w - wo, abs=0.02), r
        assert r["cost_median_us"] == pytest.approx(statistics.median(r["cost_us"]), abs=0.02), r
        assert r["cost_p10_us"] <= r["cost_median_us"] <= r["cost_p90_us"]


def test_floors_are_named_per_launcher(lines):
    mpi = [r for r in lines["mpirun"] if r["kind"] == "floor"]
    assert [(r["floor"], r["bytes"], r["measured"]) for r in mpi] == [("mpi4py_allreduce", G, True)]
    assert len(mpi[0]["us"]) == ROUNDS and all(x > 0 for x in mpi[0]["us"])
    for kind in ("floor_small_pages", "floor_cold"):  # MPI's own, on memory like a step's: mpirun only
        extra = [r for r in lines["mpirun"] if r["kind"] == kind]
        assert [(r["floor"], r["bytes"], len(r["us"])) for r in extra] == [("mpi4py_allreduce", G, ROUNDS)], kind
        assert not any(r["kind"] == kind for r in lines["horovodrun"])
    gloo = [r for r in lines["horovodrun"] if r["kind"] == "floor"]
    assert [(r["floor"], r["bytes"]) for r in gloo] == [("torch_gloo_allreduce", G)]
    # Measured where the CPU PyTorch venv exists (docs/performance.md says how to make it), else says why not.
    assert (len(gloo[0]["us"]) == ROUNDS) if gloo[0]["measured"] else gloo[0]["why"]


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_run_line_records_load_and_command(lines, launcher):
    run = [r for r in lines[launcher] if r["kind"] == "run"]
    assert len(run) == 1 and len(run[0]["load_1min"]) == 2 and "--quick" in run[0]["command"]
    assert len({r["run_id"] for r in lines[launcher]}) == 1
