"""Elastic training with real processes: horovodrun's elastic driver (Gloo) on two local host names.

`horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script S` with `localhost` and `127.0.0.1` as
two hosts (Horovod's own elastic tests do this; one host needs --network-interface). elastic_worker.py, through
the replica API and hvrep.elastic.run, has rank 0 SIGKILLed mid-epoch, a host added back and a host dropped in
one launch (see its docstring). Checked from what the workers wrote: the survivor trained again within 30 s of
the kill, rolled back to its last commit (2 steps), the joining worker and the dropped one caused no rollback,
every worker held the same weights after each sync, and each epoch trained every sample of its steps once
(the rolled-back steps' samples once more, after the rollback, and no others).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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


@contextlib.contextmanager
def _launched(cmd: list[str], log: Path):
    """``cmd`` in a process group of its own; on the way out every process it started is continued and killed."""
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=harness.clean_env(),
                                cwd=harness.ROOT, start_new_session=True)
        try:
            yield proc
        finally:
            family = []
            with contextlib.suppress(psutil.Error):
                family = psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for p in family:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            proc.wait(timeout=30)


def _records(out: Path) -> list[dict]:
    lines = []
    for path in sorted(out.glob("trained.*.jsonl")):
        worker = path.name
        lines += [{**json.loads(line), "worker": worker} for line in path.read_text().splitlines() if line]
    return lines


def test_replica_api_kill_join_and_drop(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    cmd = [str(BIN / "horovodrun"), "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(_discovery_script(tmp_path, hosts)), "--network-interface", "lo",
           "--blacklist-cooldown-range", "4", "5", sys.executable, str(HERE / "elastic_worker.py"),
           "--out", str(out), "--hosts", str(hosts)]
    log = tmp_path / "job.log"
    with _launched(cmd, log) as proc:
        try:
            proc.wait(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the elastic job was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}")
    text = log.read_text()
    records = _records(out)
    assert proc.returncode == 0, text[-6000:]
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
