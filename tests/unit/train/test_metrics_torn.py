"""A torn or foreign line in metrics.jsonl costs that line only, for every reader of the file.

A node crash or SIGKILL in the middle of a write leaves a last line without its end; the next start of the run
appends after it. Every reader (the resumed run's own append, slurm/env.sh's requeue bookkeeping, ``hvrep
report``, the summary) skips such a line with a warning naming the file and line, and reads the rest.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from hvrep.perf import report, summary
from hvrep.train.metrics import MetricsWriter
from tests.unit.perf.test_report import _write_run

REPO = Path(__file__).resolve().parents[3]
TORN = '{"event": "train", "time": 1795362921.5, "step": 4'  # a write cut off mid-line: no closing brace, no \n
FOREIGN = '["not", "an", "event"]'


def _tear(path: Path) -> None:
    """Appends the fragment of a line a crash cut off (no newline), as a SIGKILLed chief leaves it."""
    with path.open("a") as f:
        f.write(TORN)


def test_a_resumed_run_starts_its_first_line_after_the_fragment(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "config", "replicas": 1}) + "\n")
    _tear(metrics)
    with caplog.at_level(logging.WARNING, logger="hvrep"):
        writer = MetricsWriter(tmp_path, enabled=True)
        writer.write("config", replicas=2)
        writer.close()
    lines = metrics.read_text().splitlines()
    assert lines[1] == TORN  # left as it was: the reader skips it
    assert json.loads(lines[2])["replicas"] == 2
    assert "last line" in caplog.text and str(metrics) in caplog.text


def test_the_slurm_bookkeeping_skips_torn_and_foreign_lines(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"event": "config"}, {"event": "final", "stopped": "signal"}]
    metrics.write_text("".join(json.dumps(e) + "\n" for e in lines) + FOREIGN + "\n" + TORN + "\n"
                       + json.dumps({"event": "config"}) + "\n" + json.dumps({"event": "final", "stopped": "timeout"})
                       + "\n")
    env = {"HVREP_HOME": str(REPO), "HVREP_VENV": str(Path(sys.executable).parent.parent), "PATH": "/usr/bin:/bin",
           "M": str(metrics)}
    # set -e as in slurm/preemptible.sbatch: a reader that fails ends the script before srun and the requeue.
    done = subprocess.run(["bash", "-c", 'set -euo pipefail; source slurm/env.sh; n=$(hvrep_runs "$M"); '
                           'echo "$n $(hvrep_run_stopped "$M" 0) $(hvrep_run_stopped "$M" 1)"'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "signal", "timeout"]
    assert f"{metrics}:3 is a JSON list" in done.stderr and f"{metrics}:4 is not JSON" in done.stderr


def test_hvrep_report_and_the_summary_read_a_run_with_a_torn_line(tmp_path, caplog):
    intact = _write_run(tmp_path / "intact", replicas=2, global_batch=64, epoch_ips=[90.0, 100.0, 110.0])
    run = _write_run(tmp_path / "run", replicas=2, global_batch=64, epoch_ips=[90.0, 100.0, 110.0])
    text = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(text[:3]) + TORN + "\n" + FOREIGN + "\n" + "".join(text[3:]))
    with caplog.at_level(logging.WARNING, logger="hvrep"):
        loaded = report.load_results([run])
        summed = summary.summarize(run)
    # The same as the run without the two lines: nothing after them is lost.
    assert (loaded[0].ranks, loaded[0].images_per_sec) == (2, report.load_results([intact])[0].images_per_sec)
    assert {k: v for k, v in summed.items() if k != "run"} == \
        {k: v for k, v in summary.summarize(intact).items() if k != "run"}
    assert f"{run / 'metrics.jsonl'}:4 is not JSON" in caplog.text
