"""benchmarks/multihost.py's pure parts: the calibration set never holds the predicted rate; the prediction's sums.

The benchmark itself needs root and minutes (a netbed of namespace hosts); tests/multihost/ runs the bed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hvrep.perf import costmodel

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "multihost.py"


@pytest.fixture(scope="module")
def mh():
    spec = importlib.util.spec_from_file_location("multihost_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _line(rate: float, nbytes: int, k: int, seconds: float) -> dict:
    return {"benchmark": "multihost", "kind": "allreduce", "link_gbit": rate, "ranks": 2, "bytes": nbytes,
            "collectives": k, "median_s": seconds}


def _bed(eff: float = 0.9, beta: float = 1e-4) -> list[dict]:
    """Times a link of ``eff`` x its rate would give, at 4 rates, 2 sizes, 2 collective counts."""
    lines = []
    for rate in (0.1, 0.25, 0.5, 1.0):
        for nbytes in (1_000_000, 8_000_000):
            for k in (1, 32):
                lines.append(_line(rate, nbytes, k, nbytes * 8 / (eff * rate * 1e9) + k * beta))
    return lines


def test_the_target_rate_is_left_out_and_bytes_are_scaled_to_it(mh):
    points, rates = mh.calibration_points([*_bed(), {"kind": "scaling", "link_gbit": 0.1}], 1.0)
    assert rates == [0.1, 0.25, 0.5]
    assert len(points) == 12
    assert (2, 1_000_000 * 1.0 / 0.1, 1, pytest.approx(1_000_000 * 8 / (0.9 * 0.1e9) + 1e-4)) in points


def test_a_fit_on_the_other_rates_recovers_the_links_bandwidth_at_the_target(mh):
    points, _ = mh.calibration_points(_bed(eff=0.9, beta=1e-4), 1.0)
    fit = costmodel.calibrate(points)
    # 2 ranks: busbw = algbw, so B = 0.9 x 1 Gbit/s = 0.1125 GB/s.
    assert fit.bus_bandwidth_GBps == pytest.approx(0.1125, rel=1e-6)
    assert fit.beta_tensor_s == pytest.approx(1e-4, rel=1e-6)


def test_prediction_adds_the_models_all_reduce_to_the_concurrent_compute(mh):
    fit = costmodel.Calibration(alpha_s=0.0, beta_tensor_s=1e-3, bus_bandwidth_GBps=0.1, rms_residual_s=0.0, points=8)
    case = {"compression": "none", "grad_bytes": 4_000_000, "collectives": 2}
    got = mh.predict_case(case, hosts=2, baseline_s=0.05, compute_s=0.08, fit=fit)
    # 2(N-1)/N x 4 MB / 0.1 GB/s = 40 ms, + 2 collectives x 1 ms.
    assert got["predicted_communication_s"] == pytest.approx(0.042)
    assert got["predicted_efficiency"] == pytest.approx(0.05 / 0.122)
    # All communication hidden behind the 80 ms of compute: the bound is the compute alone.
    assert got["predicted_efficiency_overlap_bound"] == pytest.approx(0.05 / 0.08)
    fp16 = mh.predict_case({**case, "compression": "fp16"}, hosts=2, baseline_s=0.05, compute_s=0.08, fit=fit)
    assert fp16["wire_bytes"] == 2_000_000 and fp16["predicted_communication_s"] == pytest.approx(0.022)


def test_arguments_are_checked_before_any_bed_is_built(mh, capsys):
    with pytest.raises(SystemExit):
        mh.main(["--hosts", "5"])
    assert "--hosts must be 2 to 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mh.main(["--link-gbit", "1", "--calib-gbit", "1"])
    assert "never fitted on the rate it predicts" in capsys.readouterr().err


def test_comm_only_checks_four_hosts_against_a_fit_on_two_hosts_at_the_other_rates(mh):
    # A ring on links of 0.9 x their rate: 2(N-1)/N x S / B, + 100 us per collective.
    lines = []
    for ranks in (2, 4):
        for rate in (0.1, 0.25, 0.5, 1.0):
            for nbytes in (1_000_000, 8_000_000):
                for k in (1, 32):
                    seconds = 2 * (ranks - 1) / ranks * nbytes * 8 / (0.9 * rate * 1e9) + k * 1e-4
                    lines.append({**_line(rate, nbytes, k, seconds), "ranks": ranks})
    checks = mh.comm_checks(lines, [0.5], 4, {"benchmark": "multihost"})
    assert len(checks) == 4 and {c["hosts"] for c in checks} == {4}
    assert all(c["measured_over_predicted"] == pytest.approx(1.0) for c in checks)
    assert checks[0]["calibration"]["rates_gbit"] == [0.1, 0.25, 1.0] and checks[0]["calibration"]["hosts"] == 2
