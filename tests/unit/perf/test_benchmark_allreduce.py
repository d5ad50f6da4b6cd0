"""Smoke test of benchmarks/allreduce.py under mpirun -np 2: it runs and writes well-formed results (no speeds).

It runs with --shrink 64: ResNet-50's 161 tensors, each 1/64 as wide (~1.6 MB in all, not 102 MB), so every case,
check and record is exercised in seconds; the full-size sweep is the benchmark's own run, not CI's. That the
default is ResNet-50's own sizes is tests/unit/blocks/test_models.py's check of resnet50_variable_shapes().
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from hvrep.models import resnet50_variable_shapes
from tests.multirank import harness

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "allreduce.py"
BIN = Path(sys.executable).parent
MiB = 1024 * 1024
THRESHOLDS = (0, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB)
RESNET50_TENSORS = 161
SHRINK = 64


def _cases() -> set[tuple[str, int | None, str]]:
    hvrep = {("hvrep", t, c) for t in THRESHOLDS for c in ("none", "fp16")}
    return hvrep | {("hvrep", 128 * MiB, "bf16"), ("hvd.allreduce", None, "none"),
                    ("hvd.grouped_allreduce", None, "none"), ("mpi4py.Allreduce", None, "none")}


def test_quick_run_under_mpirun_writes_every_case(tmp_path):
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [str(BIN / "mpirun"), "-np", "2", *harness.MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", str(SCRIPT),
           "--quick", "--shrink", str(SHRINK), "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_key = {(r["kind"], r["fusion_threshold_bytes"], r["compression"]): r for r in records}
    assert len(by_key) == len(records), "a case was written twice"
    assert set(by_key) == _cases()
    assert len({r["run_id"] for r in records}) == 1
    # Each tensor's last dimension divided by SHRINK, rounded up: conv1's (7, 7, 3, 64) -> (7, 7, 3, 1).
    params = sum(math.prod(s[:-1]) * math.ceil(s[-1] / SHRINK) for _, s in resnet50_variable_shapes())
    assert 25_557_032 // SHRINK < params < 25_557_032 // SHRINK * 2, params

    for r in records:
        case = r["case"]
        config = r["config"]
        assert config["num_tensors"] == RESNET50_TENSORS, case
        assert config["num_params"] == params and config["payload_bytes"] == 4 * params, case
        assert config["shrink"] == SHRINK, case
        assert config["ranks"] == 2 and config["launcher"] == "openmpi", case
        assert (config["warmup"], config["repeats"]) == (1, 3), case
        assert "doctor" in r["env"], case
        if not r["ok"]:
            continue
        assert r["error"] is None, case
        assert r["correct"] is True, f"{case}: {r['check_per_rank']}"
        assert len(r["timings_ms"]) == config["repeats"], case
        assert len(r["timings_ms_per_rank"]) == 2, case
        s = r["summary"]
        assert 0 < s["min_ms"] <= s["p10_ms"] <= s["median_ms"] <= s["p90_ms"] <= s["max_ms"], case
        assert s["algbw_gbps"] > 0 and s["busbw_gbps"] == s["algbw_gbps"], case  # 2(N-1)/N = 1 at N = 2
        assert s["vs_mpi4py_contiguous"]["of_medians"] > 0, case

    assert by_key["hvrep", 128 * MiB, "none"]["collectives"] == 1
    assert by_key["hvrep", 0, "none"]["collectives"] == RESNET50_TENSORS
    assert by_key["hvrep", 0, "fp16"]["collectives"] == RESNET50_TENSORS
    assert by_key["hvd.allreduce", None, "none"]["collectives"] == RESNET50_TENSORS
    assert by_key["hvd.grouped_allreduce", None, "none"]["collectives"] == 1
    assert by_key["hvrep", 0, "fp16"]["wire_bytes"] == 2 * params
    assert by_key["mpi4py.Allreduce", None, "none"]["ok"]

    refused = by_key["hvrep", 128 * MiB, "bf16"]
    assert not refused["ok"] and refused["expected_error"] and refused["summary"] is None
    assert refused["error"].startswith("ConfigError: Replicator: compression='bf16' with backend='horovod'")
    assert "Horovod cannot reduce bfloat16" in refused["error"]
    assert "median ms" in res.stdout and "REFUSED" in res.stdout
