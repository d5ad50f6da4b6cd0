"""Smoke test of benchmarks/tfrecord_reads.py: it runs, checks the samples and writes well-formed records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "tfrecord_reads.py"


def test_a_small_run_writes_one_record_per_world_size_and_variant(tmp_path):
    out = tmp_path / "r.jsonl"
    res = subprocess.run([sys.executable, str(SCRIPT), "--shards", "24", "--records", "10", "--replicas", "5,6",
                          "--rounds", "1", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    records = {(r["replicas"], r["variant"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == [(5, "indexed"), (5, "whole groups"), (6, "indexed"), (6, "whole groups")]
    assert all(r["same_samples"] for r in records.values())
    assert records[(5, "indexed")]["rule"] == "strided" and records[(6, "indexed")]["rule"] == "by file"
    # Reads are counted by the kernel, not assumed: whole groups on 5 replicas read about 5 times what they use.
    assert records[(5, "indexed")]["reads_per_used"] <= 1.25
    assert records[(5, "whole groups")]["reads_per_used"] >= 4.5
