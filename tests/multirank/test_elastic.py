"""Elastic training with real processes: horovodrun's elastic driver (Gloo) on two local host names.

Four launches, side by side (most of each is waiting on the other's processes or on the driver):

`horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S` with `localhost` and `127.0.0.1` as
two hosts (Horovod's own elastic tests do this; one host needs --network-interface). elastic_worker.py, through
the replica API and hvrep.elastic.run, has rank 0 SIGKILLed mid-epoch, a host added back and a host dropped in
one launch (see its docstring). Checked from what the workers wrote: the survivor trained again within 30 s of
the kill, rolled back to its last commit (2 steps), the joining worker and the dropped one caused no rollback,
every worker held the same weights after each sync, and each epoch trained every sample of its steps once
(the rolled-back steps' samples once more, after the rollback, and no others).

`hvrep train --config demo` under the same driver: the test SIGKILLs rank 1 mid-epoch; the chief goes on
alone within 30 s with the global batch kept, records the reset in metrics.jsonl (why, worlds, steps rolled
back, seconds lost) and finishes with exit 0 at the demo's accuracy (>= 97%).

model.fit with hvrep.keras.DistributedOptimizer and the elastic callbacks (elastic_fit_worker.py): rank 0
SIGKILLed at epoch 1, batch 8; the survivor rolls back to the commit after batch 5, trains the rest of that
epoch and the others, and exits 0 with the toy problem learnt.

A hung worker (SIGSTOP, elastic_fit_worker.py --stop-test, comm.timeout_s=8): hvrep's watchdog ends only the
stopped worker, and the other goes on alone and exits 0 (without elasticity every rank ends, exit 75).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
LIMIT_S = 300


def _discovery_script(tmp: Path, hosts: Path) -> Path:
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return script


def _elastic_command(tmp: Path, program: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """``program`` under horovodrun's elastic driver: 2 workers, 1 to 2, on the two local host names."""
    hosts = tmp / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    return [sys.executable, str(BIN / "horovodrun"), "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(_discovery_script(tmp, hosts)), "--network-interface", "lo", *extra,
            sys.executable, *program]


def _records(out: Path) -> list[dict]:
    lines = []
    for path in sorted(out.glob("trained.*.jsonl")):
        worker = path.name
        lines += [{**json.loads(line), "worker": worker} for line in path.read_text().splitlines() if line]
    return lines


def _replica_api_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_worker.py"), "--out", str(out), "--hosts", str(tmp / "hosts")],
                           ("--blacklist-cooldown-range", "4", "5"))
    log = tmp / "job.log"
    if (rc := harness.run_logged(cmd, log, LIMIT_S)) is None:
        return {"error": f"the elastic job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    return {"rc": rc, "log": log.read_text(), "out": out}


def _fit_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_fit_worker.py"), "--out", str(out)])
    log = tmp / "job.log"
    if (rc := harness.run_logged(cmd, log, LIMIT_S)) is None:
        return {"error": f"the elastic fit job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    records = [json.loads(line) for path in sorted(out.glob("fit.*.jsonl")) for line in path.read_text().splitlines()]
    return {"rc": rc, "log": log.read_text(), "records": records}


def _stop_launch(tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    cmd = _elastic_command(tmp, [str(HERE / "elastic_fit_worker.py"), "--out", str(out), "--stop-test"])
    log = tmp / "job.log"

    def records() -> list[dict]:
        return [json.loads(line) for path in sorted(out.glob("stop.*.jsonl")) for line in path.read_text().splitlines()
                if line]

    with harness.launched(cmd, log) as proc:
        deadline = time.monotonic() + LIMIT_S
        # once the first epoch trained on both
        victim, stopped_at = _signal_rank_1(proc, lambda: any(r["event"] == "epoch" for r in records()),
                                            signal.SIGSTOP, deadline, "elastic_fit_worker")
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"the SIGSTOP job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
        gone = victim is not None and (not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE)
    return {"rc": proc.returncode, "log": log.read_text(), "records": records(), "stopped_at": stopped_at,
            "victim_gone": gone}


def _train_launch(tmp: Path, demo_data: Path) -> dict:
    run = tmp / "run"
    cmd = _elastic_command(tmp, ["-m", "hvrep.cli", "train", "--config", "demo", f"data.data_dir={demo_data}",
                                 f"output_dir={run}", "elastic.min_np=1", "elastic.max_np=2",
                                 "elastic.commit_every_steps=7", "train.log_every=5", "train.epochs=10",
                                 "train.threads=1"])
    log = tmp / "job.log"
    with harness.launched(cmd, log) as proc:
        deadline = time.monotonic() + LIMIT_S
        # at step 45 of 220, in epoch 3
        _, killed_at = _signal_rank_1(proc, lambda: sum(e["event"] == "train" for e in _events(run)) >= 9,
                                      signal.SIGKILL, deadline)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return {"error": f"hvrep train was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    return {"rc": proc.returncode, "log": log.read_text(), "events": _events(run), "killed_at": killed_at}


def _signal_rank_1(proc: subprocess.Popen, ready, sig: int, deadline: float,
                   program: str = "hvrep.cli") -> tuple[psutil.Process | None, float | None]:
    """Sends ``sig`` to the job's rank-1 worker running ``program`` once ``ready()``; (the worker, when), or
    (None, None) if the job ended or ``deadline`` (monotonic) passed first."""
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            found = [p for p in psutil.Process(proc.pid).children(recursive=True) if _rank_of(p, program) == 1]
            if found:
                found[0].send_signal(sig)
                return found[0], time.time()
        time.sleep(0.2)
    return None, None


def _events(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _rank_of(p: psutil.Process, program: str = "hvrep.cli") -> int | None:
    """The rank the launcher started ``p`` as (its HOROVOD_RANK; stale after a reset), if it runs ``program``."""
    try:
        if program not in " ".join(p.cmdline()):
            return None
        value = p.environ().get("HOROVOD_RANK")
    except psutil.Error:
        return None
    return int(value) if value is not None else None


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict]:
    """Both launches, run at the same time (threads)."""
    from hvrep.data import write_demo

    data = tmp_path_factory.mktemp("demo-data")
    write_demo(data)
    results: dict[str, dict] = {}
    jobs = [threading.Thread(target=lambda: results.update(api=_replica_api_launch(tmp_path_factory.mktemp("api")))),
            threading.Thread(target=lambda: results.update(
                train=_train_launch(tmp_path_factory.mktemp("train"), data / "tfrecord"))),
            threading.Thread(target=lambda: results.update(fit=_fit_launch(tmp_path_factory.mktemp("fit")))),
            threading.Thread(target=lambda: results.update(stop=_stop_launch(tmp_path_factory.mktemp("stop"))))]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    return results


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
    config = next(e for e in events if e["event"] == "config")
    assert config["config"]["train"]["global_batch"] == 64 and config["env"]["bound_here"] is False


def test_fit_with_the_callbacks_goes_on_after_a_kill(launches):
    got = launches["fit"]
    assert "error" not in got, got.get("error")
    assert got["rc"] == 0, got["log"][-6000:]
    (done,) = [r for r in got["records"] if r["event"] == "done"]
    (reset,) = done["resets"]
    assert (reset["why"], reset["old_size"], reset["new_size"]) == ("failure", 2, 1), reset
    assert reset["rolled_back"] == {"batch": 3.0}, reset  # killed after batch 8, committed after batch 5
    assert done["epoch"] == 4 and done["size"] == 1, done
    # Epoch 1: 8 batches before the kill, then the 7 after the commit; the others 12 each.
    assert done["batches"] == {"0": 12, "1": 15, "2": 12, "3": 12}, done["batches"]
    assert done["accuracy"] >= 0.9, done


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
    out, proc_rc = got["out"], got["rc"]
    text = got["log"]
    records = _records(out)
    assert proc_rc == 0, text[-6000:]
    assert {r["backend"] for r in records if r["event"] == "start"} == {"horovod"}

    # The kill, and the survivor's first step after it.
    (kill,) = [r for r in records if r["event"] == "killing"]
    done = [r for r in records if r["event"] == "done"]
    assert len(done) == 1, done  # one worker finished: the others were killed or dropped
    resets = done[0]["resets"]
    assert [r["why"] for r in resets] == ["failure", "hosts added", "hosts removed"], resets
    assert [(r["old_size"], r["new_size"]) for r in resets] == [(2, 1), (1, 2), (2, 1)], resets
    assert resets[0]["rolled_back"] == {"step": 2.0}, resets[0]  # killed at step 7, last commit at step 5
    assert resets[1]["rolled_back"] == {} and resets[2]["rolled_back"] == {}, resets
    survivor = done[0]["worker"]
    synced = [r for r in records if r["event"] == "synced"]
    back = [r for r in synced if r["worker"] == survivor and r["world"] == 1]
    assert back and back[0]["step"] == 5, back  # rolled back to the commit
    assert back[0]["at"] - kill["at"] < 30, f"the survivor went on {back[0]['at'] - kill['at']:.1f} s after the kill"

    # Weights identical on every worker after each sync, per world (the kill's world has one worker).
    by_world: dict[tuple, set] = {}
    for r in synced:
        by_world.setdefault((r["step"], r["size"]), set()).add(r["weights"])
    assert all(len(w) == 1 for w in by_world.values()), by_world

    # Each epoch's samples, the rolled-back steps replaced by what was trained after the rollback.
    steps = [r for r in records if r["event"] == "step"]
    for epoch in sorted({r["epoch"] for r in steps}):
        latest: dict[int, tuple[int, list[int]]] = {}  # step in the epoch -> (world, ids of its last training)
        for r in steps:
            if r["epoch"] != epoch:
                continue
            world, ids = latest.get(r["k"], (-1, []))
            if r["world"] > world:
                latest[r["k"]] = (r["world"], list(r["ids"]))
            elif r["world"] == world:
                latest[r["k"]] = (world, ids + r["ids"])
        trained = [i for _, ids in latest.values() for i in ids]
        assert len(trained) == len(set(trained)), f"epoch {epoch}: a sample trained twice since the rollback"
        assert all(len(ids) == 8 for _, ids in latest.values()), f"epoch {epoch}: a step short of samples"
        assert sorted(latest) == list(range(len(latest))), f"epoch {epoch}: steps missing"
        assert len(trained) == 192 // 8 * 8, f"epoch {epoch}: {len(trained)} samples trained"
