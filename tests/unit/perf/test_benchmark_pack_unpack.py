"""Smoke test of benchmarks/pack_unpack.py: it runs, checks its results and writes well-formed records (no speeds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hvrep import kernels

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "pack_unpack.py"
# case -> (operation, src dtype, dst dtype, scale)
CASES = {
    "pack f32->f32": ("pack", "float32", "float32", 1.0),
    "pack f32->f16 x1/8": ("pack", "float32", "float16", 0.125),
    "unpack f32->f32": ("unpack", "float32", "float32", 1.0),
    "unpack f16->f32": ("unpack", "float16", "float32", 1.0),
}
RESNET50_TENSORS = 161
RESNET50_PARAMS = 25_557_032  # ResNet-50 v1.5 at 1000 classes, the published count
DTYPE_SIZE = {"float32": 4, "float16": 2}


def test_quick_run_writes_one_checked_record_per_case_and_way(tmp_path):
    # CI builds the kernels (make setup): the fused rows must be timed, on the fused op.
    assert kernels.status().path == "fused", kernels.status().describe()
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["case"], r["way"]) for r in records) == sorted(
        (c, w) for c in CASES for w in ("fused", "reference"))
    assert len({r["run_id"] for r in records}) == 1
    for r in records:
        case = f"{r['case']} / {r['way']}"
        assert r["ok"] and r["error"] is None, f"{case}: {r['error']}"
        # A fast kernel with a wrong result would be worthless: fused == reference, bit for bit.
        assert r["bit_identical"] is True, case
        assert (r["operation"], r["src_dtype"], r["dst_dtype"], r["scale"]) == CASES[r["case"]], case
        assert r["use_kernel"] == (r["way"] == "fused"), case
        assert r["bytes_per_call"] == RESNET50_PARAMS * (DTYPE_SIZE[r["src_dtype"]] + DTYPE_SIZE[r["dst_dtype"]]), case
        config = r["config"]
        assert config["num_tensors"] == RESNET50_TENSORS and config["num_elements"] == RESNET50_PARAMS, case
        assert (config["warmup"], config["repeats"]) == (2, 5), case  # --quick's settings
        assert len(r["timings_ms"]) == config["repeats"] and len(r["warmup_ms"]) == config["warmup"], case
        assert all(t > 0 for t in r["timings_ms"]), case
        assert r["traces"] == 1, case
        assert r["env"]["kernels"]["status"] == kernels.status().describe(), case
        assert r["env"]["kernels"]["build_key"] == kernels.status().build["key"], case
        assert "doctor" in r["env"], case
        s = r["summary"]
        assert 0 < s["min_ms"] <= s["p10_ms"] <= s["median_ms"] <= s["p90_ms"] <= s["max_ms"], case
        assert s["gbps_at_median"] > 0, case
        if r["way"] == "fused":
            assert s["vs_reference"]["of_medians"] > 0 and s["speedup_vs_reference"]["of_medians"] > 0, case
        else:
            assert "vs_reference" not in s, case
    assert "median ms" in res.stdout and "fused speed-up over the reference" in res.stdout
