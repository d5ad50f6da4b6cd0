"""Smoke test of benchmarks/optimizer_apply.py: it runs and writes well-formed results (no speed checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "optimizer_apply.py"
OPTIMIZERS = {"LARS", "MomentumSGD", "keras.SGD"}
MODES = {"eager", "tf.function", "xla"}
RESNET50_VARIABLES = 161
RESNET50_PARAMS = 25_557_032  # ResNet-50 v1.5 at 1000 classes, the published count


def test_quick_run_writes_one_record_per_optimizer_and_mode(tmp_path):
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["optimizer"], r["mode"]) for r in records) == sorted(
        (o, m) for o in OPTIMIZERS for m in MODES)
    assert len({r["run_id"] for r in records}) == 1
    for r in records:
        case = f"{r['optimizer']} / {r['mode']}"
        assert r["ok"] and r["error"] is None, f"{case}: {r['error']}"
        config = r["config"]
        assert config["num_variables"] == RESNET50_VARIABLES, case
        assert config["num_params"] == RESNET50_PARAMS, case
        assert config["bytes_per_step"] == 20 * RESNET50_PARAMS, case
        assert len(r["timings_ms"]) == config["repeats"], case
        assert len(r["warmup_ms"]) == config["warmup"], case
        assert all(t > 0 for t in r["timings_ms"]), case
        summary = r["summary"]
        assert summary["min_ms"] <= summary["p10_ms"] <= summary["median_ms"] <= summary["p90_ms"], case
        assert summary["vs_lars_tf_function"]["of_medians"] > 0, case
        assert r["traces"] in ((None,) if r["mode"] == "eager" else (1,)), case
        assert r["env"]["tensorflow"] and r["env"]["keras"] and "doctor" in r["env"], case
    # --quick's settings.
    assert {(r["config"]["warmup"], r["config"]["repeats"]) for r in records} == {(2, 5)}
    assert "LARS" in res.stdout and "median ms" in res.stdout
