"""Elastic training with real processes: horovodrun's elastic driver (Gloo) on two local host names.

Four launches, side by side (most of each is waiting on the other's processes or on the driver):

`horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S` with `localhost` and `127.0.0.1` as
two hosts (Horovod's own elastic tests do this; one host needs --network-interface). elastic_worker.py, through
the replica API and hvrep.elastic.run, has rank 0 SIGKILLed mid-epoch, a host added back and a host dropped in
one launch (see its docstring). Checked from what the workers wrote: the survivor trained again within 30 s of
the kill, rolled back to its last commit (2 steps), the joining worker and the dropped one caused no rollback,
every worker held the same weights after each sync, and each epoch trained every sample of its steps once
(the rolled-back steps' samples once more, after the rollback, and no others); the dropped worker said so
in one line and exited 0. It accumulates 2 steps per update through PowerSGD of rank 1 (its commits fall
mid-update): the final weights equal a one-process replay of the kept steps to 1e-5, so the rollback put back
the accumulated gradients and PowerSGD's state.

`hvrep train --config demo` under the same driver, started by `hvrep launch`, accumulating 2 steps of 32: the
test SIGKILLs rank 1 mid-epoch; the chief goes on alone within 30 s with the global batch kept, records the
reset in metrics.jsonl (why, worlds, steps rolled back, seconds lost) and finishes with exit 0 at the demo's
accuracy (>= 97%), its micro-step rolled back with its step.

model.fit with hvrep.keras.DistributedOptimizer (PowerSGD) and the elastic callbacks (elastic_fit_worker.py):
rank 0 SIGKILLed at epoch 1, batch 8; the survivor rolls back to the commit after batch 5 (PowerSGD's step
counter too), trains the rest of that epoch and the others, and exits 0 with the toy problem learnt.

A hung worker (SIGSTOP, elastic_fit_worker.py --stop-test, comm.timeout_s=8): hvrep's watchdog ends only the
stopped worker, and the other goes on alone and exits 0 (without elasticity every rank ends, exit 75).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hvrep.train.checkpoint import read_metadata
from tests.multirank import elastic_checks, harness

pytestmark = pytest.mark.multirank

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
LIMIT_S = 300
# The replica-API launch updates every 2 steps through PowerSGD of rank 1: its commits (every 5 steps) fall
# mid-update, and the kill's rollback must put back the accumulated gradients and PowerSGD's state.
API_ACCUMULATION, API_POWERSGD = 2, 1
REPLAY_ATOL = 1e-5
# hvrep train accumulates 2 steps of 32 per update (the demo's 64 per update, so its accuracy): a commit every
# 7 steps falls mid-update every other time.
TRAIN_ACCUMULATION = 2


def _elastic_command(tmp: Path, program: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """``program`` under horovodrun's elastic driver: 2 workers, 1 to 2, on the two local host names."""
    hosts = tmp / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    return [sys.executable, str(BIN / "horovodrun"), "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(elastic_checks.discovery_script(tmp, hosts)), "--network-interface", "lo",
            *extra, sys.executable, *program]


def _replica_api_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_worker.py"), "--out", str(out), "--hosts", str(tmp / "hosts"),
                                 "--accumulation-steps", str(API_ACCUMULATION), "--powersgd", str(API_POWERSGD)],
                           ("--blacklist-cooldown-range", "4", "5"))
    log = tmp / "job.log"
    if (rc := harness.run_logged(cmd, log, LIMIT_S)) is None:
        return {"error": f"the elastic job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    return {"rc": rc, "log": log.read_text(), "out": out}


def _fit_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_fit_worker.py"), "--out", str(out), "--powersgd", "1"])
    log = tmp / "job.log"
    if (rc := harness.run_logged(cmd, log, LIMIT_S)) is None:
        return {"error": f"the elastic fit job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    records = elastic_checks.jsonl(out.glob("fit.*.jsonl"))
    return {"rc": rc, "log": log.read_text(), "records": records}


def _stop_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_fit_worker.py"), "--out", str(out), "--stop-test"])
    log = tmp / "job.log"

    def records() -> list[dict]:
        return elastic_checks.jsonl(out.glob("stop.*.jsonl"))

    with harness.launched(cmd, log) as proc:
        deadline = time.monotonic() + LIMIT_S
        # once the first epoch trained on both
        victim, stopped_at = elastic_checks.signal_rank_1(
            proc, lambda: any(r["event"] == "epoch" for r in records()), signal.SIGSTOP, deadline, "elastic_fit_worker")
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"the SIGSTOP job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
        gone = victim is not None and (not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE)
    return {"rc": proc.returncode, "log": log.read_text(), "records": records(), "stopped_at": stopped_at,
            "victim_gone": gone}


def _train_launch(tmp: Path, demo_data: Path) -> dict:
    run = tmp / "run"
    # Through `hvrep launch`, which checks the settings against --min-np/--max-np first and then runs the same
    # horovodrun command as the other launches.
    hosts = tmp / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    cmd = [str(BIN / "hvrep"), "launch", "--np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
           str(elastic_checks.discovery_script(tmp, hosts)), "--launcher-args", "--network-interface lo", "--",
           sys.executable, "-m", "hvrep.cli", "train", "--config", "demo", f"data.data_dir={demo_data}",
           f"output_dir={run}", "elastic.min_np=1", "elastic.max_np=2", "elastic.commit_every_steps=7",
           "train.log_every=5", "train.epochs=10", "train.threads=1",
           f"train.global_batch={64 // TRAIN_ACCUMULATION}", f"comm.accumulation_steps={TRAIN_ACCUMULATION}"]
    log = tmp / "job.log"
    with harness.launched(cmd, log) as proc:
        deadline = time.monotonic() + LIMIT_S
        # at step 90 of 440, in epoch 3
        _, killed_at = elastic_checks.signal_rank_1(
            proc, lambda: sum(e["event"] == "train" for e in elastic_checks.events(run)) >= 9, signal.SIGKILL, deadline)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"hvrep train was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    return {"rc": proc.returncode, "log": log.read_text(), "events": elastic_checks.events(run), "killed_at": killed_at}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict]:
    """The four launches, run at the same time."""
    from hvrep.data import write_demo

    data = tmp_path_factory.mktemp("demo-data")
    write_demo(data)
    return harness.side_by_side({
        "api": lambda: _replica_api_launch(tmp_path_factory.mktemp("api")),
        "train": lambda: _train_launch(tmp_path_factory.mktemp("train"), data / "tfrecord"),
        "fit": lambda: _fit_launch(tmp_path_factory.mktemp("fit")),
        "stop": lambda: _stop_launch(tmp_path_factory.mktemp("stop"))})


def test_train_goes_on_after_a_kill_at_the_demo_accuracy(launches):
    got = launches["train"]
    assert "error" not in got, got.get("error")
    text, events = got["log"], got["events"]
    assert got["killed_at"] is not None, "rank 1 was never found to kill:\n" + text[-4000:]
    assert got["rc"] == 0, text[-6000:]
    resets = [e for e in events if e["event"] == "reset"]
    assert len(resets) == 1, resets
    r = resets[0]
    assert (r["why"], r["old_world"], r["new_world"]) == ("failure", 2, 1), r
    assert 0 <= r["steps_rolled_back"] < 7 and r["seconds_lost"] > 0, r  # back to the last commit, at most 6 steps
    assert r["time"] - got["killed_at"] < 30, f"the reset came {r['time'] - got['killed_at']:.1f} s after the kill"
    after = [e for e in events if e["event"] == "train" and e["time"] > r["time"]]
    assert after, "no step trained after the reset"
    final = events[-1]
    assert final["event"] == "final" and final["stopped"] == "completed" and final["replicas"] == 1, final
    assert final["top1"] >= 0.97, final
    # The rollback put the micro-step back with the step: every update boundary where the data has it.
    saved = read_metadata(final["checkpoint"])
    assert saved["accumulation"] == {"steps": TRAIN_ACCUMULATION, "micro_step": saved["step"]}, saved
    config = next(e for e in events if e["event"] == "config")
    assert config["config"]["train"]["global_batch"] == 32 and config["env"]["bound_here"] is False


def test_fit_with_the_callbacks_goes_on_after_a_kill(launches):
    got = launches["fit"]
    assert "error" not in got, got.get("error")
    assert got["rc"] == 0, got["log"][-6000:]
    # PowerSGD reduces on 2 workers only (one has nothing to reduce): the 12 batches of epoch 0 and the 5 of
    # epoch 1 up to the commit; the 3 after it, rolled back, count no more.
    elastic_checks.check_fit(got["records"], [(2, 1)], powersgd_steps=12 + 5)


def test_a_stopped_worker_is_ended_alone_and_the_other_goes_on(launches):
    got = launches["stop"]
    assert "error" not in got, got.get("error")
    assert got["stopped_at"] is not None, "rank 1 was never found to stop:\n" + got["log"][-4000:]
    assert got["rc"] == 0, got["log"][-6000:]
    assert got["victim_gone"], "the stopped worker outlived the job"
    assert "Elastic training: ending only rank 1" in got["log"], got["log"][-4000:]
    (done,) = [r for r in got["records"] if r["event"] == "done"]
    (reset,) = done["resets"]
    assert (reset["why"], reset["old_size"], reset["new_size"]) == ("failure", 2, 1), reset
    assert done["epoch"] == 4 and done["size"] == 1, done
    resumed = [r for r in got["records"] if r["event"] == "reset"]
    assert resumed and resumed[0]["at"] - got["stopped_at"] < 8 + 30, "the survivor went on too late"


def test_replica_api_kill_join_and_drop(launches):
    got = launches["api"]
    assert "error" not in got, got.get("error")
    assert got["rc"] == 0, got["log"][-6000:]
    # The dropped worker says so in one line and exits 0 (Horovod's C++ exception aborted it: exit 134).
    assert "terminate called" not in got["log"], got["log"][-6000:]
    assert "hvrep: elastic worker: the elastic driver dropped this worker" in got["log"], got["log"][-6000:]
    elastic_checks.check_replica_api(elastic_checks.jsonl(got["out"].glob("trained.*.jsonl")), [(2, 1), (1, 2), (2, 1)],
                                     global_batch=8, accumulation_steps=API_ACCUMULATION, powersgd_rank=API_POWERSGD,
                                     atol=REPLAY_ATOL)
