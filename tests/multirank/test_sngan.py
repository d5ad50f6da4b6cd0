"""The SN-GAN app (examples/sngan): its step on 2 in-graph replicas x B equals 1 replica x 2B, every weight to 1e-4.

One process with two in-graph replicas (the local backend on two logical CPU devices, against Horovod's one
rank), in a process of its own: the devices must be set before TensorFlow starts. The same check on 2 ranks under
``mpirun`` and ``horovodrun --gloo`` is tests/multirank/cases_sngan.py, in the apps' shared launch
(test_multirank_apps.py), where it costs no launch of its own.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.multirank import harness

pytestmark = pytest.mark.multirank

WORKER = str(harness.HERE / "sngan_worker.py")
TIMEOUT = 420  # three launches side by side took 247 s in all at load average 12-20 on 2 cores (a hang is forever)
MODES = {"ingraph": 1}  # launch -> processes that report


def _command(mode: str, out: Path) -> list[str]:
    if mode == "ingraph":
        return [sys.executable, WORKER, "--out", str(out), "--ingraph"]
    return harness.two_ranks(mode, [WORKER, "--out", str(out)])  # as cases_sngan.py runs it, for a failure's log


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("sngan")

    def one(mode: str) -> tuple[int | None, Path, Path]:
        out = root / mode
        out.mkdir()
        log = root / f"{mode}.log"
        return harness.run_logged(_command(mode, out), log, TIMEOUT), out, log

    with ThreadPoolExecutor(len(MODES)) as pool:
        return dict(zip(MODES, pool.map(one, MODES), strict=True))


@pytest.mark.timeout(TIMEOUT + 120)
@pytest.mark.parametrize("mode", list(MODES))
def test_two_replicas_of_b_equal_one_of_2b_for_every_weight(launches, mode: str) -> None:
    rc, out, log = launches[mode]
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(records) == MODES[mode], f"{mode}: exit {rc}, {len(records)} result(s)\n{tail}"
    for rec in records:
        assert "error" not in rec, f"{mode} rank {rec['rank']}:\n{rec['error']}"
        assert rec["variables"] > 60 and rec["nonzero"] > 60, rec  # G, D, EMA: weights, SN u's, BN statistics
        assert not rec["bad"], f"{mode} rank {rec['rank']}: differ by more than 1e-4: {rec['bad']}"
    assert rc == 0, f"{mode}: exit {rc}\n{tail}"
