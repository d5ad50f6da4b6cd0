"""The support table's combination test (tests/multirank/cases_combinations.py), under mpirun AND horovodrun
--gloo, 2 ranks, one launch per launcher (launch_tests.py)."""

from __future__ import annotations

import pytest

from tests.multirank import launch_tests

pytestmark = pytest.mark.multirank

launch_tests.define("combinations", globals())
