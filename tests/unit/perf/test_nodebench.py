"""hvrep bench node's link fit (hvrep/perf/nodebench.py), on points worked out by hand; the measurement itself
runs on 2 ranks in tests/multirank/test_bench_node.py."""

from __future__ import annotations

import pytest

from hvrep.perf.nodebench import SIZES, fit_link, float16_gamma


def test_sizes_span_4_kb_to_256_mb():
    assert (SIZES[0], SIZES[-1]) == (4096, 256 * 2**20)


def test_points_on_a_line_give_back_its_fixed_cost_and_bandwidth():
    # 4 ranks: 2(N-1)/N = 1.5; a = 60 µs, B = 1 GB/s: t = 60e-6 + 1.5 * bytes / 1e9
    points = [{"bytes": b, "seconds": 60e-6 + 1.5 * b / 1e9} for b in (4096, 1 << 20, 64 << 20)]
    fit = fit_link(points, 4)
    assert fit["fixed_s"] == pytest.approx(60e-6, rel=1e-6)
    assert fit["bandwidth_GBps"] == pytest.approx(1.0, rel=1e-6)
    assert fit["latency_us"] == pytest.approx(10.0, rel=1e-6)  # a over 2(N-1) = 6 hops


def test_no_growth_with_bytes_is_all_fixed_cost_and_one_rank_no_fit():
    fit = fit_link([{"bytes": 4096, "seconds": 1e-3}, {"bytes": 1 << 20, "seconds": 1e-3}], 2)
    assert fit["fixed_s"] == pytest.approx(1e-3) and fit["bandwidth_GBps"] > 1e5
    assert fit_link([{"bytes": 4096, "seconds": 1e-3}], 2) is None
    assert fit_link([{"bytes": 4096, "seconds": 1e-3}, {"bytes": 8192, "seconds": 2e-3}], 1) is None


def test_float16s_gamma_is_its_per_byte_cost_beyond_float32s():
    # 2 ranks: float32 at 1 GB/s bus, float16 at 0.5: t16 - t32 = 2(N-1)/N * b * (2 - 1) ns = (N-1)/N * b * γ
    # -> γ = 2 ns per byte; never below 0 (float16 as fast per byte: MPI's F16C sum, a GPU); None without a fit.
    assert float16_gamma({"bandwidth_GBps": 1.0}, {"bandwidth_GBps": 0.5}) == pytest.approx(2e-9)
    assert float16_gamma({"bandwidth_GBps": 1.0}, {"bandwidth_GBps": 2.0}) == 0.0
    assert float16_gamma(None, {"bandwidth_GBps": 2.0}) is None
