"""The harness must fail when any rank fails: it runs a deliberately failing case file."""

from __future__ import annotations

import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("launcher", harness.LAUNCHERS)
def test_a_failure_on_one_rank_fails_the_case_and_the_launch(tmp_path, launcher: str) -> None:
    module = harness.HERE / "selfcheck_failing.py"
    result = harness.launch(launcher, tmp_path, [module], timeout=300)
    assert result.explain(module.name, "case_passes_everywhere") is None
    problem = result.explain(module.name, "case_fails_on_rank_1_only")
    assert problem is not None and "rank 1 failed" in problem and "deliberate failure" in problem
    assert "rank 0" not in problem.split("--- output tail ---")[0]
    # A failed case on one rank does not stop later cases, but the launch exits non-zero.
    assert result.explain(module.name, "case_after_the_failure_still_runs") is None
    assert result.returncode not in (0, None)


def test_unknown_launcher_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="launcher must be one of"):
        harness.command("srun-typo", tmp_path, [])
