"""Unit tests for hvrep.replica.placement: which launcher wins, and what its variables say.

Every test passes an explicit environment; none reads or changes os.environ.
"""

from __future__ import annotations

import re
import socket
import sys

import pytest

from hvrep.errors import LauncherError
from hvrep.replica import placement
from hvrep.replica.placement import Placement, expand_hostlist, resolve_placement, tasks_per_node

THIS_HOST = socket.gethostname()


def _ompi(rank: int, size: int, local_rank: int, local_size: int, node_rank: int | None = None) -> dict:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }
    if node_rank is not None:
        env["OMPI_COMM_WORLD_NODE_RANK"] = str(node_rank)
    return env


def _horovodrun(rank: int, size: int, local_rank: int, local_size: int, *, cross: int, host: str) -> dict:
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross),
        "HOROVOD_HOSTNAME": host,
    }


# What `mpirun` inside an `sbatch` script leaves behind: the batch step's Slurm values.
SBATCH_STEP = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242"}


def test_openmpi() -> None:
    p = resolve_placement(_ompi(rank=5, size=8, local_rank=1, local_size=4, node_rank=1))
    assert p == Placement("openmpi", rank=5, size=8, local_rank=1, local_size=4, node_rank=1, host=THIS_HOST)
    assert not p.is_chief


def test_openmpi_without_node_rank_leaves_it_unknown() -> None:
    p = resolve_placement(_ompi(rank=0, size=2, local_rank=0, local_size=2))
    assert (p.launcher, p.node_rank, p.is_chief) == ("openmpi", None, True)


def test_horovodrun_takes_host_from_horovod_hostname() -> None:
    p = resolve_placement(_horovodrun(3, 4, 1, 2, cross=1, host="w-b"))
    assert p == Placement("horovodrun", rank=3, size=4, local_rank=1, local_size=2, node_rank=1, host="w-b")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            Placement("pmi", rank=3, size=4, local_rank=1, local_size=2, node_rank=None, host=THIS_HOST),
            id="hydra",
        ),
        # Without the local pair the launcher is assumed to run one node.
        pytest.param(
            {"PMI_RANK": "2", "PMI_SIZE": "3"},
            Placement("pmi", rank=2, size=3, local_rank=2, local_size=3, node_rank=None, host=THIS_HOST),
            id="bare-pmi",
        ),
    ],
)
def test_pmi(env: dict, expected: Placement) -> None:
    assert resolve_placement(env) == expected


HOSTS5 = ("node01", "node02", "node03", "node07", "gpu5")


def _slurm(env: dict, local_size: int, host: str, hosts: tuple = ()) -> Placement:
    """The Placement a Slurm task should get: rank, size, local rank and node straight from env."""
    node = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else None
    return Placement("slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"]),
                     local_size, node, host, hosts)


_LAST = {"SLURM_PROCID": "8", "SLURM_NTASKS": "9", "SLURM_LOCALID": "0", "SLURM_NODEID": "4",
         "SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_TASKS_PER_NODE": "2(x4),1"}
_GAP = {**_LAST, "SLURM_PROCID": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "3"}
# A step on the job's last two nodes, 3 tasks then 1: the step's values win over the job's.
_STEP = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "node[01-04]", "SLURM_TASKS_PER_NODE": "4(x4)",
         "SLURM_STEP_NODELIST": "node[03-04]", "SLURM_STEP_TASKS_PER_NODE": "3,1"}
# No node list, no counts: one node holding every task.
_BARE = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(_LAST, _slurm(_LAST, local_size=1, host="gpu5", hosts=HOSTS5), id="last-node"),
        pytest.param(_GAP, _slurm(_GAP, local_size=2, host="node07", hosts=HOSTS5), id="gap-in-range"),
        pytest.param(_STEP, _slurm(_STEP, local_size=1, host="node04", hosts=("node03", "node04")),
                     id="step-over-job"),
        pytest.param(_BARE, _slurm(_BARE, local_size=2, host=THIS_HOST), id="bare"),
    ],
)
def test_slurm(env: dict, expected: Placement) -> None:
    assert resolve_placement(env) == expected


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3(x2)", [1, 3, 3]), (" 2 , 1(x2) ", [2, 1, 1])],
)
def test_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["2(x)", "2(x3", "2(3)", "two", "2,", "", "-1"])
def test_tasks_per_node_rejects_malformed(spec: str) -> None:
    with pytest.raises(LauncherError, match=re.escape(f"SLURM_TASKS_PER_NODE={spec!r}")):
        tasks_per_node(spec)


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [("node[01-03,07],gpu5", HOSTS5), ("gpu5,node01", ("gpu5", "node01")), ("solo", ("solo",))],
)
def test_expand_hostlist_keeps_order(spec: str, hosts: tuple) -> None:
    assert expand_hostlist(spec) == hosts


def test_expand_hostlist_without_hostlist_or_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hostlist", None)  # makes `import hostlist` raise ImportError
    monkeypatch.setattr(placement.shutil, "which", lambda _name: None)
    with pytest.raises(LauncherError, match=r"'n\[1-2\]'.*pip install python-hostlist"):
        expand_hostlist("n[1-2]")


@pytest.mark.parametrize(
    ("env", "launcher", "rank", "size"),
    [
        pytest.param({**SBATCH_STEP, **_ompi(1, 2, 1, 2)}, "openmpi", 1, 2, id="mpirun-in-sbatch"),
        pytest.param(
            {**_ompi(0, 1, 0, 1), **_horovodrun(2, 4, 0, 2, cross=1, host="w-b")}, "horovodrun", 2, 4,
            id="horovodrun-over-openmpi",
        ),
        pytest.param(
            {**SBATCH_STEP, "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
            "pmi", 3, 4, id="pmi-over-slurm",
        ),
        # Garbage in the losing source is never read.
        pytest.param(
            {**_ompi(1, 2, 1, 2), "SLURM_PROCID": "garbage", "SLURM_NTASKS": "-1"}, "openmpi", 1, 2,
            id="bad-slurm-under-openmpi",
        ),
        pytest.param(
            {**_horovodrun(1, 2, 1, 2, cross=0, host="w-a"), "OMPI_COMM_WORLD_RANK": "x"}, "horovodrun", 1, 2,
            id="incomplete-openmpi-under-horovodrun",
        ),
    ],
)
def test_precedence(env: dict, launcher: str, rank: int, size: int) -> None:
    p = resolve_placement(env)
    assert (p.launcher, p.rank, p.size) == (launcher, rank, size)


# An `salloc` shell has a job id but no task variables.
@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "4242", "PATH": "/usr/bin"}])
def test_no_launcher_is_one_process(env: dict) -> None:
    p = resolve_placement(env)
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size, p.is_chief) == ("none", 0, 1, 0, 1, True)


_SLURM_2X3 = {"SLURM_PROCID": "0", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x3)"}


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        pytest.param({**_ompi(0, 2, 0, 2), "OMPI_COMM_WORLD_RANK": "one"}, ["OMPI_COMM_WORLD_RANK='one'"],
                     id="not-an-integer"),
        pytest.param({"PMI_RANK": "0", "PMI_SIZE": "2.0"}, ["PMI_SIZE='2.0'"], id="float"),
        pytest.param({**_horovodrun(0, 2, 0, 2, cross=0, host="w"), "HOROVOD_LOCAL_RANK": "-1"},
                     ["HOROVOD_LOCAL_RANK='-1'", "negative"], id="negative"),
        pytest.param(_ompi(2, 2, 0, 1), ["OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"],
                     id="rank-not-below-size"),
        pytest.param({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"},
                     ["MPI_LOCALRANKID=2", "MPI_LOCALNRANKS=2"], id="local-rank-not-below-local-size"),
        pytest.param(_ompi(0, 2, 0, 3), ["OMPI_COMM_WORLD_LOCAL_SIZE=3", "OMPI_COMM_WORLD_SIZE=2"],
                     id="local-size-above-size"),
        pytest.param(_horovodrun(0, 0, 0, 1, cross=0, host="w"), ["HOROVOD_SIZE=0"], id="size-zero"),
        pytest.param({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
                     ["OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE is not"], id="incomplete"),
        pytest.param({**_SLURM_2X3, "SLURM_NODEID": "3"}, ["SLURM_NODEID=3", "SLURM_TASKS_PER_NODE='2(x3)'"],
                     id="node-beyond-tasks-per-node"),
        pytest.param({**_SLURM_2X3, "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
                     ["SLURM_NODEID=2", "'n[1-2]'"], id="node-beyond-node-list"),
        pytest.param({**_SLURM_2X3, "SLURM_LOCALID": "2"}, ["SLURM_LOCALID=2"], id="slurm-local-id"),
        pytest.param({**_SLURM_2X3, "SLURM_TASKS_PER_NODE": "2(x3"}, ["SLURM_TASKS_PER_NODE='2(x3'"],
                     id="malformed-tasks-per-node"),
    ],
)
def test_errors_name_the_variable_and_value(env: dict, fragments: list[str]) -> None:
    with pytest.raises(LauncherError) as caught:
        resolve_placement(env)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_error_names_the_step_variable_it_read() -> None:
    env = {**_SLURM_2X3, "SLURM_STEP_TASKS_PER_NODE": "3(x"}
    with pytest.raises(LauncherError, match=r"SLURM_STEP_TASKS_PER_NODE='3\(x'"):
        resolve_placement(env)


def test_srun_pmi2_on_two_nodes_takes_the_local_pair_from_slurm() -> None:
    # Rank 5 of 8, four tasks on each of two nodes: second task on the second node.
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]"}
    p = resolve_placement(env)
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size) == ("pmi", 5, 8, 1, 4)
