"""The sbatch scripts in slurm/, submitted as users submit them, to a real one-node Slurm on localhost.

The node has 2 CPUs and 8 GPUs that exist only for the scheduler (see slurm_cluster.py), so the scripts
run as written except for their node shape: ``--nodes=1 --ntasks-per-node=2 --cpus-per-task=1`` on the
sbatch command line (it wins over ``#SBATCH`` lines) gives 2 ranks of ``hvrep train`` on the demo data.
Without Slurm, and no root to install it, every test here is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from benchmarks._faults.training import tmpfs
from hvrep.data import write_demo
from hvrep.errors import EXIT_MISMATCH
from tests.slurm.slurm_cluster import TERMINAL_STATES, LocalSlurm, SlurmError, SlurmUnavailable, ensure_slurm

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("single_node.sbatch", "multi_node.sbatch", "scaling_sweep.sbatch", "preemptible.sbatch")
# The test node's shape, given to sbatch as a user would; everything else comes from the scripts.
FIT = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
JOB_TIMEOUT = 240  # seconds; a 2-rank demo job takes about 45 s on the 2-core CI machine


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[LocalSlurm]:
    try:
        ensure_slurm()
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm to test the sbatch scripts with: {e}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    with cluster:
        yield cluster


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo-data")
    write_demo(root)
    return root / "tfrecord"


def _submit(slurm: LocalSlurm, script: str, output: Path, overrides: list[str], **env: str) -> int:
    """``sbatch FIT --output=OUTPUT slurm/SCRIPT OVERRIDES`` from the repository, as a user submits it."""
    job_env = {**slurm.env, "CONFIG": "demo", "HVREP_VENV": sys.prefix, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    return slurm.sbatch([*FIT, f"--output={output}", f"slurm/{script}", *overrides], env=job_env, cwd=REPO)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    # A line being written may be incomplete; it is read again on the next poll.
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _runs(out: Path) -> list[list[dict]]:
    """metrics.jsonl split into runs: each start of the job appends one, from its `config` event on."""
    events = _events(out)
    starts = [i for i, e in enumerate(events) if e["event"] == "config"]
    return [events[a:b] for a, b in itertools.pairwise([*starts, len(events)])]


def _stepping(out: Path, run: int, steps: int = 1) -> bool:
    """Run ``run`` (1 = the first start of the job) wrote its config and then trained ``steps`` steps."""
    runs = _runs(out)
    return len(runs) >= run and sum(e["event"] == "train" for e in runs[run - 1]) >= steps


def _wait_for(slurm: LocalSlurm, job: int, what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    ended = 0  # polls in a row that found the job ended: a requeue passes through states briefly
    while time.monotonic() < deadline and ended < 5:
        if ready():
            return
        ended = ended + 1 if slurm.job(job)["JobState"] in TERMINAL_STATES else 0
        time.sleep(1)
    pytest.fail(f"job {job}: no {what} within {timeout:.0f} s.\n{slurm.describe(job)}")


def _wait_completed(slurm: LocalSlurm, job: int) -> dict[str, str]:
    info = slurm.wait(job, JOB_TIMEOUT)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), slurm.describe(job)
    return info


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_is_valid_bash_and_slurm_accepts_its_options(slurm, script):
    res = subprocess.run(["bash", "-n", f"slurm/{script}"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # The ranks start through env.sh's hvrep_srun, which starts them again after a crash inside MPI_Init.
    assert "hvrep_srun --mpi=pmix" in (REPO / "slurm" / script).read_text()
    # --test-only: sbatch checks every #SBATCH option against the cluster and submits nothing.
    res = slurm.run(["sbatch", "--test-only", *FIT, f"slurm/{script}"], check=False, cwd=REPO)
    assert res.returncode == 0 and "to start at" in res.stderr, res.stdout + res.stderr


def test_single_node_runs_two_ranks_under_srun_and_exits_0(slurm, demo_data, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    job = _submit(slurm, "single_node.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                      "train.max_steps=3", "train.log_every=1"])
    info = _wait_completed(slurm, job)
    assert info["TresPerNode"] == "gres:gpu:8", info  # the script's GPU request, scheduled as written
    events = _events(out)
    config, final = events[0], events[-1]
    assert config["event"] == "config" and config["replicas"] == 2 and config["backend"] == "horovod", config
    assert config["config"]["data"]["data_dir"] == str(demo_data)
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3]
    assert final["event"] == "final" and final["stopped"] == "max_steps" and final["step"] == 3, final
    assert log.read_text().count("hvrep train: max_steps at step 3") == 1  # the chief alone prints


def test_a_rank_that_crashes_inside_mpi_init_is_started_again_and_the_run_completes(slurm, demo_data, tmp_path):
    # Open MPI 5.0 under srun --mpi=pmix crashes a rank inside MPI_Init in a few percent of starts
    # (docs/slurm-multi-node.md); nothing has run then, so the scripts start the step again. The fault is injected
    # (tests/slurm/mpi_init_crash.c, preloaded into the tasks): the first rank to start MPI raises SIGSEGV there.
    lib = tmp_path / "mpi_init_crash.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(REPO / "tests" / "slurm" / "mpi_init_crash.c"),
                    "-ldl"], check=True)
    marker = tmp_path / "crashed"
    out, log = tmp_path / "run", tmp_path / "job.out"
    job = _submit(slurm, "single_node.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                      "train.max_steps=2", "train.log_every=1"],
                  LD_PRELOAD=str(lib), HVREP_TEST_MPI_INIT_CRASH=str(marker))
    _wait_completed(slurm, job)
    text = log.read_text()
    assert marker.exists(), text[-3000:]  # the fault happened
    assert "Segmentation fault" in text and "MPI_Init_thread" in text, text[-3000:]  # Open MPI's report of it
    assert text.count("hvrep: a rank crashed inside MPI_Init") == 1, text[-3000:]
    runs = _runs(out)  # the crashed start wrote nothing; the second one is the run
    assert len(runs) == 1 and runs[0][0]["replicas"] == 2, runs
    assert [e["step"] for e in runs[0] if e["event"] == "train"] == [1, 2]
    assert runs[0][-1]["event"] == "final" and runs[0][-1]["stopped"] == "max_steps", runs[0][-1]


def test_a_pmix_folder_left_in_tmp_by_another_cluster_does_not_stop_a_step(slurm, tmp_path):
    """Slurm's PMIx plugin makes /tmp/spmix_appdir_<uid>_<job>.<step> unless TmpFS says otherwise; every test
    cluster numbers its jobs from 1, so a folder left by a killed run, or made at the same moment by the cluster of
    another pytest worker, stopped a step ("Cannot create directory ... File exists"). The clusters use their own
    TmpFS; the folders planted here for the next jobs' ids must not matter."""
    probe = slurm.sbatch(["--wrap", "true", "-o", str(tmp_path / "probe.out")])
    slurm.wait(probe, JOB_TIMEOUT)
    planted = []
    try:
        for job in range(probe + 1, probe + 4):
            folder = Path(f"/tmp/spmix_appdir_{os.getuid()}_{job}.0")
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                planted.append(folder)
        # srun exits 0 even when its tasks never launched ("task 0 launch failed"): count what they print.
        res = slurm.run(["srun", "--mpi=pmix", "--ntasks=2", "echo", "launched"], check=False, timeout=JOB_TIMEOUT)
        assert res.returncode == 0 and res.stdout.split() == ["launched"] * 2, res.stdout + res.stderr
    finally:
        for folder in planted:
            folder.rmdir()


# Outside make test (`pytest -m slow tests/slurm/test_slurm.py`): the same script's sweep runs across two nodes, with
# hvrep report, in test_slurm_multinode.py; this one-node sweep cost make test 83 s of a worker.
@pytest.mark.slow
def test_scaling_sweep_on_one_node_writes_each_run_and_the_report(slurm, demo_data, tmp_path):
    sweep = tmp_path / "sweep"
    log = tmp_path / "job.out"
    job = _submit(slurm, "scaling_sweep.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={sweep}"],
                  BATCH_PER_REPLICA="32", STEPS="3")
    _wait_completed(slurm, job)
    assert sorted(p.name for p in sweep.iterdir()) == ["nodes-1", "replicas-1", "report"]
    assert "| 2 |" in (sweep / "report" / "report.md").read_text()  # hvrep report's table, 2 replicas
    for name, replicas in (("replicas-1", 1), ("nodes-1", 2)):
        events = _events(sweep / name)
        assert events[0]["replicas"] == replicas and events[0]["config"]["train"]["global_batch"] == 32 * replicas
        assert events[-1]["stopped"] == "max_steps" and events[-1]["step"] == 3, events[-1]
    text = log.read_text()
    assert f"run {sweep}/nodes-1: 2 replica(s) on horovod" in text, slurm.describe(job)
    assert "scaling efficiency" in text, slurm.describe(job)


def _job_ranks(job: int) -> dict[int, psutil.Process]:
    """The job's `hvrep train` tasks on this node, by SLURM_PROCID."""
    found = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("SLURM_JOB_ID") == str(job) and "SLURM_PROCID" in env and "train" in p.cmdline() \
                    and any(a.endswith("hvrep") for a in p.cmdline()):
                found[int(env["SLURM_PROCID"])] = p
        except psutil.Error:
            continue
    return found


def _resumed_after_a_signal(first: list[dict], second: list[dict], out: Path) -> dict:
    """Checks that run ``first`` stopped on a signal with a checkpoint and ``second`` resumed at the next step from
    it; returns the first run's ``final`` event."""
    signalled = first[-1]
    assert signalled["event"] == "final" and signalled["stopped"] == "signal" and signalled["epoch"] < 50, signalled
    checkpoint = Path(signalled["checkpoint"])
    assert checkpoint.name == f"ckpt-{signalled['step']:08d}" and checkpoint.parent == out / "checkpoints"
    assert second[0]["resumed_from"] == str(checkpoint), second[0]
    assert next(e["step"] for e in second if e["event"] == "train") == signalled["step"] + 1
    return signalled


def test_preemptible_job_requeues_on_usr1_then_on_a_hung_rank_and_resumes_each_time(slurm, demo_data, tmp_path):
    # One job, three starts (the two requeue paths share one job: one first start fewer on the CI clock).
    # Start 1: USR1, as `#SBATCH --signal=USR1@120` sends before the time limit (to every step, not the batch shell):
    # every rank stops at the same step, the chief checkpoints, the script requeues. Start 2 resumes from that
    # checkpoint; then one rank is SIGSTOPped (a hang): hvrep's watchdog ends the other (exit 75), srun
    # --kill-on-bad-exit the stopped one, and the script requeues again. Start 3 resumes from the last complete
    # checkpoint, one that start 2 wrote.
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    job = _submit(slurm, "preemptible.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                      "train.epochs=50", "train.log_every=1",
                                                      "checkpoint.every_steps=2", "comm.timeout_s=20"])
    stopped: list[psutil.Process] = []
    try:
        _wait_for(slurm, job, "train event", lambda: _stepping(out, 1), JOB_TIMEOUT)
        slurm.run(["scancel", "--signal=USR1", str(job)])

        # 4 steps in start 2: a checkpoint (every 2 steps) from start 2 is complete before the hang.
        _wait_for(slurm, job, "4 train events after a requeue", lambda: _stepping(out, 2, steps=4), JOB_TIMEOUT)
        assert int(slurm.job(job)["Restarts"]) == 1, slurm.describe(job)
        ranks = _job_ranks(job)
        assert sorted(ranks) == [0, 1], ranks
        ranks[1].send_signal(signal.SIGSTOP)
        stopped.append(ranks[1])

        _wait_for(slurm, job, "train event after a second requeue", lambda: _stepping(out, 3), JOB_TIMEOUT)
        info = slurm.job(job)
    finally:
        for p in stopped:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
        slurm.run(["scancel", str(job)], check=False)
    assert int(info["Restarts"]) == 2, info
    first, second, third = _runs(out)[:3]
    # Start 1 -> 2: USR1's clean stop, resumed at the next step.
    signalled = _resumed_after_a_signal(first, second, out)
    # Start 2 -> 3: the watchdog's timeout naming the stopped rank; resumed from start 2's last complete checkpoint.
    timed_out = second[-1]
    assert timed_out["event"] == "final" and timed_out["stopped"] == "timeout", timed_out
    assert "rank(s) 1 did not join" in timed_out["report"], timed_out
    checkpoint = Path(timed_out["checkpoint"])
    # (Start 3 has pruned it by now, checkpoint.keep; that it resumed from it is the proof it was complete.)
    assert int(checkpoint.name.removeprefix("ckpt-")) > signalled["step"], timed_out  # one that start 2 wrote
    assert third[0]["resumed_from"] == str(checkpoint), third[0]
    text = log.read_text()  # --open-mode=append: every start in one file
    assert f"checkpoint saved; requeueing job {job}" in text, slurm.describe(job)
    assert "has not completed within comm.timeout_s=20 s: rank(s) 1 did not join" in text, slurm.describe(job)
    assert f"a collective timed out (hvrep's watchdog report is above); requeueing job {job}" in text, text[-3000:]
    assert f"job {job} start 2" in text and f"job {job} start 3" in text, slurm.describe(job)
    try:
        slurm.wait(job, 120)  # cancelled: its CPUs are free again for whatever runs next
    except SlurmError as e:
        pytest.fail(str(e))


def test_preemptible_job_trains_with_model_fit_stops_on_usr1_and_resumes_after_the_requeue(slurm, demo_data,
                                                                                           tmp_path):
    # train.loop=fit under the script as it is (it always passes --resume): USR1 stops every rank at the same step
    # boundary, the chief saves where the epoch stands, the job requeues, and the next start goes on from there.
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    job = _submit(slurm, "preemptible.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                      "train.loop=fit", "train.epochs=50", "train.log_every=1",
                                                      "train.steps_per_loop=1"])
    try:
        _wait_for(slurm, job, "train event", lambda: _stepping(out, 1), JOB_TIMEOUT)
        slurm.run(["scancel", "--signal=USR1", str(job)])
        _wait_for(slurm, job, "train event after a requeue", lambda: _stepping(out, 2), JOB_TIMEOUT)
        info = slurm.job(job)
    finally:
        slurm.run(["scancel", str(job)], check=False)
    assert int(info["Restarts"]) == 1, info
    first, second = _runs(out)[:2]
    assert first[0]["fast_path"]["loop"] == "fit" and second[0]["fast_path"]["loop"] == "fit", first[0]
    _resumed_after_a_signal(first, second, out)
    assert f"checkpoint saved; requeueing job {job}" in log.read_text(), slurm.describe(job)
    try:
        slurm.wait(job, 120)
    except SlurmError as e:
        pytest.fail(str(e))


def test_preemptible_job_is_not_requeued_when_the_ranks_run_different_collectives(slurm, tmp_path):
    # Uneven input across ranks is deterministic: a requeue would fail the same way. hvrep train's own pipelines
    # are even by construction, so srun runs a user's program with uneven input in its place
    # (tests/multirank/uneven_input.py, through a shim named hvrep first on the job's PATH); the script and Slurm
    # are as users run them. hvrep's watchdog ends both ranks with exit 65, and the script must not requeue.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'source "{sys.prefix}/bin/activate"\nexport PATH="{venv}/bin:$PATH"\n')
    shim = venv / "bin" / "hvrep"
    shim.write_text(f'#!/bin/sh\nexec python "{REPO}/tests/multirank/uneven_input.py"\n')
    shim.chmod(0o755)
    log = tmp_path / "job.out"
    job = _submit(slurm, "preemptible.sbatch", log, [f"output_dir={tmp_path / 'run'}"], HVREP_VENV=str(venv))
    try:
        info = _until_ended_or_requeued(slurm, job)  # requeued is the failure this test is about
    finally:
        slurm.run(["scancel", str(job)], check=False)
    text = log.read_text()
    assert int(info["Restarts"]) == 0, slurm.describe(job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", f"{EXIT_MISMATCH.code}:0"), slurm.describe(job)
    assert "the ranks are in different collectives" in text, slurm.describe(job)
    assert f"not requeueing job {job}" in text, text[-3000:]


def _until_ended_or_requeued(slurm: LocalSlurm, job: int) -> dict[str, str]:
    """The job's state once it has ended or been requeued, whichever comes first (a test fails past JOB_TIMEOUT)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    info = slurm.job(job)
    while info["JobState"] not in TERMINAL_STATES and int(info.get("Restarts", 0)) == 0:
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} still running after {JOB_TIMEOUT} s.\n{slurm.describe(job)}")
        time.sleep(1)
        info = slurm.job(job)
    return info


def _assert_not_requeued_for_a_full_disk(slurm: LocalSlurm, job: int, info: dict[str, str], text: str) -> None:
    assert int(info["Restarts"]) == 0, slurm.describe(job)
    assert "hvrep train: error: the output file system is full" in text, text[-3000:]
    assert f"is full (exit 74; hvrep's message is above); not requeueing job {job}" in text, text[-3000:]
    assert "stopped answering Slurm" not in text, text[-3000:]
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "74:0"), slurm.describe(job)


def test_preemptible_job_is_not_requeued_when_the_output_file_system_fills_up(slurm, demo_data, tmp_path):
    # A full output file system (issue 49): the chief meets ENOSPC writing a metrics.jsonl line (the fault
    # campaign's hook fills a 48 MB tmpfs mounted as the output folder) and exits 74; the other rank's next
    # collective fails ("Horovod has been shut down", exit 1), and srun returns 74. The script must say the disk is
    # full, not requeue (a requeue would fill it again), not wait out SlurmdTimeout for a lost node, and end with 74.
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "mnt") as mnt:
        out = mnt / "run"
        log = tmp_path / "job.out"
        job = _submit(slurm, "preemptible.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                          "train.epochs=50", "train.log_every=1"],
                      HVREP_FAULT="fill:metrics.write@4+0")
        try:
            info = _until_ended_or_requeued(slurm, job)
        finally:
            slurm.run(["scancel", str(job)], check=False)
        assert list(out.rglob(".hvrep-fault-fill")), f"the fault never filled the disk.\n{log.read_text()[-3000:]}"
    _assert_not_requeued_for_a_full_disk(slurm, job, info, log.read_text())


def test_preemptible_job_knows_a_full_disk_when_srun_had_to_sigkill_another_rank(slurm, demo_data, tmp_path):
    # The same full disk where a surviving rank cannot end by itself: on GPUs a rank inside an NCCL all-reduce
    # never notices that its peer is gone, ignores the SIGTERM of srun --kill-on-bad-exit (hvrep's handler stops
    # at the next step, which never comes) and is SIGKILLed after KillWait, so srun returns 137, not 74, and
    # metrics.jsonl, on the full disk, has no `final` event to say why. Here rank 1 is such a rank (a shim that
    # ignores SIGTERM and sleeps) and rank 0 is a real `hvrep train` on its own (one process, the launcher's
    # variables removed), on the full disk: the script must still read the chief's line and act on 74.
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'source "{sys.prefix}/bin/activate"\nexport PATH="{venv}/bin:$PATH"\n')
    shim = venv / "bin" / "hvrep"
    shim.write_text(
        "#!/bin/bash\n"
        'if [[ $SLURM_PROCID == 1 ]]; then trap "" TERM; exec sleep 600; fi\n'
        "unset $(compgen -e | grep -E '^(SLURM|PMIX|PMI|OMPI)_')\n"
        f'exec "{sys.executable}" -m hvrep.cli "$@"\n')
    shim.chmod(0o755)
    with tmpfs(tmp_path / "mnt") as mnt:
        out = mnt / "run"
        log = tmp_path / "job.out"
        job = _submit(slurm, "preemptible.sbatch", log, [f"data.data_dir={demo_data}", f"output_dir={out}",
                                                          "train.epochs=50", "train.log_every=1"],
                      HVREP_FAULT="fill:metrics.write@4+0", HVREP_VENV=str(venv))
        try:
            info = _until_ended_or_requeued(slurm, job)
        finally:
            slurm.run(["scancel", str(job)], check=False)
        assert list(out.rglob(".hvrep-fault-fill")), f"the fault never filled the disk.\n{log.read_text()[-3000:]}"
    text = log.read_text()
    assert "srun exited 137" in text, text[-3000:]  # the premise: rank 1 was SIGKILLed
    _assert_not_requeued_for_a_full_disk(slurm, job, info, text)
