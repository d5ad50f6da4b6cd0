"""An elastic reset shuts down Horovod's own Gloo connections only: a connection another thread opened while
``hvd.init()`` ran keeps working (gloo_sockets_probe.py, 2 ranks under ``horovodrun --gloo``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import harness

PROBE = str(Path(__file__).with_name("gloo_sockets_probe.py"))
pytestmark = pytest.mark.multirank


def test_a_user_threads_connection_opened_during_init_survives_the_reset(tmp_path):
    runs = harness.side_by_side_runs(harness.two_ranks("horovodrun", [PROBE]), {"probe": {}}, tmp_path,
                                     "GLOO_SOCKETS")["probe"]
    assert sorted(run["rank"] for run in runs) == [0, 1], runs
    for run in runs:
        # Horovod's own connections were found (the peer may have shut its ends down first: fewer left to close).
        assert run["total"] == 2.0 and run["world"] >= 1 and run["closed"] <= run["world"], runs
        assert run["user_recorded"] == [] and run["user_connection_works"] == [True, True], runs
    # The user's thread connected while hvd.init() ran on at least one rank (Gloo's rendezvous takes a while).
    assert any(run["during_init"] for run in runs), runs
