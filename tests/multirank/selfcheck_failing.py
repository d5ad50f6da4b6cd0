"""Cases that must make the harness report failure (tests/multirank/test_harness.py)."""

from hvrep import compat


def case_passes_everywhere():
    hvd = compat.import_horovod()
    assert hvd.size() == 2


def case_fails_on_rank_1_only():
    hvd = compat.import_horovod()
    assert hvd.rank() != 1, "deliberate failure on rank 1"


def case_after_the_failure_still_runs():
    hvd = compat.import_horovod()
    assert hvd.size() == 2
