"""Every case in tests/multirank/cases_*.py, under mpirun AND horovodrun --gloo, 2 ranks.

Each launcher runs all case modules in one launch (TensorFlow's import costs
seconds per process); each (launcher, case) is reported as its own test, and
fails when the case failed, hung or never ran on any rank.
"""

from __future__ import annotations

import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank

PARAMS = [
    pytest.param(launcher, path.name, case, id=f"{launcher}-{path.stem}-{case}")
    for launcher in harness.LAUNCHERS
    for path in harness.case_modules()
    for case in harness.case_names(path)
]


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    results: dict[str, harness.LaunchResult] = {}

    def get(launcher: str) -> harness.LaunchResult:
        if launcher not in results:
            out = tmp_path_factory.mktemp(f"multirank-{launcher}")
            results[launcher] = harness.launch(launcher, out, harness.case_modules())
        return results[launcher]

    return get


@pytest.mark.parametrize(("launcher", "module", "case"), PARAMS)
def test_case(launches, launcher: str, module: str, case: str) -> None:
    problem = launches(launcher).explain(module, case)
    assert problem is None, problem


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_launch_saw_every_rank_and_exited_cleanly(launches, launcher: str) -> None:
    result = launches(launcher)
    assert result.started == {r: harness.NP for r in range(harness.NP)}, result.output[-3000:]
    assert result.done == set(range(harness.NP)), result.output[-3000:]
    assert result.returncode == 0, result.output[-3000:]


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_nothing_a_peer_without_the_watchdog_secret_sent_reaches_the_output(launches, launcher: str) -> None:
    # cases_watchdog.py attacks rank 0's watchdog port during the launch; its text carries this marker.
    from tests.multirank.cases_watchdog import MARKER

    result = launches(launcher)
    assert result.cases.get(("cases_watchdog.py", "case_a_peer_without_the_secret_changes_nothing")), \
        "the attack case did not run"
    assert MARKER not in result.output, result.output[-3000:]
