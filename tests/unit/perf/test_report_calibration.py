"""`hvrep report --calibrate`: the per-collective overhead is fitted to all-reduce benchmark lines."""

from __future__ import annotations

import json

import pytest

from hvrep.perf import report


def _line(ranks: int, wire_bytes: int, collectives: int, seconds: float, kind: str = "hvrep") -> str:
    return json.dumps({"benchmark": "allreduce", "kind": kind, "ok": True, "collectives": collectives,
                       "wire_bytes": wire_bytes, "config": {"ranks": ranks},
                       "summary": {"median_ms": 1000 * seconds}})


def test_calibration_recovers_the_overheads_that_made_the_times(tmp_path):
    alpha, beta, bandwidth = 20e-6, 150e-6, 2e9  # s per hop, s per collective, bytes/s
    lines = []
    for n in (2, 4):
        for nbytes in (50_000_000, 100_000_000):
            for k in (1, 16, 161):
                t = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth + k * beta
                lines.append(_line(n, nbytes, k, t))
    lines.append(_line(2, 100_000_000, 1, 99.0, kind="mpi4py.Allreduce"))  # another code path: ignored
    path = tmp_path / "allreduce.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cal = report.load_calibration(path)
    assert cal.points == 12
    assert cal.beta_tensor_s == pytest.approx(beta, rel=1e-3)
    assert cal.alpha_s == pytest.approx(alpha, rel=1e-2)
    assert cal.bus_bandwidth_GBps == pytest.approx(bandwidth / 1e9, rel=1e-3)


def test_calibration_without_allreduce_results_says_how_to_make_them(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"benchmark": "throughput", "ok": True}) + "\n")
    with pytest.raises(Exception, match=r"benchmarks/allreduce\.py"):
        report.load_calibration(path)
