"""hvrep's Horovod waits for work instead of cycling (hvrep/compat/horovod_patches.py), with the real launchers.

Stock Horovod 0.28.1 runs a cycle every millisecond while it is up, each a collective among the ranks; hvrep's
build lets an idle background thread wait until a tensor is enqueued. idle_probe.py counts a rank's context
switches over 1 s with nothing enqueued, then checks that reduces after the idle second and with a rank 0.3 s
late give the right sums, that reduces with a joined rank (``hvd.join()``) do, and that ``hvd.shutdown()``
returns (the line is printed after it). Each launcher
runs twice, side by side (the same load for both): hvrep's default, and ``HVREP_HOROVOD_IDLE_WAIT_MS=0`` (stock
cycling, compiled in the same library), which the default is compared against.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import harness

PROBE = str(Path(__file__).with_name("idle_probe.py"))
# Switch counts of an idle second: another test's load would change them.
pytestmark = [pytest.mark.multirank, pytest.mark.serial]


VARIANTS = {"waits": {}, "cycles": {"HVREP_HOROVOD_IDLE_WAIT_MS": "0"}}


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("horovod-idle")
    got: dict[str, dict[int, dict]] = {}
    for launcher in ("horovodrun", "mpirun"):  # both variants of a launcher side by side: the same load
        runs = harness.side_by_side_runs(harness.two_ranks(launcher, [PROBE]), VARIANTS, tmp, "HOROVOD_IDLE")
        for variant, lines in runs.items():
            got[f"{launcher}-{variant}"] = {r["rank"]: r for r in lines}
            assert sorted(got[f"{launcher}-{variant}"]) == [0, 1], lines
    return got


# What stock cycling costs an idle rank: under Gloo, wake-ups (measured 3,300-4,200 context switches a second
# against 450-460 waiting); under Open MPI, whose waiting rank yields between polls without switching when nothing
# else wants the core, CPU (up to a whole core against 0.007).
@pytest.mark.parametrize(("launcher", "measure"), [("horovodrun", "switches_per_s"), ("mpirun", "cpu_per_s")])
def test_an_idle_rank_does_not_cycle(probes, launcher, measure):
    waits, cycles = probes[f"{launcher}-waits"], probes[f"{launcher}-cycles"]
    assert all(r["idle_wait_ms"] is None for r in waits.values()), waits
    assert all(r["idle_wait_ms"] == "0" for r in cycles.values()), cycles
    waiting, cycling = (sum(r[measure] for r in runs.values()) for runs in (waits, cycles))
    assert waiting * 3 < cycling, (measure, waits, cycles)


@pytest.mark.parametrize("name", ["horovodrun-waits", "mpirun-waits", "horovodrun-cycles", "mpirun-cycles"])
def test_reduces_after_an_idle_second_and_with_a_late_rank_are_exact(probes, name):
    for rank, r in probes[name].items():
        # The line is printed after hvd.shutdown() returned: a thread left waiting would have held the launch
        # past its timeout.
        assert r["sums"] == [3.0, 30.0, 300.0], (rank, r)
        # Rank 1 joined at once: rank 0's three reduces get its zeros; the last rank to join was rank 0.
        assert r["joined"] == ([1000.0] * 3 if rank == 0 else []) and r["last_joined"] == 0, (rank, r)

