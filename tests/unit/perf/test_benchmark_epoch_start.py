"""benchmarks/epoch_start.py: each counted epoch's pipeline start in parts, and their medians (speed not judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_counted_epoch_has_its_parts_and_the_summary_their_medians(tmp_path):
    out = tmp_path / "epoch_start.jsonl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "epoch_start.py"), "--epochs", "3",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    epochs = [r for r in records if "epoch" in r]
    (summary,) = [r for r in records if r.get("summary")]
    assert [r["epoch"] for r in epochs] == [0, 1, 2] and summary["epochs_counted"] == 2
    parts = ("build_ms", "iterator_ms", "first_ms", "per_batch_ms")
    assert all(r[p] > 0 for r in epochs for p in parts)
    # The demo's training split at a batch of 32: every epoch the same number of batches.
    assert len({r["batches"] for r in epochs}) == 1 and epochs[0]["batches"] > 10
    for p in parts:  # the median of two is their mean
        assert summary[p] == sum(r[p] for r in epochs[1:]) / 2
    assert summary["core"] is not None and summary["threads"] == 1
