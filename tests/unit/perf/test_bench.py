"""`hvrep bench scaling` really launches 1 and 2 ranks, and `hvrep report` turns the results into a report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HVREP = str(Path(sys.executable).parent / "hvrep")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


@pytest.mark.multirank
def test_scaling_sweep_then_report(tmp_path):
    out = tmp_path / "scaling.jsonl"
    res = subprocess.run([HVREP, "bench", "scaling", "--ranks", "1,2", "--launcher", "mpirun", "--steps", "3",
                          "--out", str(out)], capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["config"]["ranks"] for r in lines] == [1, 2]
    assert all(r["mode"] == "hvrep" and r["summary"]["images_per_sec"] > 0 for r in lines)
    assert lines[1]["config"]["backend"] == "horovod" and lines[1]["config"]["global_batch"] == 64  # weak scaling
    breakdown = lines[1]["summary"]["step_time_breakdown"]
    assert breakdown["compute_s"] > 0 and breakdown["communication_s"] > 0
    # One synthetic in-memory batch: no input to wait for, so none is claimed.
    assert breakdown["input_wait_s"] is None and "not measured" in breakdown["input_wait"]
    baseline = [json.loads(x) for x in (tmp_path / "scaling-baseline.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in baseline] == ["baseline", "baseline"]

    res = subprocess.run([HVREP, "report", str(out), "--out", str(tmp_path / "report")], capture_output=True,
                         text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = (tmp_path / "report" / "report.md").read_text()
    assert "weak scaling" in report and "| 2 |" in report and "Step-time breakdown" in report
    assert "not measured" in report
    assert (tmp_path / "report" / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dry_run_prints_each_launch():
    res = subprocess.run([HVREP, "bench", "scaling", "--ranks", "1,2,4", "--mode", "strong", "--global-batch", "64",
                          "--launcher", "srun", "--dry-run"], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [x for x in res.stdout.splitlines() if x.startswith("hvrep bench scaling:")]
    assert len(lines) == 3
    assert "--per-replica-batch 64" in lines[0] and "--per-replica-batch 16" in lines[2]
    assert "srun --mpi=pmix -n 4" in lines[2]


def test_the_in_graph_baseline_does_the_same_work_as_hvrep():
    # Two logical CPU devices (conftest): hvrep runs 2 replicas' batches, so must the baseline.
    from hvrep.perf import bench

    records = bench.throughput(per_replica_batch=4, image_size=16, steps=2, warmup=1)
    assert [r["mode"] for r in records] == ["hvrep", "baseline"]
    config = records[1]["config"]
    assert config["backend"] == "local" and config["ranks"] == 2
    assert config["baseline"] == "MirroredStrategy over 2 devices, Keras' own sum"
    breakdown = records[0]["summary"]["step_time_breakdown"]
    assert breakdown["input_wait_s"] is None
    assert 0 <= breakdown["communication_hidden_s"] <= breakdown["communication_s"]


def test_the_breakdown_reports_how_much_communication_was_hidden(tmp_path):
    from hvrep.perf import report

    b = report._breakdown({"compute_s": 0.3, "communication_s": 0.1, "communication_hidden_s": 0.04,
                           "input_wait_s": None}, "x")
    assert b.communication_hidden_s == 0.04 and b.input_wait_s is None and abs(b.total_s - 0.4) < 1e-12
    with pytest.raises(report.DataError):
        report._breakdown({"compute_s": 0.3, "communication_s": 0.1, "communication_hidden_s": -1.0,
                           "input_wait_s": 0.0}, "x")
