"""Replicas that span two devices each (``Replicator(devices_per_replica=2)``), trained with the two-stage model
of examples/model_parallel.py: 2 replicas x 2 logical CPU devices on the local backend (one process), and 2 ranks
x 2 logical CPU devices under mpirun and under horovodrun --gloo. The three launches run side by side.

Each must train exactly as one device with the whole batch (1e-5), and the ops must have run on every device of
every replica: read from the partition graphs TensorFlow executed (its run metadata), not from the device scopes
the step asked for.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank

WORKER = Path(__file__).with_name("model_parallel_worker.py")
TIMEOUT = 420  # for the three launches together (a launch of the case files gets 540 s)
RUNS = ("local", "mpirun", "horovodrun")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """{run: {"rc": exit code or None, "log": text, "ranks": {rank: the worker's record}}}."""
    import contextlib

    tmp = tmp_path_factory.mktemp("model-parallel")
    out: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        procs = {}
        for run in RUNS:
            folder = tmp / run
            folder.mkdir()
            args = [str(WORKER), "--out", str(folder)]
            cmd = [sys.executable, *args] if run == "local" else harness.two_ranks(run, args)
            procs[run] = (folder, stack.enter_context(harness.launched(cmd, folder / "log.txt")))
        deadline = time.monotonic() + TIMEOUT
        for run, (folder, proc) in procs.items():
            try:
                rc: int | None = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired: the launch is killed on the way out
                rc = None
            ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
            out[run] = {"rc": rc, "log": (folder / "log.txt").read_text(), "ranks": ranks}
    return out


def _ok(result: dict, ranks: int) -> None:
    assert result["rc"] == 0, result["log"][-4000:]
    assert sorted(result["ranks"]) == list(range(ranks)), result["log"][-4000:]


@pytest.mark.parametrize("run", RUNS)
def test_a_split_model_trains_exactly_as_one_device_with_the_whole_batch(results, run):
    result = results[run]
    _ok(result, 1 if run == "local" else 2)
    for rank, rec in result["ranks"].items():
        assert rec["num_replicas"] == 2 and rec["steps"] >= 3, rec
        # Every replica's copy of every weight, after training, against the one-device whole-batch run.
        assert rec["max_difference"] <= 1e-5, (rank, rec["max_difference"])
        assert rec["loss_difference"] <= 1e-5, (rank, rec["loss_difference"])
        assert rec["weights_moved"] > 1e-3, rec  # it trained: a frozen model would also "match"


@pytest.mark.parametrize("run", RUNS)
def test_each_replica_owns_its_devices_and_its_ops_ran_on_both(results, run):
    result = results[run]
    _ok(result, 1 if run == "local" else 2)
    for rank, rec in result["ranks"].items():
        if run == "local":
            want = [["/device:CPU:0", "/device:CPU:1"], ["/device:CPU:2", "/device:CPU:3"]]
        else:
            want = [["/device:CPU:0", "/device:CPU:1"]]  # each rank's own process
        assert rec["replica_devices"] == want, rec
        assert rec["input_devices"] == want, rec
        executed = rec["executed"]  # device (as TF ran it) -> op types of its partition graphs
        for devices in want:
            for d in devices:
                ran = executed.get(d.rpartition("device:")[2], [])
                # Forward and backward matrix products of the stage placed there (oneDNN renames MatMul).
                assert sum("MatMul" in op for op in ran) >= 2, (rank, d, executed)
        # Stage 1's tanh backward ran on the first device only, stage 2's loss on the second.
        for first, second in want:
            assert "TanhGrad" in executed[first.rpartition("device:")[2]], executed
            assert "TanhGrad" not in executed[second.rpartition("device:")[2]], executed


def test_variables_created_under_a_device_live_there_on_horovod_and_on_each_replicas_first_device_in_graph(results):
    for run in ("mpirun", "horovodrun"):
        _ok(results[run], 2)
        for rec in results[run]["ranks"].values():
            assert rec["variable_devices"] == {"stage1": ["CPU:0"], "stage2": ["CPU:1"]}, rec
    _ok(results["local"], 1)
    # MirroredStrategy mirrors every variable on its replicas' first devices, whatever tf.device said.
    assert results["local"]["ranks"][0]["variable_devices"] == {"stage1": ["CPU:0", "CPU:2"],
                                                                 "stage2": ["CPU:0", "CPU:2"]}


@pytest.mark.parametrize("run", RUNS)
def test_three_devices_per_replica_are_refused_naming_the_devices_and_the_fix(results, run):
    result = results[run]
    _ok(result, 1 if run == "local" else 2)
    for rec in result["ranks"].values():
        refusal = rec["refusal"]
        assert refusal is not None and refusal["type"] == "ConfigError", refusal
        if run == "local":
            assert "devices_per_replica=3 does not divide this machine's 4 logical CPU devices" in refusal["message"]
        else:  # on each rank, under the launcher: its process has 2 logical CPU devices
            assert ("devices_per_replica=3, but this rank's process has 2 logical CPU device(s)"
                    in refusal["message"]), refusal
            assert "set_logical_device_configuration" in refusal["message"], refusal
