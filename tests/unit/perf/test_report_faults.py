"""`hvrep report` on benchmarks/faults.py lines: one row per kind with its injections, recoveries, steps lost,
seconds to recover and anything lost, and each injection that was not ok listed below (issue 49)."""

from __future__ import annotations

import json

from hvrep.perf import report


def _line(kind, point, ok=True, steps_lost=3, recover_s=20.0, lost=(), exit_code=137, expected=137, **extra):
    return {"benchmark": "faults", "run_id": "r1", "kind": kind, "point": point, "seed": 1, "launcher": "mpirun",
            "recovered": ok, "steps_lost": steps_lost, "recover_s": recover_s, "lost": list(lost),
            "exit_code": exit_code, "expected_exit": expected, "detail": "d", "ok": ok and not lost and
            exit_code == expected, "date": "2026-11-27T00:00:00+00:00", "load_1min": 3.0, **extra}


def test_the_page_has_a_row_per_kind_and_lists_what_went_wrong(tmp_path):
    lines = [_line("ckpt_save_kill", "ckpt.data", steps_lost=4), _line("ckpt_save_kill", "ckpt.before_rename",
             steps_lost=2, recover_s=30.0),
             _line("disk_full", "metrics.write", exit_code=1, expected=74),
             _line("disk_full", "ckpt.data", lost=["checkpoint step 5 unreadable"], expected=137)]
    results = tmp_path / "faults.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"benchmark": "faults", "ki')  # torn
    assert report.main([str(results), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "faults.md").read_text()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in page.splitlines()
            if r.startswith("| ") and not r.startswith("| kind")}
    # kind | points | launchers | injections | recovered | steps lost (max) | seconds (median) | lost | wrong exit
    assert rows["ckpt_save_kill"][3:] == ["2", "2", "4", "25", "0", "0"], rows
    assert rows["disk_full"][3:] == ["2", "0", "3", "20", "1", "1"], rows
    assert "disk_full at metrics.write" in page and "exit 1 (expected 74)" in page
    assert "checkpoint step 5 unreadable" in page


def test_fault_lines_alone_are_a_report_not_an_error(tmp_path):
    results = tmp_path / "faults.jsonl"
    results.write_text(json.dumps(_line("kill_job", "step.between")) + "\n")
    assert report.main([str(results), "--out", str(tmp_path)]) == 0
    assert "| kill_job |" in (tmp_path / "faults.md").read_text()
