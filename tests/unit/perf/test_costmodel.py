"""The α-β all-reduce cost model: hand-computed values, calibration, and the shape of its predictions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hvrep.errors import ConfigError
from hvrep.perf import costmodel
from hvrep.perf.costmodel import Interconnect

# The example of the brief: N=8, S=100 MB, B=10 GB/s, α=5 µs.
LINK = Interconnect("test link", bus_bandwidth_GBps=10.0, latency_us=5.0)
S = 100e6


def test_ring_time_matches_the_formula_by_hand():
    # 2(N-1)·α = 2·7·5e-6 = 7e-5 s; 2(N-1)/N · S/B = 2·7/8 · 100e6/10e9 = 1.75 · 0.01 = 0.0175 s.
    assert costmodel.allreduce_time(8, S, LINK, collectives=1, beta_tensor_s=0.0) == pytest.approx(7e-5 + 0.0175)
    # k·β: 161 collectives of 20 µs each add 3.22e-3 s.
    assert costmodel.allreduce_time(8, S, LINK, collectives=161, beta_tensor_s=20e-6) == pytest.approx(
        7e-5 + 0.0175 + 161 * 20e-6)


def test_two_ranks_and_one_rank():
    # N=2: 2·1·5e-6 + 2·1/2 · 0.01 = 1e-5 + 0.01.
    assert costmodel.allreduce_time(2, S, LINK, beta_tensor_s=0.0) == pytest.approx(1e-5 + 0.01)
    assert costmodel.allreduce_time(1, S, LINK, collectives=161) == 0.0  # one rank sends nothing


def test_two_level_matches_the_formula_by_hand():
    intra = Interconnect("intra", bus_bandwidth_GBps=100.0, latency_us=1.0)
    # 32 GPUs = 4 nodes of 8. Intra: 2·7·1e-6 + 2·7/8 · 100e6/100e9 = 1.4e-5 + 1.75e-3.
    # Inter: 2·3·5e-6 + 2·3/4 · (100e6/8)/10e9 = 3e-5 + 1.5 · 1.25e-3 = 3e-5 + 1.875e-3.  β = 10 µs once.
    expected = (1.4e-5 + 1.75e-3) + (3e-5 + 1.875e-3) + 10e-6
    got = costmodel.two_level_allreduce_time(32, S, 8, LINK, intra, collectives=1, beta_tensor_s=10e-6)
    assert got == pytest.approx(expected)
    # Within one node it is the one-ring time on the intra-node link.
    assert costmodel.two_level_allreduce_time(8, S, 8, LINK, intra, beta_tensor_s=0.0) == pytest.approx(
        costmodel.allreduce_time(8, S, intra, beta_tensor_s=0.0))
    with pytest.raises(ConfigError, match="gpus_per_node=8"):
        costmodel.two_level_allreduce_time(12, S, 8, LINK, intra)


def test_efficiency_by_hand_with_and_without_overlap():
    compute = 0.0358
    comm = 7e-5 + 0.0175 + 1 * 20e-6
    assert costmodel.predict_efficiency(8, compute, S, LINK, collectives=1) == pytest.approx(compute / (compute + comm))
    # Half the communication hidden behind the backward pass.
    assert costmodel.predict_efficiency(8, compute, S, LINK, 1, overlap=0.5) == pytest.approx(
        compute / (compute + 0.5 * comm))
    # Full overlap cannot hide more than the compute time itself: exposed = comm − compute when comm > compute.
    slow = Interconnect("slow", 0.1, 5.0)
    p = costmodel.predict(8, compute, S, slow, 1, overlap=1.0)
    assert p.exposed_communication_s == pytest.approx(p.communication_s - compute)
    assert costmodel.predict_efficiency(1, compute, S, LINK, 161) == 1.0


def test_efficiency_never_rises_with_more_gpus():
    compute = costmodel.H100_RESNET50_COMPUTE_S
    for link in costmodel.PRESETS.values():
        for k in (1, 161):
            flat = [costmodel.predict_efficiency(n, compute, costmodel.RESNET50_GRAD_BYTES, link, k)
                    for n in (1, 2, 4, 8, 16, 64, 256, 1024)]
            assert all(a >= b for a, b in itertools.pairwise(flat)), (link.name, k, flat)
            nodes = [costmodel.predict_efficiency(n, compute, costmodel.RESNET50_GRAD_BYTES, link, k, gpus_per_node=8)
                     for n in (1, 2, 4, 8, 16, 32, 128, 1024)]
            assert all(a >= b for a, b in itertools.pairwise(nodes)), (link.name, k, nodes)


def test_efficiency_never_falls_with_more_bandwidth():
    compute = costmodel.H100_RESNET50_COMPUTE_S
    for n in (2, 8, 64, 1024):
        effs = [costmodel.predict_efficiency(n, compute, costmodel.RESNET50_GRAD_BYTES, Interconnect("x", b, 5.0), 1)
                for b in (1.0, 2.8, 11.0, 46.0, 370.0)]
        assert all(a <= b for a, b in itertools.pairwise(effs)), (n, effs)
    # The presets, slowest to fastest, are in that order too.
    ordered = [costmodel.ETHERNET_25G, costmodel.ETHERNET_100G, costmodel.NDR_INFINIBAND, costmodel.NVLINK]
    effs = [costmodel.predict_efficiency(256, compute, costmodel.RESNET50_GRAD_BYTES, link, 1) for link in ordered]
    assert effs == sorted(effs)


def test_fusion_never_predicts_worse():
    compute, nbytes = costmodel.H100_RESNET50_COMPUTE_S, costmodel.RESNET50_GRAD_BYTES
    for link in costmodel.PRESETS.values():
        for n in (2, 8, 64, 512):
            for overlap in (0.0, 0.5):
                by_k = [costmodel.predict_efficiency(n, compute, nbytes, link, k, overlap) for k in (1, 2, 10, 161)]
                assert all(a >= b for a, b in itertools.pairwise(by_k)), (link.name, n, overlap, by_k)


def test_collectives_for_fusion_threshold():
    assert costmodel.collectives_for(costmodel.RESNET50_GRAD_BYTES, 161, 0) == 161  # fusion off
    assert costmodel.collectives_for(costmodel.RESNET50_GRAD_BYTES, 161, 128 * 2**20) == 1  # 102 MB < 128 MiB
    assert costmodel.collectives_for(costmodel.RESNET50_GRAD_BYTES, 161, 64 * 2**20) == 2
    assert costmodel.collectives_for(1000, 3, 1) == 3  # never more than one per tensor


def test_published_compute_time_is_labelled_arithmetic():
    # 256 images per GPU per step at ~7,160 images/s per GPU: 35.75 ms.
    assert costmodel.H100_RESNET50_COMPUTE_S == pytest.approx(256 / 7160)
    assert costmodel.H100_RESNET50_COMPUTE_S == pytest.approx(0.0358, abs=1e-4)
    assert costmodel.RESNET50_GRAD_BYTES == 102_228_128
    assert {p.gpus for p in costmodel.PUBLISHED_POINTS} >= {8, 256, 512}


def _synthetic(alpha: float, bandwidth_bps: float, beta: float) -> list[tuple[int, float, int, float]]:
    points = []
    for n in (2, 4, 8, 16):
        for nbytes in (1e6, 1e7, 1e8):
            for k in (1, 10, 100):
                t = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth_bps + k * beta
                points.append((n, nbytes, k, t))
    return points


def test_calibration_recovers_known_parameters():
    cal = costmodel.calibrate(_synthetic(alpha=5e-6, bandwidth_bps=10e9, beta=30e-6))
    assert cal.alpha_s == pytest.approx(5e-6, rel=1e-6)
    assert cal.bus_bandwidth_GBps == pytest.approx(10.0, rel=1e-6)
    assert cal.beta_tensor_s == pytest.approx(30e-6, rel=1e-6)
    assert cal.rms_residual_s < 1e-12
    assert cal.points == 36
    link = cal.interconnect("fitted")
    assert link.latency_us == pytest.approx(5.0) and link.bus_bandwidth_GBps == pytest.approx(10.0)


def test_calibration_with_noise_and_a_zero_term():
    rng = np.random.default_rng(0)
    noisy = [(n, s, k, t * (1 + 0.01 * rng.standard_normal())) for n, s, k, t in _synthetic(5e-6, 46e9, 20e-6)]
    cal = costmodel.calibrate(noisy)
    assert cal.bus_bandwidth_GBps == pytest.approx(46.0, rel=0.05)
    assert cal.beta_tensor_s == pytest.approx(20e-6, rel=0.2)
    # No per-collective cost at all: the fit clamps β at 0 instead of going negative.
    cal = costmodel.calibrate(_synthetic(5e-6, 10e9, 0.0))
    assert cal.beta_tensor_s >= 0 and cal.beta_tensor_s == pytest.approx(0.0, abs=1e-12)


def test_calibration_refuses_points_that_cannot_separate_the_terms():
    with pytest.raises(ConfigError, match="at least 3"):
        costmodel.calibrate([(2, 1e6, 1, 1e-3)])
    same_ranks_and_k = [(8, s, 1, 1e-3 + s / 1e10) for s in (1e6, 1e7, 1e8)]
    with pytest.raises(ConfigError, match="linearly dependent"):
        costmodel.calibrate(same_ranks_and_k)
    with pytest.raises(ConfigError, match="ranks must be an int >= 2"):
        costmodel.calibrate([(1, 1e6, 1, 0.0)] * 3)


def test_interconnect_validation_and_presets():
    with pytest.raises(ConfigError, match="bus_bandwidth_GBps"):
        Interconnect("x", 0.0, 1.0)
    with pytest.raises(ConfigError, match="latency_us"):
        Interconnect("x", 1.0, -1.0)
    with pytest.raises(ConfigError, match="nvlink, ndr, 100gbe, 25gbe"):
        costmodel.interconnect("10gbe")
    assert costmodel.interconnect("NDR") is costmodel.NDR_INFINIBAND
    assert [costmodel.PRESETS[k].bus_bandwidth_GBps for k in ("nvlink", "ndr", "100gbe", "25gbe")] == [
        370.0, 46.0, 11.0, 2.8]
    with pytest.raises(ConfigError, match="overlap"):
        costmodel.predict(8, 0.03, S, LINK, 1, overlap=1.5)
    assert math.isclose(LINK.bus_bandwidth_Bps, 1e10) and math.isclose(LINK.latency_s, 5e-6)


def test_payload_bytes_per_scheme():
    shapes = [(3, 3, 64, 128), (128,)]  # a conv kernel ([576, 128]) and its bias
    assert costmodel.payload_bytes(shapes) == 4 * (73728 + 128)
    assert costmodel.payload_bytes(shapes, "fp16") == 2 * (73728 + 128)
    assert costmodel.payload_bytes(shapes, "powersgd", powersgd_rank=4) == 4 * ((576 + 128) * 4 + 128)
    # PyTorch's rule: a matrix that would not shrink by the minimum rate goes exact.
    assert costmodel.payload_bytes([(4, 4)], "powersgd", powersgd_rank=1) == 4 * 16
    assert costmodel.payload_bytes([(4, 4)], "powersgd", powersgd_rank=1, powersgd_min_compression_rate=0) == 4 * 8
    assert costmodel.ring_wire_bytes(2, 1000) == 1000 and costmodel.ring_wire_bytes(1, 1000) == 0
    with pytest.raises(ConfigError, match="scheme"):
        costmodel.payload_bytes(shapes, "int8")


def test_local_sgd_bytes_per_step_are_the_model_and_its_statistics_over_h():
    from hvrep.perf.costmodel import local_sgd_bytes_per_step

    # ResNet-50: 25.6 M fp32 weights (102.2 MB); its batch norms' moving statistics: 53,120 values (212 kB).
    weights, stats = 102_228_128, 212_480
    assert local_sgd_bytes_per_step(weights, None, stats) == weights  # synchronous: the gradients only
    assert local_sgd_bytes_per_step(weights, 1, stats) == weights + stats
    assert local_sgd_bytes_per_step(weights, 16, stats) == pytest.approx((weights + stats) / 16)
    with pytest.raises(ConfigError, match="local_steps must be an int >= 1, got 0"):
        local_sgd_bytes_per_step(weights, 0)
