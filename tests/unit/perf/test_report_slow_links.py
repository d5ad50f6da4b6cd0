"""``hvrep report`` on benchmarks/slow_links.py lines: time to target, the per-scheme table, the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hvrep.errors import DataError
from hvrep.perf import report, slowlinks

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TARGET = 0.9


def _curve(rate: float, seed: int, scheme: str, points: list[tuple[float, float]], steps: int = 16) -> list[dict]:
    return [{"benchmark": "slow_links", "run_id": "r1", "kind": "curve", "ok": True, "target": TARGET,
             "link_gbit": rate, "seed": seed, "scheme": scheme, "step": i * steps, "wall_s": w, "val_acc": a}
            for i, (w, a) in enumerate(points)]


def _run(rate: float, seed: int, scheme: str, ratio: float) -> dict:
    return {"benchmark": "slow_links", "run_id": "r1", "kind": "run", "ok": True, "target": TARGET,
            "link_gbit": rate, "seed": seed, "scheme": scheme, "steps": 64, "step_s": 0.1, "comm_share": 0.5,
            "payload_bytes_per_step": 1000.0, "predicted_ring_bytes_per_step": 2000.0, "wire_bytes_per_step": 2300.0,
            "tcpip_bytes_per_step": 200.0, "horovod_bytes_per_step": 100.0,
            "measured_payload_bytes_per_step": 2000.0 * ratio, "measured_over_predicted": ratio}


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_time_to_target_is_the_first_evaluation_at_or_above_the_target():
    # Crosses at 20 s (exactly the target), dips below at 30 s, above again at 40 s: 20, not 40 nor interpolated.
    curve = [(0.0, 0.5), (10.0, 0.89), (20.0, 0.9), (30.0, 0.85), (40.0, 0.95)]
    assert slowlinks.time_to_target(curve, 0.9) == 20.0
    assert slowlinks.time_to_target(curve, 0.96) is None
    assert slowlinks.time_to_target([(0.0, 0.97)], 0.96) == 0.0


def _bed_lines() -> list[dict]:
    lines = []
    for seed, jitter in ((0, 0.0), (1, 0.002), (2, -0.002)):
        # 0.1 Gbit/s: fp16 reaches 0.9 at 40 s; local_h4 at 10 s; powersgd_r1 misses with seeds 0 and 1.
        lines += _curve(0.1, seed, "sync_fp16", [(0, 0.1), (20, 0.8), (40, 0.91 + jitter), (60, 0.92 + jitter)])
        lines += _curve(0.1, seed, "sync_fp32", [(0, 0.1), (40, 0.8), (80, 0.91), (120, 0.92 + jitter)])
        lines += _curve(0.1, seed, "local_h4", [(0, 0.1), (5, 0.85), (10, 0.9), (15, 0.915 + jitter)])
        miss = seed < 2
        lines += _curve(0.1, seed, "powersgd_r1", [(0, 0.1), (3, 0.7), (6, 0.8 if miss else 0.95), (9, 0.85)])
        lines += [_run(0.1, seed, s, 1.0 + 0.01 * seed) for s in ("sync_fp16", "local_h4")]
        # 1 Gbit/s: fp32 at 8 s, fp16 at 6 s, local_h4 at 6.6 s (10% slower than the faster sync).
        lines += _curve(1.0, seed, "sync_fp32", [(0, 0.1), (4, 0.8), (8, 0.92)])
        lines += _curve(1.0, seed, "sync_fp16", [(0, 0.1), (3, 0.8), (6, 0.92)])
        lines += _curve(1.0, seed, "local_h4", [(0, 0.1), (3.3, 0.8), (6.6, 0.92)])
    lines.append({"benchmark": "slow_links", "kind": "setup", "ok": True, "link_gbit": 0.1, "seed": 0})
    return lines


def test_table_speedups_and_verdicts_from_known_numbers(tmp_path):
    runs = slowlinks.load_slow_links([_write(tmp_path / "sl.jsonl", _bed_lines())])
    assert len(runs) == 3 * 7
    rows = {(r.link_gbit, r.scheme): r for r in slowlinks.summarize(runs)}
    fp16, local = rows[(0.1, "sync_fp16")], rows[(0.1, "local_h4")]
    assert fp16.time_to_target_s == 40 and local.time_to_target_s == 10
    assert local.speedup_vs_fp16 == pytest.approx(4.0) and local.speedup_vs_fp32 == pytest.approx(8.0)
    assert local.final_acc_mean == pytest.approx(0.915) and local.final_acc_sd == pytest.approx(0.002)
    assert (fp16.final_acc_min, fp16.final_acc_max) == pytest.approx((0.918, 0.922))
    assert local.measured_over_predicted == pytest.approx(1.01) and local.payload_bytes == 1000
    # Two of three seeds missed: the median counts them as infinite, so the scheme did not reach it.
    psgd = rows[(0.1, "powersgd_r1")]
    assert (psgd.reached, psgd.time_to_target_s, psgd.speedup_vs_fp16) == (1, None, None)
    assert rows[(1.0, "local_h4")].speedup_vs_fp16 == pytest.approx(6 / 6.6)
    verdicts = slowlinks.verdicts(list(rows.values()))
    assert "local_h4 reaches the target 4.0x sooner than sync fp16 (met" in verdicts[0]
    # local_h4's 0.915 is below fp16's lowest seed (0.918): outside the spread.
    assert "BELOW sync fp16's seeds' spread [0.9180, 0.9220]" in verdicts[0]
    assert "+10%; NOT met" in verdicts[1]


def test_hvrep_report_writes_the_page_and_one_plot_per_rate(tmp_path, capsys):
    results = _write(tmp_path / "sl.jsonl", _bed_lines())
    out = tmp_path / "report"
    assert report.main([str(results), "--out", str(out)]) == 0
    page = (out / "slow-links.md").read_text()
    assert "| 0.1 | local_h4 | 3/3 | 10.0 | 4.00 | 8.00 | 0.9150 ± 0.0020 | 64 | 100.0 | 50% |" in page
    assert "| 0.1 | powersgd_r1 | 1/3 | not reached |" in page
    # Bytes: all sent = TCP/IP + Horovod's own + payload, each a median over the 3 seeds (ratios 1.00, 1.01, 1.02).
    assert "| 0.1 | local_h4 | 1,000 | 2,000 | 2,300 | 200 | 100 | 2,020 | 1.010 |" in page
    # Schemes keep the file's order: fp16 first, as written.
    assert page.index("| 0.1 | sync_fp16 |") < page.index("| 0.1 | sync_fp32 |") < page.index("| 0.1 | local_h4 |")
    for rate in ("0.1", "1"):
        assert (out / f"slow-links-{rate}gbit.png").read_bytes()[:8] == PNG_SIGNATURE
        assert f"(slow-links-{rate}gbit.png)" in page
    assert "slow-link run(s)" in capsys.readouterr().out


@pytest.mark.parametrize(("field", "value"), [("val_acc", 1.5), ("wall_s", math.nan), ("target", None)])
def test_a_bad_value_names_the_line(tmp_path, field, value):
    lines = _curve(0.1, 0, "sync_fp32", [(0, 0.1), (1, 0.5)])
    lines[1][field] = value
    with pytest.raises(DataError, match=r"sl\.jsonl:2"):
        slowlinks.load_slow_links([_write(tmp_path / "sl.jsonl", lines)])
