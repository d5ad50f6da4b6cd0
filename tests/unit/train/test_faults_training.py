"""The fault campaign's training-app kinds, each injected once (issue 49): one run of `hvrep train` (one process,
the demo preset made tiny) taken through a chain of faults in one output folder, then resumed to its end.

1. SIGKILL inside the second checkpoint save, after 1,000 bytes of its data file: exit 137, the first
   checkpoint (step 5) intact, nothing half-written published.
2. Resumed, the output file system (a 48 MB tmpfs; root only) fills up before its first save's data: exit 74
   (EXIT_NO_SPACE, not 2 or a traceback), checkpoint 5 still intact. Space is made again.
3. Resumed, SIGKILL between steps after the save at step 15. Then the files are damaged as a disk fault would:
   a torn last line in metrics.jsonl, step 10's checkpoint.json cut short, step 15's data file truncated.
4. Resumed: it names the two damaged checkpoints and why, resumes from step 5, completes (exit 0) and ends with
   the weights of an uninterrupted run, bit for bit; every metrics line written before a fault is still there.

No process of any run is left behind. The 2-rank kinds (a rank or the whole job killed under mpirun and horovodrun
--gloo) are in tests/multirank/test_faults_ranks.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks._faults import training
from hvrep.errors import EXIT_NO_SPACE
from hvrep.train.faultpoint import FILL_NAME, Fault, parse

ROOT_USER = os.geteuid() == 0
# The chain is 5 runs of hvrep train one after another; on a loaded 2-core machine longer than the default 600 s.
pytestmark = pytest.mark.timeout(1200)


@contextlib.contextmanager
def _tmpfs(folder: Path):
    folder.mkdir(parents=True)
    if not ROOT_USER:  # no mount: the disk-full step is skipped
        yield False
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(folder)], check=True)
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Runs the chain; returns what each stage left (exit codes, logs, checkpoints, metrics lines)."""
    cache = tmp_path_factory.mktemp("faults-cache")
    want = training.reference(cache, "none")
    data = training.demo_data(cache)
    logs = tmp_path_factory.mktemp("faults-logs")
    seen: dict = {"want": want, "logs": logs}
    mnt = tmp_path_factory.mktemp("faults") / "mnt"
    with _tmpfs(mnt) as mounted:
        run = mnt / "run"
        args = training._args(data, run)

        def go(stage: str, fault: str | None, resume: bool) -> None:
            code, _, left = training.launch("none", [*args, *(["--resume"] if resume else [])],
                                            logs / f"{stage}.log", fault)
            seen[stage] = {"code": code, "left": left, "lines": training._lines(run / "metrics.jsonl"),
                           "ckpts": training._checkpoints(run), "log": (logs / f"{stage}.log").read_text()}

        go("save_kill", "kill:ckpt.data@2+1000", resume=False)
        seen["mounted"] = mounted
        if mounted:
            go("disk_full", "fill:ckpt.data@1+2000", resume=True)
            seen["filler"] = [str(p) for p in run.rglob(FILL_NAME)]
            for filler in run.rglob(FILL_NAME):
                filler.unlink()
        go("between_kill", "kill:step.between@10", resume=True)
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"event": "train", "time": 1.0, "st')
        os.truncate(run / "checkpoints" / "ckpt-00000010" / "checkpoint.json", 17)
        data_file = run / "checkpoints" / "ckpt-00000015" / "ckpt.data-00000-of-00001"
        os.truncate(data_file, data_file.stat().st_size // 2)
        go("resume", None, resume=True)
        seen["got"] = training._weights(run)
    return seen


def test_the_hook_parses_its_spec_and_refuses_a_bad_one():
    assert parse("") is None
    assert parse("kill:ckpt.data@3+100/1") == Fault("kill", "ckpt.data", 3, 100, 1)
    assert parse("fill:metrics.write") == Fault("fill", "metrics.write", 1, 0, None)
    assert parse(Fault("kill", "step.between", 7, 0, None).spec()) == Fault("kill", "step.between", 7, 0, None)
    for bad in ("kill:nowhere", "explode:ckpt.data", "kill ckpt.data"):
        with pytest.raises(Exception, match="HVREP_FAULT"):
            parse(bad)


def test_a_kill_inside_a_save_keeps_the_checkpoints_before_it(chain):
    stage = chain["save_kill"]
    assert stage["code"] == 137, stage["log"][-2000:]
    assert stage["ckpts"] == {5: None}, stage["ckpts"]  # step 10's half-written save is not published
    assert not stage["left"]


def test_a_full_disk_stops_the_run_with_its_own_code_and_keeps_the_checkpoints(chain):
    if not chain["mounted"]:
        pytest.skip("mounting a tmpfs needs root")
    stage = chain["disk_full"]
    assert chain["filler"], "the fault never filled the disk"
    assert stage["code"] == EXIT_NO_SPACE.code, stage["log"][-2000:]
    assert "the output file system is full" in stage["log"], stage["log"][-2000:]
    assert stage["ckpts"] == {5: None}, stage["ckpts"]
    assert not stage["left"]


def test_a_kill_between_steps_keeps_every_save_before_it(chain):
    stage = chain["between_kill"]
    assert stage["code"] == 137, stage["log"][-2000:]
    assert stage["ckpts"] == {5: None, 10: None, 15: None}, stage["ckpts"]
    assert not stage["left"]


def test_the_resume_names_each_damaged_checkpoint_and_ends_as_an_uninterrupted_run(chain):
    stage = chain["resume"]
    log = stage["log"]
    assert stage["code"] == 0, log[-3000:]
    assert "skipped checkpoint" in log and "ckpt-00000015" in log, log[-3000:]
    assert "ckpt-00000010" in log and "checkpoint.json cannot be read" in log, log[-3000:]
    assert "was cut off (a crash mid-write)" in log  # the torn metrics line: the next one starts a line of its own
    final = json.loads(stage["lines"][-1])
    assert final["event"] == "final" and final["stopped"] == "completed", final
    # Resumed from step 5 (the newest intact checkpoint): its first train line is step 6.
    # (The torn fragment is among the lines after the kill: skipped, as every reader skips it.)
    after = stage["lines"][len(chain["between_kill"]["lines"]):]
    assert training._first_step(after) == 6, after[:3]
    want, got = chain["want"], chain["got"]
    assert want and set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)  # bit-identical to an uninterrupted run
    assert not stage["left"]


def test_no_metrics_line_written_before_a_fault_disappears(chain):
    last = chain["resume"]["lines"]
    for stage in ("save_kill", "disk_full", "between_kill"):
        if stage in chain:
            assert training._kept_in_order(chain[stage]["lines"], last) == [], stage
