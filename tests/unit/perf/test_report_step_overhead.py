"""hvrep report's step-overhead page: issue 50's bounds applied to benchmarks/step_overhead.py's lines."""

from __future__ import annotations

import json

from hvrep.perf.report import main


def _lines(tmp_path):
    base = {"benchmark": "step_overhead", "run_id": "r1", "ranks": 2, "variant": "default"}
    cost = {**base, "kind": "cost", "entry": "all_reduce", "tensors": 1, "with_us": [1500.0], "without_us": [100.0],
            "cost_us": [1400.0], "cost_median_us": 1400.0, "cost_p10_us": 1400.0, "cost_p90_us": 1400.0}
    records = [
        {**cost, "launcher": "mpirun", "bytes": 16384},
        {**base, "kind": "floor", "launcher": "mpirun", "bytes": 16384, "floor": "mpi4py_allreduce", "measured": True,
         "us": [10.0], "median_us": 10.0},
        {**cost, "launcher": "horovodrun", "bytes": 16384},
        {**base, "kind": "floor", "launcher": "horovodrun", "bytes": 16384, "floor": "torch_gloo_allreduce",
         "measured": True, "us": [100.0], "median_us": 100.0},
        {**cost, "launcher": "mpirun", "bytes": 32 << 20},
        {**base, "kind": "floor", "launcher": "mpirun", "bytes": 32 << 20, "floor": "mpi4py_allreduce",
         "measured": True, "us": [1000.0], "median_us": 1000.0},
        {"benchmark": "step_overhead", "run_id": "r1", "kind": "run", "load_1min": [1.0, 1.0], "date_utc": "d",
         "command": "python benchmarks/step_overhead.py"},
    ]
    path = tmp_path / "so.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_page_applies_each_launchers_bound(tmp_path):
    assert main([str(_lines(tmp_path)), "--out", str(tmp_path / "out")]) == 0
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line.split("|")
            for line in (tmp_path / "out" / "step-overhead.md").read_text().splitlines() if line.startswith("| m")
            or line.startswith("| h")}
    # mpirun, 16 KB: 1.3 x 10 + 250 = 263; horovodrun: 2 x 100 + 300 = 500; 32 MB: 1.3 x 1000 = 1300.
    assert rows[("mpirun", "16 KB", "1")][8].strip() == "263"
    assert rows[("horovodrun", "16 KB", "1")][8].strip() == "500"
    assert rows[("mpirun", "32 MB", "1")][8].strip() == "1300"
    assert rows[("horovodrun", "16 KB", "1")][9].strip() == "2.80"  # 1400 / 500
