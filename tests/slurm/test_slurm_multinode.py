"""The sbatch scripts across several nodes: a real Slurm cluster on the hosts of an hvrep netbed.

Eight namespace hosts (h1 ... h8, 1 Gbit/s shaped links), slurmctld on h1 and a slurmd on each
(tests/slurm/slurm_cluster.py, BedSlurm), started once for the test session. A partition of two hosts
per job keeps the jobs that run side by side apart: ``multi`` (h1, h2) runs multi_node.sbatch,
``sweep`` (h3, h4) scaling_sweep.sbatch, ``crash`` (h5, h6) and ``drain`` (h7, h8) each
preemptible.sbatch with ``--nodes=1-2``, and lose a node. Every job runs 1 rank per node of the demo
preset on CPUs. All four jobs are submitted at once (the module's ``jobs`` fixture); each test waits
for its own, the two that act on a running job (crash, drain) first. Without root, Slurm or the
netbed's tools, every test here is skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvrep.cluster import netbed
from hvrep.data import write_demo
from tests.slurm.slurm_cluster import TERMINAL_STATES, BedSlurm, SlurmUnavailable, ensure_slurm
from tests.slurm.test_slurm import JOB_TIMEOUT, REPO, _events, _runs, _stepping, _wait_for

# One pair of hosts per job, so that all four run at once and each job's traffic crosses its own links only.
PARTITIONS = {"multi": ["h1", "h2"], "sweep": ["h3", "h4"], "crash": ["h5", "h6"], "drain": ["h7", "h8"]}
GLOBAL_BATCH = 64  # the demo preset's; divides by the 2 and the 1 replica(s) before and after losing a node
MULTI_STEPS = 4


@dataclasses.dataclass
class Job:
    id: int
    out: Path  # the run's (or the sweep's) output folder
    log: Path  # the job's output file


@pytest.fixture(scope="session")
def bed_slurm(tmp_path_factory) -> Iterator[BedSlurm]:
    try:
        ensure_slurm()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm for the multi-node tests: {e}")
    reason = netbed.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no namespace hosts for a multi-node Slurm: {reason}")
    cluster = BedSlurm(tmp_path_factory.mktemp("bed-slurm"), hosts=8, link_gbit=1.0, partitions=PARTITIONS)
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def jobs(bed_slurm, tmp_path_factory) -> Iterator[dict[str, Job | dict]]:
    """Submits the four jobs at once; {"multi", "sweep", "crash", "drain": Job, "counters": links before}."""
    root = tmp_path_factory.mktemp("multinode")
    write_demo(root / "demo")
    data = root / "demo" / "tfrecord"
    env = {**bed_slurm.env, "CONFIG": "demo", "HVREP_VENV": sys.prefix, "TF_CPP_MIN_LOG_LEVEL": "2",
           "RANKS_PER_NODE": "1", "DRAIN_POLL_S": "1"}

    def submit(name: str, args: list[str], script: str, overrides: list[str], **extra: str) -> Job:
        """``sbatch ARGS --output=<root>/NAME.out slurm/SCRIPT data.data_dir=... output_dir=<root>/NAME OVERRIDES``."""
        out, log = root / name, root / f"{name}.out"
        job = bed_slurm.sbatch([*args, f"--output={log}", f"slurm/{script}", f"data.data_dir={data}",
                                f"output_dir={out}", *overrides], env={**env, **extra}, cwd=REPO)
        return Job(job, out, log)

    counters = bed_slurm.bed.counters()
    found: dict[str, Job | dict] = {"counters": counters}
    stop = threading.Event()
    try:
        found["multi"] = multi = submit("multi", ["--partition=multi", "--nodes=2", "--ntasks-per-node=1",
                                                  "--cpus-per-task=1"],
                                        "multi_node.sbatch", [f"train.max_steps={MULTI_STEPS}"])
        found["sweep"] = submit("sweep", ["--partition=sweep", "--nodes=2", "--ntasks-per-node=1",
                                          "--cpus-per-task=1"],
                                "scaling_sweep.sbatch", [], BATCH_PER_REPLICA="32", STEPS="3")
        # The link counters as the multi_node job ends (taken by a thread: the tests that act on the preemptible
        # jobs come first), before the clients' and slurmctld's messages add up on h1's link.
        watcher = threading.Thread(target=_when_ended, args=(bed_slurm, multi.id, found, stop), daemon=True)
        watcher.start()
        for name in ("crash", "drain"):
            found[name] = submit(name, [f"--partition={name}", "--nodes=1-2", "--cpus-per-task=1"],
                                 "preemptible.sbatch", ["train.epochs=50", "train.log_every=1",
                                  "checkpoint.every_steps=2", "comm.timeout_s=20"])
        yield found
    finally:
        stop.set()
        ids = [str(j.id) for j in found.values() if isinstance(j, Job)]
        if ids:
            bed_slurm.run(["scancel", *ids], check=False)


def _when_ended(cluster: BedSlurm, job: int, found: dict, stop: threading.Event) -> None:
    """Puts the bed's link counters in ``found["after_multi"]`` as soon as ``job`` has ended."""
    while not stop.is_set():
        if cluster.job(job)["JobState"] in TERMINAL_STATES:
            found["after_multi"] = cluster.bed.counters()
            return
        time.sleep(0.5)


def _completed(cluster: BedSlurm, job: Job, starts: int = 1) -> dict[str, str]:
    """Waits for ``job`` (``starts`` runs of hvrep train, one after the other) to complete with exit code 0."""
    info = cluster.wait(job.id, starts * JOB_TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), cluster.describe(job.id)
    return info


def _param_bytes(config: dict) -> int:
    """Bytes of the demo model's trainable weights (float32): what one all-reduce of the gradients moves."""
    from hvrep import models

    m, size = config["model"], config["data"]["image_size"]
    model = models.small_resnet(m["num_classes"], (size, size, 3), m["data_format"], width=m["width"])
    return 4 * sum(int(w.shape.num_elements()) for w in model.trainable_weights)


def _other_node(cluster: BedSlurm, job: Job) -> tuple[str, str]:
    """(the job's batch host, its other node) while it runs on two nodes."""
    info = cluster.job(job.id)
    batch = info["BatchHost"]
    nodes = cluster.run(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    assert len(nodes) == 2 and batch in nodes, info
    return batch, next(n for n in nodes if n != batch)


def _resumed_on_one_node(cluster: BedSlurm, job: Job, left: str) -> None:
    """Start 2 of ``job`` runs 1 rank on ``left`` from start 1's last checkpoint, at the same place in the epoch."""
    info = cluster.job(job.id)
    assert int(info["Restarts"]) == 1 and info["NodeList"] == left, cluster.describe(job.id)
    first, second = _runs(job.out)[:2]
    assert first[0]["replicas"] == 2 and second[0]["replicas"] == 1, (first[0], second[0])
    checkpoint = Path(second[0]["resumed_from"])
    step = int(checkpoint.name.removeprefix("ckpt-"))
    assert checkpoint.parent == job.out / "checkpoints" and step >= 2, second[0]
    assert step <= max(e["step"] for e in first if e["event"] == "train")  # one that start 1 wrote
    # The epoch goes on where the checkpoint left it: the samples start 1 trained are not trained again and the
    # rest are dealt to the one replica, for the epoch's same number of steps of the same global batch.
    per_epoch = first[0]["steps_per_epoch"]
    assert per_epoch == second[0]["steps_per_epoch"], (first[0], second[0])  # the same global batch
    resumes = [e for e in second if e["event"] == "resume"]
    if resumes:  # saved inside an epoch, or at its last step (the stop's or a periodic save): it goes on or ends
        resume = resumes[0]
        assert resume["replicas"] == [2, 1] and resume["global_batch"] == [GLOBAL_BATCH, GLOBAL_BATCH], resume
        done = resume["trained_samples"] // GLOBAL_BATCH
        assert resume["trained_samples"] == done * GLOBAL_BATCH and 0 < done <= per_epoch, (resume, per_epoch)
        assert done % per_epoch == step % per_epoch, (resume, step)
        assert done + resume["steps"] == per_epoch, (resume, per_epoch)
    else:  # the checkpoint of an epoch's end (where a stop or crash falls is timing): the next epoch starts whole
        assert step % per_epoch == 0, (second, step)
    assert next(e["step"] for e in second if e["event"] == "train") == step + 1


def test_preemptible_job_loses_a_crashed_node_and_resumes_on_the_node_left(bed_slurm, jobs):
    # The crash of a node: every process on it (slurmd, slurmstepd, the rank) is killed at once. The rank left
    # fails in its next all-reduce; the script waits for Slurm's verdict on the node (SlurmdTimeout), Slurm marks
    # it DOWN and requeues the job (--requeue), which starts again with 1 rank on the node left.
    job = jobs["crash"]
    try:
        # 3 steps: the checkpoint of step 2 (checkpoint.every_steps=2) is complete, and the epoch (22 steps) has
        # far to go.
        _wait_for(bed_slurm, job.id, "3 train events on two nodes", lambda: _stepping(job.out, 1, steps=3),
                  JOB_TIMEOUT)
        left, lost = _other_node(bed_slurm, job)
        assert _runs(job.out)[0][0]["replicas"] == 2
        bed_slurm.kill_host(lost)
        _wait_for(bed_slurm, job.id, "a train event after the requeue", lambda: _stepping(job.out, 2), JOB_TIMEOUT)
        _resumed_on_one_node(bed_slurm, job, left)
        text = job.log.read_text()
        states = bed_slurm.run(["sinfo", "-h", "-N", "-n", lost, "-o", "%T"]).stdout.strip()
    finally:
        bed_slurm.run(["scancel", str(job.id)], check=False)  # its CPU, for the jobs still running
    assert "preemptible: srun exited" in text and "without a final event" in text, text[-3000:]
    assert f"job {job.id} start 2" in text and "1 rank(s) on 1 node(s)" in text, text[-3000:]
    assert states.startswith("down"), states


def test_preemptible_job_leaves_a_drained_node_at_a_step_and_resumes_on_the_node_left(bed_slurm, jobs):
    # The administrator drains a node under the running job: Slurm itself lets the job run on; the script's
    # watcher sees the drain, the ranks stop at one step and save (USR1), the script requeues, and the next start
    # runs on the node left.
    job = jobs["drain"]
    _wait_for(bed_slurm, job.id, "2 train events on two nodes", lambda: _stepping(job.out, 1, steps=2), JOB_TIMEOUT)
    left, drained = _other_node(bed_slurm, job)
    bed_slurm.run(["scontrol", "update", f"nodename={drained}", "state=drain", "reason=hvrep test: maintenance"])
    try:
        _wait_for(bed_slurm, job.id, "a train event after the requeue", lambda: _stepping(job.out, 2), JOB_TIMEOUT)
        _resumed_on_one_node(bed_slurm, job, left)
        first = _runs(job.out)[0]
        signalled = first[-1]
        assert signalled["event"] == "final" and signalled["stopped"] == "signal", signalled
        assert _runs(job.out)[1][0]["resumed_from"] == signalled["checkpoint"]  # the checkpoint of the stop itself
        text = job.log.read_text()
        assert f"node(s) drained by the administrator: {drained} (hvrep test: maintenance)" in text, text[-3000:]
        assert f"checkpoint saved; requeueing job {job.id}" in text, text[-3000:]
    finally:
        bed_slurm.run(["scancel", str(job.id)], check=False)
        bed_slurm.run(["scontrol", "update", f"nodename={drained}", "state=resume"], check=False)


def test_multi_node_all_reduces_two_nodes_over_their_shaped_link(bed_slurm, jobs):
    job = jobs["multi"]
    info = _completed(bed_slurm, job)
    for _ in range(20):  # the fixture's thread takes them within a second of the job's end
        if "after_multi" in jobs:
            break
        time.sleep(0.5)
    after = jobs["after_multi"]
    assert info["NodeList"] == "h[1-2]" and info["NumNodes"] == "2", info
    listed = bed_slurm.run(["srun", "--mpi=list"])
    assert "pmix" in listed.stdout + listed.stderr, listed
    assert "hvrep: 2 ranks on 2 nodes (h[1-2])" in job.log.read_text(), bed_slurm.describe(job.id)
    events = _events(job.out)
    config, final = events[0], events[-1]
    assert config["replicas"] == 2 and config["backend"] == "horovod", config
    assert final["stopped"] == "max_steps" and final["step"] == MULTI_STEPS, final
    # Each step all-reduces every gradient between the two hosts: at least the weights' bytes each way per step
    # (2 ranks: each sends half in the reduce-scatter and half in the all-gather), through h1's and h2's hv0.
    least = MULTI_STEPS * _param_bytes(config["config"])
    for host in ("h1", "h2"):
        moved = after[host] - jobs["counters"][host]
        assert moved.tx_bytes >= least and moved.rx_bytes >= least, (host, moved, least)


def test_scaling_sweep_runs_across_two_nodes_and_hvrep_report_writes_the_report(bed_slurm, jobs):
    job = jobs["sweep"]
    _completed(bed_slurm, job, starts=3)  # 3 runs, one after the other, and the report
    sweep = job.out
    assert sorted(p.name for p in sweep.iterdir()) == ["nodes-1", "nodes-2", "replicas-1", "report"]
    for name, replicas in (("replicas-1", 1), ("nodes-1", 1), ("nodes-2", 2)):
        events = _events(sweep / name)
        assert events[0]["replicas"] == replicas and events[0]["config"]["train"]["global_batch"] == 32 * replicas
        assert events[-1]["stopped"] == "max_steps" and events[-1]["step"] == 3, events[-1]
    text = job.log.read_text()
    assert "sweep: nodes-2: 2 replica(s) on 2 node(s)" in text, bed_slurm.describe(job.id)
    assert f"run {sweep}/nodes-2: 2 replica(s) on horovod" in text, bed_slurm.describe(job.id)
    report = (sweep / "report" / "report.md").read_text()
    assert "| 2 |" in report and "nodes-2" in report, report


def test_the_cluster_has_one_slurmd_per_host_each_with_its_own_address_and_files(bed_slurm):
    addrs = {}
    for line in bed_slurm.run(["scontrol", "show", "nodes", "-o"]).stdout.splitlines():
        fields = dict(t.partition("=")[::2] for t in line.split() if "=" in t)
        addrs[fields["NodeName"]] = fields["NodeAddr"]
    assert addrs == {h: bed_slurm.bed.address(h) for h in bed_slurm.bed.hosts}
    for host in bed_slurm.bed.hosts:
        assert (bed_slurm.root / f"spool-{host}").is_dir() and (bed_slurm.root / f"slurmd-{host}.pid").is_file()
