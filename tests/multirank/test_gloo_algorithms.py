"""Gloo all-reduces of at most 1 MiB (GLOO_BCUBE_BYTES) take Gloo's halving-doubling algorithm, larger ones its ring
(hvrep/compat/horovod_patches.py, GLOO_PATCHES), and both are exact (gloo_algorithm_probe.py, 3 ranks under
``horovodrun --gloo``: not a power of two, so the halving-doubling's chunks are uneven and some ranks get none).

Which algorithm ran shows in the rounding: on 3 ranks the two add the three ranks' values in different orders,
so a sum of random values differs in its last bits between them. At or below the limit the default's sums differ
from the ring's (``HVREP_GLOO_BCUBE_BYTES=0``); above it they are the ring's, bit for bit. Before the patch every
size took the ring and the two settings agreed everywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hvrep.compat.horovod_patches import GLOO_BCUBE_BYTES as LIMIT
from tests.multirank import harness

PROBE = Path(__file__).with_name("gloo_algorithm_probe.py")
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    log = tmp_path_factory.mktemp("gloo-algorithms") / "job.log"
    cmd = [str(harness.BIN / "horovodrun"), "--gloo", "-np", "3", "-H", "localhost:3", sys.executable, str(PROBE)]
    rc = harness.run_logged(cmd, log, 240)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    found = {}
    for line in out.splitlines():
        if "GLOO_ALGORITHM_PROBE " in line:
            record = json.loads(line.split("GLOO_ALGORITHM_PROBE ", 1)[1])
            found[record["rank"]] = record
    assert sorted(found) == [0, 1, 2], out[-4000:]
    return found


def test_every_sum_is_exact_on_every_rank_either_way(ranks):
    for rank, record in ranks.items():
        wrong = [e for e in record["exact"] if not e[3]]
        assert not wrong and len(record["exact"]) == 64, (rank, wrong)


def test_the_ranks_agree_bit_for_bit(ranks):
    assert ranks[0]["digests"] == ranks[1]["digests"] == ranks[2]["digests"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_halving_doubling_up_to_the_limit_and_the_ring_beyond(ranks, dtype):
    digests = ranks[0]["digests"]
    width = {"float32": 4, "float16": 2}[dtype]
    for n in (1000, 4097, LIMIT // width):  # at or below 1 MiB: not the ring's rounding
        assert digests[f"default/{dtype}/{n}"] != digests[f"0/{dtype}/{n}"], (dtype, n)
    n = LIMIT // width + 3  # past it: the ring, bit for bit
    assert digests[f"default/{dtype}/{n}"] == digests[f"0/{dtype}/{n}"], (dtype, n)
