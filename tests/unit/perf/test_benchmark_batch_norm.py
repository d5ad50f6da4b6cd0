"""benchmarks/batch_norm.py: each variant in its own process, alternating, with the batch norm it names (speed not
judged)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_each_variant_runs_the_batch_norm_it_names_and_rounds_rotate(tmp_path):
    out = tmp_path / "bn.jsonl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "batch_norm.py"), "--model", "small",
                          "--rounds", "2", "--steps", "1", "--warmup", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    launches = [r for r in records if r["record"] == "launch"]
    assert [r["variant"] for r in launches] == ["tf_keras", "keras", "replicator", "replicator-keras",
                                                "keras", "replicator", "replicator-keras", "tf_keras"]
    ops = {r["variant"]: r["traced_batch_norm_ops"] for r in launches}
    # The small model has 2 batch norms: tf_keras fuses them, Keras 3 does not, Replicator.run does by default.
    assert ops["tf_keras"]["FusedBatchNormV3"] == 2
    assert ops["keras"] == ops["replicator-keras"] == {"FusedBatchNormV3": 0, "SquaredDifference": 2}
    assert ops["replicator"] == {"FusedBatchNormV3": 2, "SquaredDifference": 0}
    frameworks = {r["variant"]: r["keras"] for r in launches}
    assert frameworks["tf_keras"].startswith("tf_keras ") and frameworks["keras"].startswith("keras 3")
    summaries = {r["variant"]: r for r in records if r["record"] == "summary"}
    assert set(summaries) == {"tf_keras", "keras", "replicator", "replicator-keras"}
    assert len(summaries["replicator"]["tf_keras_over_this"]["per_round"]) == 2
    assert all(s["launches_ok"] == 2 for s in summaries.values())
