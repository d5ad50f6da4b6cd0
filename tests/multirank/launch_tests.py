"""The tests of one group of case files (harness.case_modules), under mpirun AND horovodrun --gloo, 2 ranks.

Each launcher runs the group's case modules in one launch (TensorFlow's import costs seconds per process); each
(launcher, case) is reported as its own test, and fails when the case failed, hung or never ran on any rank. A
test file defines its group's tests with ``define(group, globals())``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.multirank import harness


def define(group: str, namespace: dict[str, Any]) -> None:
    """Puts the ``launches`` fixture and the group's tests into a test module's ``namespace``."""
    modules = harness.case_modules(group)
    params = [pytest.param(launcher, path.name, case, id=f"{launcher}-{path.stem}-{case}")
              for launcher in harness.LAUNCHERS for path in modules for case in harness.case_names(path)]

    @pytest.fixture(scope="module")
    def launches(tmp_path_factory):
        results: dict[str, harness.LaunchResult] = {}

        def get(launcher: str) -> harness.LaunchResult:
            if launcher not in results:
                out = tmp_path_factory.mktemp(f"multirank-{group}-{launcher}")
                results[launcher] = harness.launch(launcher, out, modules)
            return results[launcher]

        return get

    @pytest.mark.parametrize(("launcher", "module", "case"), params)
    def test_case(launches, launcher: str, module: str, case: str) -> None:
        problem = launches(launcher).explain(module, case)
        assert problem is None, problem

    @pytest.mark.parametrize("launcher", harness.LAUNCHERS)
    def test_launch_saw_every_rank_and_exited_cleanly(launches, launcher: str) -> None:
        result = launches(launcher)
        assert result.started == {r: harness.NP for r in range(harness.NP)}, result.output[-3000:]
        assert result.done == set(range(harness.NP)), result.output[-3000:]
        assert result.returncode == 0, result.output[-3000:]

    namespace.update(launches=launches, test_case=test_case,
                     test_launch_saw_every_rank_and_exited_cleanly=test_launch_saw_every_rank_and_exited_cleanly)
