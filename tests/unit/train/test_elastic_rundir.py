"""A worker joining a running elastic job accepts the job's own checkpoints in output_dir (hvrep.train.rundir).

Seen on 3 namespace hosts (tests/multihost/test_elastic_bed.py): the worker that the discovery script added
started `hvrep train`, found the checkpoints the job had written since it began, refused them ("holds
checkpoints of an earlier run", exit 2) and never joined. Another job's checkpoints are still refused.
"""

from __future__ import annotations

import pytest

from hvrep.errors import ConfigError
from hvrep.train import rundir


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-00000029.index").write_text("")
    return tmp_path


def _as_elastic_worker(monkeypatch, port: str) -> None:
    # What horovodrun's elastic driver gives each worker of a job (the port is the job's own).
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.201.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", port)


def test_a_joining_worker_accepts_its_own_jobs_checkpoints(run_dir, monkeypatch):
    _as_elastic_worker(monkeypatch, "41717")
    rundir.mark_elastic_job(run_dir)  # the chief, when the job started
    assert (run_dir / rundir.ELASTIC_JOB_FILE).read_text().strip() == "10.201.0.1:41717"
    rundir.check_output_dir(run_dir, resume=False, overwrite=False)  # the joiner, later: no error


def test_another_jobs_checkpoints_are_still_refused(run_dir, monkeypatch):
    _as_elastic_worker(monkeypatch, "41717")
    rundir.mark_elastic_job(run_dir)
    _as_elastic_worker(monkeypatch, "50001")  # a new horovodrun in the same folder
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run"):
        rundir.check_output_dir(run_dir, resume=False, overwrite=False)
    monkeypatch.delenv("HOROVOD_ELASTIC")  # and outside the driver, as before
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run"):
        rundir.check_output_dir(run_dir, resume=False, overwrite=False)
