"""The communication schemes' and apps' cases (harness.APP_CASES: PowerSGD, local SGD, D4PG's learner), under
mpirun AND horovodrun --gloo, 2 ranks, one launch per launcher (launch_tests.py); apart from test_multirank.py so
that both run at once on two of make test's workers."""

from __future__ import annotations

import pytest

from tests.multirank import launch_tests

pytestmark = pytest.mark.multirank

launch_tests.define("apps", globals())
