"""Every case in tests/multirank/cases_*.py but the apps' (harness.APP_CASES), under mpirun AND horovodrun --gloo,
2 ranks, one launch per launcher (launch_tests.py)."""

from __future__ import annotations

import pytest

from tests.multirank import harness, launch_tests

pytestmark = pytest.mark.multirank

launch_tests.define("core", globals())


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_nothing_a_peer_without_the_watchdog_secret_sent_reaches_the_output(launches, launcher: str) -> None:
    # cases_watchdog.py attacks rank 0's watchdog port during the launch; its text carries this marker.
    from tests.multirank.cases_watchdog import MARKER

    result = launches(launcher)
    assert result.cases.get(("cases_watchdog.py", "case_a_peer_without_the_secret_changes_nothing")), \
        "the attack case did not run"
    assert MARKER not in result.output, result.output[-3000:]
