"""The fault campaign's rank kinds, each injected once under mpirun and under horovodrun --gloo (issue 49):
`hvrep train` on 2 ranks (the demo preset made tiny) taken through two SIGKILLs in one output folder.

1. One rank (rank 1 under mpirun, rank 0, the chief, under horovodrun) killed at step 7, at the end-of-loop
   reduce, before it joins (the other rank is inside that collective): the launcher ends the job, mpirun with
   137 and horovodrun with 1 (docs/troubleshooting.md, "Exit codes"); the checkpoint of step 5 reads back whole.
2. Resumed, the whole job (every rank) killed between steps at step 11: the same codes; checkpoints 5 and 10.
3. Resumed: it completes (exit 0) with the weights of an uninterrupted 2-rank run, bit for bit (a sum of two
   values does not depend on the order, so mpirun's reference serves both launchers).

Every metrics line written before a fault is still there at the end, and no process of any run is left behind.
The two launchers' chains and the reference run side by side (threads): most of each is TensorFlow's start-up.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from benchmarks._faults import training

# The fixture runs 7 launches (3 at a time); on a loaded 2-core machine they take longer than the default 600 s.
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(1500)]

LAUNCHERS = ("mpirun", "gloo")
KILLED = {"mpirun": 137, "gloo": 1}  # what each launcher exits with when a rank dies of SIGKILL


def _chain(launcher: str, data: Path, root: Path) -> dict:
    run = root / "run"
    args = training._args(data, run)
    seen: dict = {}
    one_rank = 1 if launcher == "mpirun" else 0
    for stage, fault, resume in (("kill_one_rank", f"kill:step.collective@7/{one_rank}", False),
                                 ("kill_job", "kill:step.between@6", True), ("resume", None, True)):
        log = root / f"{stage}.log"
        code, _, left = training.launch(launcher, [*args, *(["--resume"] if resume else [])], log, fault)
        seen[stage] = {"code": code, "left": left, "lines": training._lines(run / "metrics.jsonl"),
                       "ckpts": training._checkpoints(run), "log": log.read_text()}
    seen["got"] = training._weights(run)
    return seen


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    cache = tmp_path_factory.mktemp("faults-cache")
    data = training.demo_data(cache)
    with ThreadPoolExecutor(3) as pool:
        want = pool.submit(training.reference, cache, "mpirun")
        runs = {launcher: pool.submit(_chain, launcher, data, tmp_path_factory.mktemp(f"faults-{launcher}"))
                for launcher in LAUNCHERS}
        return {"want": want.result(), **{launcher: run.result() for launcher, run in runs.items()}}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_one_rank_killed_inside_a_collective_ends_the_job_with_the_documented_code(chains, launcher):
    stage = chains[launcher]["kill_one_rank"]
    assert stage["code"] == KILLED[launcher], stage["log"][-3000:]
    assert stage["ckpts"] == {5: None}, stage["ckpts"]
    assert not stage["left"], stage["left"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_whole_job_killed_between_steps_keeps_every_save_before_it(chains, launcher):
    stage = chains[launcher]["kill_job"]
    assert stage["code"] == KILLED[launcher], stage["log"][-3000:]
    assert stage["ckpts"] == {5: None, 10: None}, stage["ckpts"]
    assert not stage["left"], stage["left"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_resumed_job_ends_as_an_uninterrupted_one_and_keeps_every_metrics_line(chains, launcher):
    chain = chains[launcher]
    stage = chain["resume"]
    assert stage["code"] == 0, stage["log"][-3000:]
    final = json.loads(stage["lines"][-1])
    assert final["event"] == "final" and final["stopped"] == "completed", final
    after = stage["lines"][len(chain["kill_job"]["lines"]):]
    assert json.loads(next(line for line in after if '"event": "train"' in line))["step"] == 11
    for before in ("kill_one_rank", "kill_job"):
        assert training._kept_in_order(chain[before]["lines"], stage["lines"]) == [], before
    want, got = chains["want"], chain["got"]
    assert want and set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert not stage["left"], stage["left"]
