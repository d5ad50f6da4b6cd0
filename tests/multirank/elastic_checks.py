"""What the elastic tests share: the discovery script, reading what the workers and `hvrep train` wrote,
finding and signalling a worker, and the checks of the replica-API and model.fit scenarios (elastic_worker.py,
elastic_fit_worker.py). Used on two local host names (test_elastic.py) and on 3 namespace hosts
(tests/multihost/test_elastic_bed.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil


def discovery_script(tmp: Path, hosts: Path) -> Path:
    """An executable that prints ``hosts``: horovodrun's --host-discovery-script."""
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return script


def jsonl(paths) -> list[dict]:
    """The JSON lines of ``paths``, in order, each with ``worker`` (its file's name); a torn last line skipped."""
    lines = []
    for path in sorted(paths):
        lines += [{**json.loads(line), "worker": path.name} for line in path.read_text().splitlines()
                  if line.endswith("}")]
    return lines


def events(run: Path) -> list[dict]:
    """``hvrep train``'s metrics.jsonl lines in ``run`` so far."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def rank_of(p: psutil.Process, program: str = "hvrep.cli") -> int | None:
    """The rank the launcher started ``p`` as (its HOROVOD_RANK; stale after a reset), if it runs ``program``."""
    try:
        if program not in " ".join(p.cmdline()):
            return None
        value = p.environ().get("HOROVOD_RANK")
    except psutil.Error:
        return None
    return int(value) if value is not None else None


def signal_rank_1(proc: subprocess.Popen, ready: Callable[[], bool], sig: int, deadline: float,
                  program: str = "hvrep.cli") -> tuple[psutil.Process | None, float | None]:
    """Sends ``sig`` to the job's rank-1 worker running ``program`` once ``ready()``; (the worker, when), or
    (None, None) if the job ended or ``deadline`` (monotonic) passed first."""
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            found = [p for p in psutil.Process(proc.pid).children(recursive=True) if rank_of(p, program) == 1]
            if found:
                found[0].send_signal(sig)
                return found[0], time.time()
        time.sleep(0.2)
    return None, None


def check_replica_api(records: list[dict], sizes: list[tuple[int, int]], global_batch: int, n: int = 192) -> None:
    """elastic_worker.py's run: a kill, a host added, a host dropped, the world going through ``sizes``
    ((old, new) per reset); ``records`` from its trained.*.jsonl files (:func:`jsonl`)."""
    assert {r["backend"] for r in records if r["event"] == "start"} == {"horovod"}
    (kill,) = [r for r in records if r["event"] == "killing"]
    done = [r for r in records if r["event"] == "done"]
    # The workers alive at the end: the first world's less the killed and the dropped one, plus the joiner.
    assert len(done) == sizes[-1][1], done
    # The first world's survivors saw every reset; a joiner only those after it joined.
    whole = [d for d in done if len(d["resets"]) == len(sizes)]
    assert whole, f"no worker that finished saw every reset: {[d['resets'] for d in done]}"
    for d in whole:
        resets = d["resets"]
        assert [r["why"] for r in resets] == ["failure", "hosts added", "hosts removed"], resets
        assert [(r["old_size"], r["new_size"]) for r in resets] == sizes, resets
        assert resets[0]["rolled_back"] == {"step": 2.0}, resets[0]  # killed at step 7, last commit at step 5
        assert resets[1]["rolled_back"] == {} and resets[2]["rolled_back"] == {}, resets
    synced = [r for r in records if r["event"] == "synced"]
    back = [r for r in synced if r["world"] == 1]
    assert len(back) == sizes[0][1], back  # every survivor synced in the world after the kill
    for r in back:
        assert r["step"] == 5, r  # rolled back to the commit
        assert r["at"] - kill["at"] < 30, f"a survivor went on {r['at'] - kill['at']:.1f} s after the kill"

    # Weights identical on every worker after each sync, per world.
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
        assert all(len(ids) == global_batch for _, ids in latest.values()), f"epoch {epoch}: a step short of samples"
        assert sorted(latest) == list(range(len(latest))), f"epoch {epoch}: steps missing"
        assert len(trained) == n // global_batch * global_batch, f"epoch {epoch}: {len(trained)} samples trained"


def check_fit(records: list[dict], sizes: list[tuple[int, int]]) -> None:
    """elastic_fit_worker.py's run: rank 0 killed at epoch 1, batch 8, then (with ``sizes`` of 3 resets) a host
    added at epoch 2, batch 4 and one dropped at epoch 3, batch 4; ``records`` from its fit.*.jsonl files."""
    done = [r for r in records if r["event"] == "done"]
    assert len(done) == sizes[-1][1], done
    whole = [d for d in done if len(d["resets"]) == len(sizes)]
    assert whole, f"no worker that finished saw every reset: {[d['resets'] for d in done]}"
    why = ["failure", "hosts added", "hosts removed"][:len(sizes)]
    for d in whole:
        resets = d["resets"]
        assert [r["why"] for r in resets] == why and [(r["old_size"], r["new_size"]) for r in resets] == sizes, \
            resets
        assert resets[0]["rolled_back"] == {"batch": 3.0}, resets  # killed after batch 8, committed after batch 5
        assert all(r["rolled_back"] == {} for r in resets[1:]), resets  # a host joined or left: nothing lost
        assert d["epoch"] == 4 and d["size"] == sizes[-1][1], d
        # Epoch 1: 8 batches before the kill, then the 7 after the commit; the others 12 each.
        assert d["batches"] == {"0": 12, "1": 15, "2": 12, "3": 12}, d["batches"]
        assert d["accuracy"] >= 0.9, d
    (kill,) = [r for r in records if r["event"] == "killing"]
    after = [r for r in records if r["event"] == "reset" and r["why"] == "failure"]
    assert len(after) == sizes[0][1], after  # every survivor reset once for the failure
    assert all(r["at"] - kill["at"] < 30 for r in after), (kill, after)
