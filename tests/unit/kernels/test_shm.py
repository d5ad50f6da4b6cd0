"""hvrep's shared-memory all-reduce (kernels/tf/shm.cc) on real processes, without Horovod: its sums, its
independence from the order each rank's executor issues the ops in, and how it fails (a mismatch, a peer that
exits, a close while waiting) without hanging. The launchers' side (hvrep picks it on one host, and its result
equals Horovod's) is in tests/multirank/cases_shm.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.kernels import shm

WORKER = Path(__file__).with_name("shm_worker.py")
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(shm.native() is None, reason="the kernels are not built: `make setup`")


def run_ranks(tmp_path: Path, mode: str, size: int = 2, timeout: float = 120) -> list[dict]:
    path = tmp_path / "allreduce"
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
           "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(size), str(path), mode,
                               str(tmp_path / f"out{r}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{outs[r][-3000:]}"
    outs = [tmp_path / f"out{r}.json" for r in range(size)]
    return [json.loads(o.read_text()) for o in outs if o.exists()]


def test_sums_are_exact_and_the_same_bits_on_every_rank(tmp_path):
    # 3 ranks: shards of unequal length; 4 KiB chunks: 5,000 and 100,003 floats go in several.
    ranks = run_ranks(tmp_path, "sums", size=3)
    assert len(ranks) == 3
    for key, got in ranks[0]["sums"].items():
        assert got["wrong"] == 0, (key, got["wrong"])
        assert got["shape"] == [int(key.split("/")[1])], key
        for other in ranks[1:]:
            assert other["sums"][key]["bits"] == got["bits"], key


def test_the_parts_op_sums_what_the_pack_would_make_without_making_it(tmp_path):
    # 3 ranks; parts with gaps between them and a chunk boundary inside one; scales 1, 0.5 and 1/3.
    ranks = run_ranks(tmp_path, "parts", size=3)
    assert len(ranks) == 3
    found = ranks[0]["parts"]
    assert len(found) == 4 * 3 + 1
    for tag, got in found.items():
        if tag == "grad":
            continue
        # float32 (16-element alignment): 100 at 0, 300 at 112, 7 at 416, 0 and 1,500 at 432, 3 at 1,936: 1,939
        # elements; float64 (8): 0, 104, 408, 416, 1,920: 1,923; 2-byte types (32): 0, 128, 448, 480, 1,984: 1,987.
        assert got["shape"] == got["static"] == [{"float16": 1987, "bfloat16": 1987, "float32": 1939,
                                                  "float64": 1923}[tag.split("_")[0]]], (tag, got)
        assert got["same_as_packed"], tag
        if not tag.endswith("0.333"):  # a third is not exact: the bits are the pack's, checked above
            assert got["wrong"] == 0, (tag, got["wrong"])
        for other in ranks[1:]:
            assert other["parts"][tag]["bits"] == got["bits"], tag
    # y: the packed sum of 0.5 * ones over 3 ranks: 1.5 at the 5 + 6 part elements, 0 in the gap (5 -> 16).
    g = found["grad"]
    assert g["y"] == [1.5] * 5 + [0.0] * 11 + [1.5] * 6, g
    # dloss/dy_j = j * (1 + 2 + 3) summed over the ranks, times the scale 0.5, at each part's place.
    assert g["a"] == [3.0 * j for j in range(5)], g
    assert g["b"] == [[3.0 * j for j in range(16, 19)], [3.0 * j for j in range(19, 22)]], g


def test_the_ranks_may_issue_the_ops_in_different_orders(tmp_path):
    # Rank 0's executor issues b before a, rank 1's a before b: matched by key, not by arrival.
    ranks = run_ranks(tmp_path, "order", timeout=90)
    for r in ranks:
        assert (r["a"], r["b"], r["a_len"]) == (3.0, 30.0, 3000), r
        assert r["seconds"] < 30, r


def test_its_gradient_is_the_sum_of_the_upstream_gradients_over_the_ranks(tmp_path):
    for r in run_ranks(tmp_path, "grad"):
        assert r["grad"] == [3.0] * 6, r


def test_its_counters_split_the_collectives_time_into_waiting_for_the_peers_and_the_rest(tmp_path):
    ranks = run_ranks(tmp_path, "stats")
    assert len(ranks) == 2
    for r in ranks:
        assert all(v == 0 for v in r["before"].values()), r
        after = r["after"]
        assert (after["ops"], after["chunks"], after["bytes"]) == (2, 5, (1025 + 3000) * 4), r
        # Each collective's time from its submission covers the progress thread's time on it.
        assert after["latency_ns"] >= after["reduce_ns"] > 0, r
    late, waited = ranks[1]["after"], ranks[0]["after"]
    # Rank 0 announced the second collective and waited for rank 1's inputs the 0.3 s rank 1 slept, asleep
    # on the futex (the spin and yield last 50 us); rank 1 found it announced and its peer there.
    assert 0.25e9 < waited["wait_ns"] <= waited["reduce_ns"], waited
    assert waited["sleeps"] >= 1, waited
    assert late["wait_ns"] < 0.25e9, late


def test_a_mismatch_fails_every_rank_with_the_reason_and_breaks_the_transport(tmp_path):
    ranks = run_ranks(tmp_path, "mismatch")
    for r in ranks:
        assert r["error"] is not None and "rank 0 reduces 4 elements of float where rank 1 reduces 5" in r["error"], r
        assert r["later"] is not None and "reduces 4 elements" in r["later"], r


def test_a_peer_that_exits_fails_the_op_instead_of_hanging(tmp_path):
    ranks = run_ranks(tmp_path, "dead")
    assert len(ranks) == 1  # rank 1 exited without writing
    r = ranks[0]
    assert r["error"] is not None and "rank 1 (pid " in r["error"] and "exited" in r["error"], r
    assert r["seconds"] < 20, r


def test_closing_fails_an_op_still_waiting(tmp_path):
    ranks = run_ranks(tmp_path, "close")
    r = next(x for x in ranks if x["rank"] == 0)
    assert r["error"] is not None and "closed" in r["error"], r
    assert r["seconds"] < 20, r
