"""benchmarks/loop_overhead.py: the controller's epoch against the bare step, alternately (speed not judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.data import write_demo

ROOT = Path(__file__).resolve().parents[3]


def test_a_quick_run_times_both_and_reports_the_overhead(tmp_path):
    write_demo(tmp_path / "demo")
    out = tmp_path / "lo.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loop_overhead.py"), "--rounds", "2", "--out",
                          str(out), f"data.data_dir={tmp_path / 'demo' / 'tfrecord'}", "train.threads=1"],
                         capture_output=True, text=True, env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rounds = [r for r in records if r["record"] == "round"]
    (summary,) = [r for r in records if r["record"] == "summary"]
    assert [r["order"] for r in rounds] == [["bare", "loop"], ["loop", "bare"]]
    assert summary["steps_per_epoch"] == 1437 // 64 and summary["replicas"] == 1 and summary["threads"] == 1
    med = summary["images_per_sec_median"]
    assert med["bare"] > 0 and med["loop"] > 0
    assert summary["overhead_of_medians"] == pytest.approx(1 - med["loop"] / med["bare"])
    for r in rounds:
        assert r["overhead"] == pytest.approx(1 - r["images_per_sec"]["loop"] / r["images_per_sec"]["bare"])
    # The loop really was the controller's: one epoch line per controller run (1 untimed + 2 timed).
    assert res.stdout.count("images/s  val top-1") == 3, res.stdout[-2000:]
