"""A full output file system ends `hvrep train` with exit 74 and one line, whichever writer meets it (issue 49).

The fault campaign's `fill:metrics.write@13+1930` (2026-11-27) ended a run with exit 1 and a traceback: the disk
filled while TensorBoard's event file, not metrics.jsonl, needed its next page, and TensorFlow reports that as a
`ResourceExhaustedError` carrying ENOSPC in its message only, which `hvrep train` did not map to its code.

Here the training is replaced by the part that failed, run for real: hvrep's metrics writer (metrics.jsonl and
TensorBoard) on a 1 MB tmpfs that fills up after its first line. The records are built so that TensorBoard's file
(ten scalars a record) needs a new page long before metrics.jsonl (room for ~15 of its lines) does. Root only (a
mount), as the campaign.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks._faults.training import tmpfs
from hvrep.errors import EXIT_NO_SPACE
from hvrep.train import faultpoint
from hvrep.train import main as train_main

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def test_tensorboard_meeting_a_full_disk_exits_74_with_one_line(demo_data, monkeypatch, capsys, tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as out:
        seen: dict = {}

        def run(cfg, resume, overwrite):  # stands in for the training: the metrics writer, for real
            from hvrep.train.metrics import MetricsWriter

            metrics = MetricsWriter(Path(cfg.output_dir), enabled=True)
            metrics.write("config", note="a short first line")
            faultpoint._fill(Path(cfg.output_dir), 0)  # the campaign's fill, leaving 0 bytes
            for step in range(1, 200):
                seen["step"] = step
                metrics.write("train", step, **{f"value{i}": float(i) for i in range(10)})
            seen["never_failed"] = True

        monkeypatch.setattr(train_main, "run", run)
        code = train_main.main(["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out / 'run'}"])
        err = capsys.readouterr().err
        assert "never_failed" not in seen, "the disk never filled"
        lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
        # The premise: metrics.jsonl still had room; the error came from TensorBoard's event file.
        assert len(lines) == seen["step"] + 1, (seen, lines[-1:], err)
    assert code == EXIT_NO_SPACE.code, err
    error_lines = [line for line in err.splitlines() if line.startswith("hvrep train: error:")]
    assert len(error_lines) == 1 and "the output file system is full" in error_lines[0], err
    assert "No space left on device" in error_lines[0] and "tfevents" in error_lines[0], err
    assert "Traceback" not in err and "{{function_node" not in err, err
