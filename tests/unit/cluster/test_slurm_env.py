"""slurm/env.sh's run bookkeeping, which slurm/preemptible.sbatch uses to decide whether to requeue.

A start of the job that died before hvrep read its configuration writes nothing to metrics.jsonl; its
end must not be read from the file's last run, which is an earlier start's (a CI run requeued such a
start as a hang because the previous start had stopped with stopped="timeout").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _bash(script: str, metrics: Path) -> str:
    env = {"HVREP_HOME": str(REPO), "HVREP_VENV": str(Path(sys.executable).parent.parent),
           "PATH": "/usr/bin:/bin", "M": str(metrics)}
    done = subprocess.run(["bash", "-c", f"source slurm/env.sh && {script}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _write(path: Path, *runs: list[dict]) -> None:
    with path.open("w") as f:
        for run in runs:
            for event in [{"event": "config"}, *run]:
                f.write(json.dumps(event) + "\n")


def test_a_missing_file_holds_no_run(tmp_path):
    assert _bash('hvrep_runs "$M"; hvrep_run_stopped "$M" 0', tmp_path / "none.jsonl").split() == ["0"]


@pytest.mark.parametrize(("before", "expected"), [(0, "signal"), (1, "timeout"), (2, "")])
def test_each_start_is_read_from_its_own_run(tmp_path, before, expected):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"event": "final", "stopped": "signal"}],
           [{"event": "epoch"}, {"event": "final", "stopped": "timeout"}])
    assert _bash('hvrep_runs "$M"', metrics) == "2"
    assert _bash(f'hvrep_run_stopped "$M" {before}', metrics) == expected


def test_a_start_that_wrote_nothing_is_not_read_as_the_last_start(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"event": "final", "stopped": "timeout"}])
    # Start 2 counted one run before srun, then died without a line: no `final` event of its own.
    assert _bash('before=$(hvrep_runs "$M"); hvrep_run_stopped "$M" "$before"', metrics) == ""


def test_a_run_that_crashed_has_no_final_event_even_when_an_earlier_run_had(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"event": "final", "stopped": "signal"}], [{"event": "epoch"}])
    assert _bash('hvrep_run_stopped "$M" 1', metrics) == ""


def test_preemptible_counts_the_runs_before_srun_and_asks_about_its_own():
    script = (REPO / "slurm" / "preemptible.sbatch").read_text()
    count = script.index('runs_before=$(hvrep_runs "$out/metrics.jsonl")')
    srun = script.index("srun --mpi=pmix --kill-on-bad-exit")
    assert count < srun
    assert 'stopped=$(hvrep_run_stopped "$out/metrics.jsonl" "$runs_before")' in script[srun:]


def test_the_step_a_start_got_to_is_its_last_recorded_one(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write(metrics, [{"event": "train", "step": 3}, {"event": "final", "step": 5, "stopped": "timeout"}],
           [{"event": "train", "step": 4}, {"event": "epoch"}])  # the second crashed after step 4
    assert _bash('hvrep_run_step "$M" 0; hvrep_run_step "$M" 1; hvrep_run_step "$M" 2', metrics).split() == ["5", "4"]


def test_the_same_failure_twice_in_a_row_is_repeated_and_a_clean_stop_forgets_it(tmp_path):
    out = tmp_path / "run"
    script = ('r1=$(hvrep_repeated_failure "$O" "exit 75 at step 5"); r2=$(hvrep_repeated_failure "$O" "exit 75 at '
              'step 6"); r3=$(hvrep_repeated_failure "$O" "exit 75 at step 6"); hvrep_forget_failure "$O"; '
              'r4=$(hvrep_repeated_failure "$O" "exit 75 at step 6"); echo "[$r1][$r2][$r3][$r4]"')
    assert _bash(f'O="{out}"; {script}', tmp_path / "none.jsonl") == "[][][repeated][]"


def test_preemptible_stops_requeuing_a_repeated_failure_before_it_requeues():
    script = (REPO / "slurm" / "preemptible.sbatch").read_text()
    decide = script.index('if [[ -n $(hvrep_repeated_failure "$out" "$failure") ]]; then')
    assert 'failure="exit ${status} at step $(hvrep_run_step "$out/metrics.jsonl" "$runs_before")"' in script
    assert decide < script.index('scontrol requeue "$SLURM_JOB_ID"')
    assert 'exit "$status"' in script[decide:decide + 400]
