"""benchmarks/allreduce_parts.py, small: one 2-rank launch under mpirun, every contender's sum checked, its JSON
lines' schema, and each cost its contender's samples minus its empty step's, round by round.

No timing bounds: the machine is shared; the figures are docs/performance.md's, from a run on a quiet one.
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from tests.multirank import harness

SCRIPT = harness.ROOT / "benchmarks" / "allreduce_parts.py"
pytestmark = [pytest.mark.multirank]


@pytest.mark.timeout(360)
def test_one_launch_checks_every_sum_and_writes_costs_as_differences(tmp_path) -> None:
    out = tmp_path / "parts.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--bytes", "65536", "--rounds", "2", "--inner", "2", "--warmup", "1",
           "--out", str(out)]
    rc = harness.run_logged(cmd, tmp_path / "log", timeout=300)
    assert rc == 0, (tmp_path / "log").read_text()[-4000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["kind"] for r in lines} == {"check", "sample", "cost", "run"}
    (check,) = [r for r in lines if r["kind"] == "check"]
    # ranks hold 1 and 2: a sum is 3, a mean or a sum post-scaled by 0.5 is 1.5
    assert check["results_checked"] is True and check["got"]["hvrep_mean"] == 1.5, check
    samples = {r["contender"]: r["us"] for r in lines if r["kind"] == "sample"}
    assert {"hvrep_sum", "hvrep_without", "horovod_flush", "floor_fixed", "floor_rotating"} <= set(samples)
    for cost in (r for r in lines if r["kind"] == "cost"):
        diff = [a - b for a, b in zip(samples[cost["contender"]], samples[cost["against"]], strict=True)]
        assert cost["cost_us"] == pytest.approx(diff) and len(diff) == 2, cost
        assert cost["median_us"] == pytest.approx(statistics.median(diff))
