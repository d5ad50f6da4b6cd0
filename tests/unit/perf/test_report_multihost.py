"""``hvrep report`` on benchmarks/multihost.py lines: the measured-vs-model page and its plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvrep.errors import DataError
from hvrep.perf import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _scaling(rate: float, measured: float, predicted: float, *, overlap: bool = False, compression: str = "none",
             threshold: int = 0) -> dict:
    return {"benchmark": "multihost", "kind": "scaling", "ok": True, "hosts": 2, "netns": True, "link_gbit": rate,
            "fusion_threshold_bytes": threshold, "compression": compression, "overlap": overlap,
            "measured_efficiency": measured, "predicted_efficiency": predicted}


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_multihost_lines_get_their_own_page_with_the_largest_disagreement(tmp_path):
    results = _write(tmp_path / "mh.jsonl", [
        {"benchmark": "multihost", "kind": "allreduce", "link_gbit": 0.1, "ranks": 2, "bytes": 1, "collectives": 1,
         "median_s": 0.1},
        _scaling(0.1, 0.20, 0.25), _scaling(1.0, 0.60, 0.55),
        _scaling(1.0, 0.70, 0.50, overlap=True), _scaling(1.0, 0.66, 0.62, compression="fp16", threshold=25 << 20),
    ])
    assert report.main([str(results), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "multihost.md").read_text()
    assert "| 2 | 0.1 | fusion per tensor, none, overlap off | 0.200 | 0.250 | -0.050 |" in page
    assert "| 2 | 1 | fusion 25 MiB, fp16, overlap off | 0.660 | 0.620 | +0.040 |" in page
    # The overlap-on row (0.2 apart) is shown but not judged: the model has overlap 0.
    assert "with overlap off (what the model describes): 0.050, within 0.15" in page
    assert (tmp_path / "rep" / "multihost.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "rep" / "report.md").exists()  # no throughput results were given


def test_a_disagreement_beyond_the_tolerance_is_said(tmp_path):
    points = report.load_multihost([_write(tmp_path / "mh.jsonl", [_scaling(1.0, 0.30, 0.60)])])
    page = report.render_multihost(points, tmp_path / "rep").read_text()
    assert "0.300, NOT within 0.15" in page


def test_a_line_without_a_prediction_names_the_field(tmp_path):
    line = _scaling(1.0, 0.5, 0.5)
    del line["predicted_efficiency"]
    with pytest.raises(DataError, match=r"mh.jsonl:1 has no 'predicted_efficiency'"):
        report.load_multihost([_write(tmp_path / "mh.jsonl", [line])])


def test_throughput_results_beside_multihost_lines_still_get_the_scaling_report(tmp_path):
    bench = {"benchmark": "throughput", "ok": True, "config": {"model": "small_resnet", "ranks": 1,
                                                               "per_replica_batch": 32},
             "summary": {"images_per_sec": 100.0}}
    files = [_write(tmp_path / "mh.jsonl", [_scaling(1.0, 0.5, 0.5)]), _write(tmp_path / "t.jsonl", [bench])]
    assert report.main([*map(str, files), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "multihost.md").is_file() and (tmp_path / "rep" / "report.md").is_file()
    assert len(report.load_results(files)) == 1
