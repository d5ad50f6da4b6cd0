"""A Replicator of several ranks on a node sizes and binds its threads by default (issue 31, item 3).

Three 2-rank launches side by side: ``horovodrun --gloo`` (binds nothing: each rank must take half the node's
cores and bind to its own), ``mpirun`` with its default binding (one core per rank: the pools get that one), and
``horovodrun --gloo`` where the application sized TensorFlow's pools itself (they stay, nothing is bound).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.multirank import harness

PROBE = str(Path(__file__).with_name("cpu_budget_probe.py"))
CORES = os.cpu_count() or 1
pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < CORES,
                                 reason="this test process is bound to some CPUs already (taskset or a cgroup)")]


def _commands() -> dict[str, tuple[list[str], dict[str, str]]]:
    """{name: (command, environment)}."""
    gloo = [str(harness.BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, PROBE]
    # Open MPI's default binding for 2 ranks: each to a core of its own.
    mpirun = [str(harness.BIN / "mpirun"), "-np", "2", sys.executable, "-m", "mpi4py", PROBE]
    pools = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
    unset = {k: v for k, v in harness.clean_env().items() if k not in pools}  # the harness sets both to 1
    app_sized = {**harness.clean_env(), **dict.fromkeys(pools, "1")}
    return {"gloo": (gloo, unset), "mpirun": (mpirun, unset), "gloo-app-sized": (gloo, app_sized)}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict[int, dict]]:
    import contextlib

    tmp = tmp_path_factory.mktemp("cpu-budget")
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, (cmd, env) in _commands().items():
            procs[name] = stack.enter_context(harness.launched(cmd, tmp / f"{name}.log", env))
        for proc in procs.values():
            proc.wait(timeout=240)
    got: dict[str, dict[int, dict]] = {}
    for name, proc in procs.items():
        text = (tmp / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{text[-3000:]}"
        lines = [json.loads(line.split("CPU_BUDGET ", 1)[1]) for line in text.splitlines() if "CPU_BUDGET " in line]
        got[name] = {r["rank"]: r for r in lines}
        assert sorted(got[name]) == [0, 1], text[-3000:]
    return got


@pytest.mark.skipif(CORES < 2, reason="binding 2 ranks to cores of their own needs 2 cores")
def test_under_horovodrun_each_rank_takes_its_share_and_binds_every_thread_to_it(probes):
    share = CORES // 2
    cores = []
    for rank, r in probes["gloo"].items():
        assert (r["intra"], r["inter"]) == (share, share), r
        assert r["budget"]["bind"] is True and "2 ranks on this node" in r["budget"]["why"], r["budget"]
        mine = {tuple(c) for c in r["threads"].values()}
        assert len(mine) == 1 and len(next(iter(mine))) == share, f"rank {rank}'s threads: {r['threads']}"
        cores.append(set(next(iter(mine))))
    assert not cores[0] & cores[1], f"both ranks on {cores}"


def test_under_mpirun_the_pools_fit_the_core_it_bound_and_the_binding_stays(probes):
    for rank, r in probes["mpirun"].items():
        bound = {tuple(c) for c in r["threads"].values()}
        assert len(bound) == 1, f"rank {rank}'s threads: {r['threads']}"
        n = len(next(iter(bound)))
        assert n < CORES, f"mpirun did not bind rank {rank}: {bound}"
        assert (r["intra"], r["inter"]) == (n, n) and r["budget"]["bind"] is False, r
        assert "launcher bound" in r["budget"]["why"], r["budget"]


def test_pools_the_application_sized_stay_and_nothing_is_bound(probes):
    for rank, r in probes["gloo-app-sized"].items():
        assert r["budget"]["bind"] is False and "TF_NUM_INTRAOP_THREADS=1" in r["budget"]["why"], r["budget"]
        assert all(len(c) == CORES for c in r["threads"].values()), f"rank {rank} was bound: {r['threads']}"
