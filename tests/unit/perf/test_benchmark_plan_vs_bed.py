"""benchmarks/plan_vs_bed.py's pure parts: the bed's cluster description, the plan's numbers for it (hand-computed),
the measured step of a local-SGD call, and the comparison's arithmetic against the targets.

The benchmark itself needs root and ~25 minutes (a netbed of 4 namespace hosts); docs/planning.md has its run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hvrep.perf import plan as planlib

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "plan_vs_bed.py"
WORKER = ROOT / "benchmarks" / "_multihost_worker.py"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pvb():
    return _load(SCRIPT, "plan_vs_bed_benchmark")


# One fp32 gradient of 4 MB (a 1,000,000-value vector: PowerSGD leaves it exact), 50 ms forward, 100 ms
# backward, β 2 ms, one static bucket, no cycle: every collective starts when the backward pass ends.
PROFILE = {"plan_inputs": {"name": "hand", "per_replica_batch": 8, "forward_s": 0.05, "backward_s": 0.1,
                           "grad_bytes": 4e6, "tensors": 1, "gradient_shapes": [[1_000_000]], "beta_s": 0.002,
                           "fusion_threshold_bytes": 25 * 1024 * 1024, "bucketing": "static", "cycle_s": 0.0}}


def test_the_bed_is_one_device_per_host_on_the_tcp_payload_rate_of_the_shaped_link(pvb):
    d = pvb.bed_cluster(1.0)
    # 1 Gbit/s = 0.125 GB/s of frames; 1448 of every 1514 frame bytes are TCP payload: 0.11955 GB/s.
    assert d["devices_per_node"] == 1
    assert d["inter"]["bandwidth_GBps"] == pytest.approx(0.119551, rel=1e-5)
    assert d["inter"]["latency_us"] == 0
    cluster = planlib.Cluster.from_dict(d)  # what `hvrep plan --cluster` reads
    assert cluster.inter.bus_bandwidth_Bps == pytest.approx(119_550_859, rel=1e-6)
    assert pvb.bed_cluster(0.1)["inter"]["bandwidth_GBps"] == pytest.approx(0.0119551, rel=1e-5)
    # tbf's bucket, 128 KiB of frames at these rates (netbed.tbf_burst_bytes), in payload bytes.
    assert cluster.inter.burst_bytes == pytest.approx(131072 * 1448 / 1514)
    assert pvb.bed_cluster(0.1)["inter"]["burst_bytes"] == pytest.approx(131072 * 1448 / 1514)
    with pytest.raises(ValueError, match="link_gbit"):
        pvb.bed_cluster(0)


def test_the_plan_for_two_hosts_at_1_gbit_fp32_by_hand(pvb):
    # ring over 2 hosts: 2·(1/2)·4e6 B / 119,550,859 B/s = 33.459 ms after the backward pass, all exposed, of
    # which tbf's bucket (131,072 frame bytes, refilled in 1.049 ms of the 152 ms the link idles) sends 1.049
    # ms' worth at once: 32.410 ms; step = 150 ms compute + 32.410 + β 2 = 184.410 ms; eff = 0.81340.
    p = pvb.predict_point(PROFILE, 1.0, "fp32", 2)
    assert p["predicted_step_s"] == pytest.approx(0.184410, rel=1e-5)
    assert p["predicted_efficiency"] == pytest.approx(0.813405, rel=1e-5)
    assert p["plan_compute_s"] == pytest.approx(0.15)


def test_the_plan_for_four_hosts_at_0_1_gbit_fp16_and_local_sgd_by_hand(pvb):
    # fp16: 2·(3/4)·2e6 B / 11,955,086 B/s = 250.939 ms, less the bucket's 131,072 B at 12.5 MB/s of frames,
    # 10.486 ms: 240.453; step 150 + 240.453 + 2 = 392.453 ms; eff 0.38221.
    p = pvb.predict_point(PROFILE, 0.1, "fp16", 4)
    assert p["predicted_step_s"] == pytest.approx(0.392453, rel=1e-5)
    assert p["predicted_efficiency"] == pytest.approx(0.382211, rel=1e-5)
    # local SGD, H = 4, 2 hosts at 1 Gbit/s: the 4 MB of weights every 4th step: (32.410 + 2) / 4 = 8.602 ms;
    # step 158.602 ms; eff 0.94576.
    q = pvb.predict_point(PROFILE, 1.0, "local:4", 2)
    assert q["predicted_step_s"] == pytest.approx(0.158602, rel=1e-5)
    assert q["predicted_efficiency"] == pytest.approx(0.945761, rel=1e-5)


def test_a_local_sgd_call_of_h_steps_is_divided_by_h_and_efficiency_is_against_the_concurrent_compute(pvb):
    scheme = {"seconds": [0.8, 1.2, 1.0], "median_s": 1.0, "steps_per_call": 4}
    compute = {"seconds": [0.19, 0.2, 0.21], "median_s": 0.2}
    m = pvb.measured_point(scheme, compute)
    assert m["measured_step_s"] == pytest.approx(0.25)
    assert m["measured_step_s_rounds"] == pytest.approx([0.2, 0.3, 0.25])
    assert m["measured_efficiency"] == pytest.approx(0.8)


def test_the_comparison_against_the_targets(pvb):
    inside = pvb.compare(0.22, 0.75, 0.2, 0.8)  # +10% of the step, −0.05 of efficiency
    assert inside["step_error"] == pytest.approx(0.10)
    assert inside["efficiency_diff"] == pytest.approx(-0.05)
    assert inside["step_within"] and inside["efficiency_within"]
    outside = pvb.compare(0.16, 0.92, 0.2, 0.8)  # −20%, +0.12
    assert outside["step_error"] == pytest.approx(-0.2)
    assert not outside["step_within"] and not outside["efficiency_within"]


def test_the_workers_schemes_map_to_hvrep_settings():
    worker = _load(WORKER, "multihost_worker")
    assert worker.scheme_config("fp32") == ({}, 1)
    assert worker.scheme_config("fp16") == ({"compression": "fp16"}, 1)
    assert worker.scheme_config("powersgd:4") == ({"compression": "powersgd", "powersgd_rank": 4}, 1)
    assert worker.scheme_config("local:4") == ({"local_steps": 4}, 4)
    with pytest.raises(SystemExit):
        worker.scheme_config("local:0")


def test_the_plan_can_take_the_contended_compute_keeping_the_profiles_split(pvb):
    # compute 300 ms in place of 150 (forward 100, backward 200): fp32, 2 hosts, 1 Gbit/s: the bucket still
    # leaves when the backward pass ends: step 300 + (33.459 - 1.049 of tbf's burst) + 2 = 334.410 ms;
    # efficiency 300 / 334.410 = 0.89710.
    p = pvb.predict_point(PROFILE, 1.0, "fp32", 2, compute_s=0.3)
    assert p["plan_compute_s"] == pytest.approx(0.3)
    assert p["plan"]["compute_s"] == pytest.approx(0.3)
    assert p["predicted_step_s"] == pytest.approx(0.334410, rel=1e-5)
    assert p["predicted_efficiency"] == pytest.approx(0.897102, rel=1e-5)


def test_the_contended_compute_stretches_the_codec_and_gamma_alike(pvb):
    # compute 300 ms in place of 150: x2. fp16, 2 hosts, 1 Gbit/s (0.119551 GB/s of TCP payload): 2 MB on
    # the wire, 2 * 1/2 * 2e6 / 0.119551e9 = 16.729 ms, less tbf's burst, 1.049 ms: 15.680; γ 5 ns/B x2 on
    # the 1/2 of 2 MB each host sums: 10 ms; codec 4 ms x2 = 8 ms. Step 300 + 8 + 15.680 + 10 + 2 = 335.680 ms.
    profile = {"plan_inputs": {**PROFILE["plan_inputs"], "gamma_s_per_byte": {"float16": 5e-9},
                               "codec_s": {"fp16": 0.004}}}
    p = pvb.predict_point(profile, 1.0, "fp16", 2, compute_s=0.3)
    assert p["plan"]["codec_s"] == pytest.approx(0.008)
    assert p["predicted_step_s"] == pytest.approx(0.3356807, rel=1e-6)
    alone = pvb.predict_point(profile, 1.0, "fp16", 2)  # the profile's own: 150 + 4 + 15.680 + 5 + 2
    assert alone["predicted_step_s"] == pytest.approx(0.1766807, rel=1e-6)
