"""Elastic training on 3 network-namespace hosts (hvrep.cluster.netbed): a worker killed, a host added, a host
dropped, under `horovodrun --gloo -np 3 --min-np 2 --max-np 3 --host-discovery-script S` started on h1.

Three launches side by side, each on a bed of its own (h1, h2, h3, one worker each, every transport on hv0;
`--blacklist-cooldown-range 4 5`, so the killed worker's host may come back), each going 3 -> kill -> 2 ->
add -> 3 -> drop -> 2:

- the replica API with hvrep.elastic.run (tests/multirank/elastic_worker.py, global batch 12): the workers
  drive the scenario at fixed steps. Checked: the survivors rolled back to their last commit (2 steps) and
  synced within 30 s of the kill, the join and the drop rolled nothing back, every worker held the same
  weights after each sync, and each epoch trained every sample of its steps once (the rolled-back steps'
  samples once more after the rollback, and no others; sample ids counted);
- `hvrep train --config demo` (global batch 48): this test SIGKILLs rank 1 mid-epoch and edits the discovery
  script's file (the killed host out, then every host back, then h3 out). Checked from metrics.jsonl: the
  three resets, why and which worlds, the failure's rollback within the commit interval and within 30 s of
  the kill, no rollback on the join and the drop, exit 0 at the demo's accuracy (>= 97%);
- model.fit with the elastic callbacks (tests/multirank/elastic_fit_worker.py --hosts, global batch 24): rank
  0 SIGKILLed at epoch 1, batch 8 (3 batches rolled back); a host added at epoch 2, batch 4 and one dropped at
  epoch 3, batch 4, neither re-training a batch; the toy problem learnt.

Each bed comes down when its launch ends, also when it fails. Root only (namespaces, veths); skipped with the
reason otherwise.

A survivor stuck after a kill, fixed: in 9 of 15 launches before the fix, one of the two survivors went on
waiting in a Gloo receive until HOROVOD_GLOO_TIMEOUT_SECONDS (180 s under hvrep's elastic setting). It was
waiting to receive from the other survivor (Gloo's ring receives from rank + 1), which had shut Horovod down
and was waiting in hvd.init(), its old Gloo connections still open: Horovod 0.28.1 does not release a process
set's Gloo contexts on shutdown. hvrep now shuts those connections down after hvd.shutdown()
(hvrep/compat/gloo_sockets.py). A launch where a survivor has not noticed the kill 45 s later is stopped there
and its test fails, naming the stuck rank(s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from hvrep.cluster import netbed
from tests.multirank import elastic_checks, harness

_REASON = netbed.unavailable_reason()

pytestmark = [
    pytest.mark.multirank,
    # Outside `make test` (pytest -m slow): three 3-host beds for 3-5 minutes do not fit its 25-minute budget yet.
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"netbed: {_REASON}"),
]

BIN = Path(sys.executable).parent
WORKERS = Path(__file__).resolve().parents[1] / "multirank"
HOSTS = ("h1", "h2", "h3")
LIMIT_S = 300
RECOVERY_S = 45  # from the kill to the survivors' reset line: 30 s is the goal, the rest slack for a loaded machine
# The demo at global batch 48 (2 and 3 divide it): 29 steps an epoch. Undisturbed on 1 process, 8 epochs with
# 1 of warm-up reached top-1 0.981 (6 epochs: 0.967, under the 0.97 goal), in about half the default 15 epochs.
DEMO = ["--config", "demo", "train.global_batch=48", "train.epochs=8", "optim.warmup_epochs=1",
        "elastic.min_np=2", "elastic.max_np=3", "elastic.commit_every_steps=7", "train.log_every=5",
        "train.threads=1"]


def _write_hosts(path: Path, hosts) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{h}:1\n" for h in hosts))
    tmp.replace(path)


def _elastic_on_bed(bed: netbed.NetBed, tmp: Path, program: list[str]) -> tuple[list[str], dict[str, str]]:
    """``program`` under horovodrun's elastic driver on ``bed``, started on h1: (argv, environment)."""
    hosts = tmp / "hosts"
    _write_hosts(hosts, HOSTS)
    cmd = [sys.executable, str(BIN / "horovodrun"), "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(elastic_checks.discovery_script(tmp, hosts)),
           "--network-interface", netbed.IFACE, "--blacklist-cooldown-range", "4", "5", sys.executable, *program]
    return bed.argv_on("h1", cmd), bed.env(harness.clean_env())


def _worker_launch(bed: netbed.NetBed, tmp: Path, worker: str, global_batch: int) -> dict:
    """``worker`` (tests/multirank/elastic_worker.py or elastic_fit_worker.py) driving its own kill, add and drop
    on ``bed``; the JSON lines it wrote."""
    out = tmp / "out"
    out.mkdir()
    cmd, env = _elastic_on_bed(bed, tmp, [str(WORKERS / worker), "--out", str(out), "--hosts", str(tmp / "hosts"),
                                          "--host-names", ",".join(HOSTS), "--global-batch", str(global_batch)])
    log = tmp / "job.log"
    with harness.launched(cmd, log, env) as proc:
        deadline = time.monotonic() + LIMIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            records = elastic_checks.jsonl(out.glob("*.jsonl"))
            kill = next((r for r in records if r["event"] == "killing"), None)
            noticed = sum(r["event"] == "reset" and r["why"] == "failure" for r in records)
            if kill is not None and time.time() - kill["at"] > RECOVERY_S and noticed < len(HOSTS) - 1:
                return {"stuck": log.read_text()}  # a survivor stuck (module docstring): stop here
            time.sleep(0.5)
        if proc.poll() is None:
            return {"error": f"{worker} was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}"}
    return {"rc": proc.returncode, "log": log.read_text(), "records": elastic_checks.jsonl(out.glob("*.jsonl"))}


def _train_launch(bed: netbed.NetBed, tmp: Path, demo_data: Path) -> dict:
    run, hosts = tmp / "run", tmp / "hosts"
    cmd, env = _elastic_on_bed(bed, tmp, ["-m", "hvrep.cli", "train", *DEMO, f"data.data_dir={demo_data}",
                                          f"output_dir={run}"])
    log = tmp / "job.log"
    got: dict = {"killed_at": None, "killed_host": None}

    def resets(why: str) -> list[dict]:
        return [e for e in elastic_checks.events(run) if e["event"] == "reset" and e["why"] == why]

    def trained_since(t: float) -> int:
        return sum(e["event"] == "train" and e["time"] > t for e in elastic_checks.events(run))

    with harness.launched(cmd, log, env) as proc:
        deadline = time.monotonic() + LIMIT_S

        def until(what: str, ready: Callable[[], bool]) -> bool:
            while not ready():
                if proc.poll() is not None or time.monotonic() > deadline:
                    got["error"] = f"hvrep train: never {what} (exit {proc.poll()}):\n{log.read_text()[-6000:]}"
                    return False
                time.sleep(0.2)
            return True

        # Mid-epoch 1 (step 30 of 180): rank 1 killed, and its host out of the script at once, before the
        # driver's blacklist cooldown (4-5 s) could let it straight back.
        victim: list[psutil.Process] = []

        def rank_1_found() -> bool:
            if trained_since(0) >= 6:
                victim.extend(p for p in psutil.Process(proc.pid).children(recursive=True)
                              if elastic_checks.rank_of(p) == 1)
            return bool(victim)

        if until("reached step 30 with a rank 1 to kill", rank_1_found):
            got["killed_host"] = victim[0].environ()["HOROVOD_HOSTNAME"]
            victim[0].send_signal(signal.SIGKILL)
            got["killed_at"] = time.time()
            _write_hosts(hosts, [h for h in HOSTS if h != got["killed_host"]])
            # The survivors go on within 30 s, or (the open bug in the module docstring) one of them waits out
            # the Gloo timeout (180 s): stop there rather than spend the file's time budget on it.
            went_on = min(deadline, time.monotonic() + RECOVERY_S)
            while not resets("failure") and proc.poll() is None and time.monotonic() < went_on:
                time.sleep(0.2)
            if not resets("failure") and proc.poll() is None:
                got["stuck"] = log.read_text()
            # Once the survivors train on: every host listed again; a worker joins at a commit. Then h3 dropped.
            elif until("went on after the kill", lambda: resets("failure") and trained_since(got["killed_at"])):
                _write_hosts(hosts, HOSTS)
                if until("grew back to 3 workers", lambda: resets("hosts added")):
                    added = resets("hosts added")[0]["time"]
                    if until("trained after the join", lambda: trained_since(added) >= 2):
                        _write_hosts(hosts, [h for h in HOSTS if h != "h3"])
        try:
            if "stuck" not in got:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            got.setdefault("error", f"hvrep train was still running after {LIMIT_S} s:\n{log.read_text()[-6000:]}")
    return {**got, "rc": proc.returncode, "log": log.read_text(), "events": elastic_checks.events(run)}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict]:
    """The three launches at the same time (threads), each on a bed of its own, torn down when it ends."""
    from hvrep.data import write_demo

    data = tmp_path_factory.mktemp("demo-data")
    write_demo(data)

    def on_bed(name: str, launch: Callable[..., dict], *args) -> Callable[[], dict]:
        def job() -> dict:
            with netbed.NetBed(hosts=len(HOSTS), link_gbit=None) as bed:
                return launch(bed, tmp_path_factory.mktemp(name), *args)
        return job

    return harness.side_by_side({"api": on_bed("api", _worker_launch, "elastic_worker.py", 12),
                                 "train": on_bed("train", _train_launch, data / "tfrecord"),
                                 "fit": on_bed("fit", _worker_launch, "elastic_fit_worker.py", 24)})


def _fail_if_a_survivor_is_stuck(got: dict) -> None:
    """A failure, naming it, when a survivor had not noticed the kill RECOVERY_S later (module docstring)."""
    if "stuck" in got:
        lost = sorted(set(re.findall(r"\[(\d+)\]<stderr>:.*a worker was lost", got["stuck"])))
        pytest.fail(f"{RECOVERY_S} s after the kill only rank(s) {lost} had noticed; another survivor still waits "
                    "in a Gloo receive (the old world's connections of a survivor not shut down on its reset? "
                    "see hvrep/compat/gloo_sockets.py):\n" + got["stuck"][-6000:])


def test_replica_api_kill_join_and_drop_on_three_hosts(launches):
    got = launches["api"]
    assert "error" not in got, got.get("error")
    _fail_if_a_survivor_is_stuck(got)
    assert got["rc"] == 0, got["log"][-6000:]
    elastic_checks.check_replica_api(got["records"], [(3, 2), (2, 3), (3, 2)], global_batch=12)
    hosts = {r["worker"].split(".")[1] for r in got["records"] if r["event"] == "start"}
    assert hosts == set(HOSTS), hosts  # one worker per namespace host, by its own host name


def test_fit_with_the_callbacks_kill_join_and_drop_on_three_hosts(launches):
    got = launches["fit"]
    assert "error" not in got, got.get("error")
    _fail_if_a_survivor_is_stuck(got)
    assert got["rc"] == 0, got["log"][-6000:]
    elastic_checks.check_fit(got["records"], [(3, 2), (2, 3), (3, 2)])


def test_train_kill_join_and_drop_on_three_hosts_at_the_demo_accuracy(launches):
    got = launches["train"]
    assert "error" not in got, got.get("error")
    _fail_if_a_survivor_is_stuck(got)
    text, events = got["log"], got["events"]
    assert got["rc"] == 0, text[-6000:]
    resets = [e for e in events if e["event"] == "reset"]
    assert [(r["why"], r["old_world"], r["new_world"]) for r in resets] == \
        [("failure", 3, 2), ("hosts added", 2, 3), ("hosts removed", 3, 2)], resets
    failure, added, removed = resets
    assert 0 <= failure["steps_rolled_back"] < 7, failure  # back to the last commit, at most 6 steps
    assert failure["time"] - got["killed_at"] < 30, \
        f"the reset came {failure['time'] - got['killed_at']:.1f} s after the kill"
    assert added["steps_rolled_back"] == 0 and removed["steps_rolled_back"] == 0, (added, removed)
    for r in resets:
        assert any(e["event"] == "train" and e["time"] > r["time"] for e in events), f"no step after {r}"
    final = events[-1]
    assert final["event"] == "final" and final["stopped"] == "completed" and final["replicas"] == 2, final
    assert final["top1"] >= 0.97, final
    config = next(e for e in events if e["event"] == "config")
    assert config["config"]["train"]["global_batch"] == 48


def test_each_bed_came_down(launches):
    left = {prefix: netbed.leftovers(prefix) for prefix in netbed.list_beds()
            if prefix.startswith(f"{netbed.PREFIX}-{os.getpid()}-")}
    assert not any(left.values()), left
