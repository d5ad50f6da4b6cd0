"""benchmarks/parallel_ceiling.py: N copies at once against one alone, alternating (speed not judged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_rounds_alternate_and_the_ceiling_is_the_ratio_of_rates(tmp_path):
    # The spin workload only: the step workload runs `hvrep.perf.bench throughput`, tested on its own.
    out = tmp_path / "pc.jsonl"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel_ceiling.py"), "--copies", "2",
                          "--rounds", "2", "--workloads", "spin", "--spin", "200000", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rounds = [r for r in records if r["record"] == "round"]
    (summary,) = [r for r in records if r["record"] == "summary"]
    assert [r["order"] for r in rounds] == [["alone", "together"], ["together", "alone"]]
    for r in rounds:
        assert len(r["together"]) == 2 and r["alone"] > 0
        assert r["ceiling"] == pytest.approx(sum(r["together"]) / 2 / r["alone"])
    ceilings = sorted(r["ceiling"] for r in rounds)
    assert summary["ceiling_min"] == ceilings[0] and summary["ceiling_max"] == ceilings[-1]
    assert summary["workload"] == "spin" and summary["copies"] == 2


def test_bad_arguments_are_refused_with_the_values(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel_ceiling.py"), "--copies", "1",
                          "--out", str(tmp_path / "x.jsonl")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "need --copies >= 2" in res.stderr and "got 1" in res.stderr
