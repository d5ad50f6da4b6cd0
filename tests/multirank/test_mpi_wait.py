"""How a rank waits inside MPI under mpirun, with real Open MPI: CommConfig.mpi_yield_when_idle.

Horovod's background thread meets the other ranks in MPI once a cycle. Open MPI busy-polls while it
waits, taking a core from the training step on a machine whose cores the steps keep busy; hvrep asks
it to yield instead (docs/performance.md, "Throughput against plain Horovod"). What Open MPI did is read from the
waiting thread's own clock (mpi_wait_probe.py): a busy poll spends its wait in user space, a yielding
one mostly in sched_yield, the kernel. Four launches: the default, None (Open MPI's own busy poll),
and a script that started MPI before hvrep could set it (busy poll, and a warning with the fix); a
user's `mpirun --mca mpi_yield_when_idle 0` wins over the default.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.multirank import harness

# The waiting thread's own clock: another test's load would change how much CPU it got.
pytestmark = [pytest.mark.multirank, pytest.mark.serial]


def _probe(mode: str, tmp_path, mpirun_args: tuple[str, ...] = ()) -> tuple[dict, str]:
    cmd = [str(harness.BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", *mpirun_args,
           sys.executable, "-m", "mpi4py", str(harness.HERE / "mpi_wait_probe.py"), mode]
    log = tmp_path / f"{mode}{len(mpirun_args)}.log"
    returncode = harness.run_logged(cmd, log, timeout=120)
    if returncode is None:
        pytest.fail(f"the probe ({mode}) hung past 120 s:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert returncode == 0, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("MPI_WAIT ")]
    assert len(lines) == 1, text[-4000:]
    found = json.loads(lines[0].removeprefix("MPI_WAIT "))
    assert found["wall_s"] >= 0.9, found  # rank 0 did wait for the sleeping rank
    assert found["user_s"] + found["sys_s"] >= 0.5, found  # and polled while it waited
    return found, text


def _share_in_kernel(found: dict) -> float:
    return found["sys_s"] / (found["user_s"] + found["sys_s"])


def test_by_default_a_rank_waiting_in_mpi_yields_its_core(tmp_path):
    found, _ = _probe("default", tmp_path)
    assert found["OMPI_MCA_mpi_yield_when_idle"] == "1", found
    assert _share_in_kernel(found) >= 0.3, f"rank 0 busy-polled while it waited: {found}"


def test_the_users_mpirun_mca_wins_over_the_default(tmp_path):
    found, _ = _probe("default", tmp_path, ("--mca", "mpi_yield_when_idle", "0"))
    assert found["OMPI_MCA_mpi_yield_when_idle"] == "0", found
    assert _share_in_kernel(found) <= 0.1, f"rank 0 did not busy-poll: {found}"


def test_none_leaves_open_mpi_busy_polling(tmp_path):
    found, _ = _probe("none", tmp_path)
    assert found["OMPI_MCA_mpi_yield_when_idle"] is None, found
    assert _share_in_kernel(found) <= 0.1, f"rank 0 did not busy-poll: {found}"


def test_mpi_started_before_the_replicator_busy_polls_and_says_how_to_fix_it(tmp_path):
    found, text = _probe("mpi4py-first", tmp_path)
    assert found["OMPI_MCA_mpi_yield_when_idle"] is None, found  # not set where it would change nothing
    assert _share_in_kernel(found) <= 0.1, f"rank 0 did not busy-poll: {found}"
    warning = [line for line in text.splitlines() if "MPI started before this Replicator" in line]
    assert len(warning) == 1, text[-4000:]  # rank 0 only
    assert "mpirun --mca mpi_yield_when_idle 1" in warning[0], warning
