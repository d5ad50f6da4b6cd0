"""Every fenced python block of the docs and the README runs: one process for all of them, and the blocks
tagged ``launch`` also on 2 ranks, once under mpirun and once under horovodrun --gloo (one launch each, side
by side). Blocks tagged ``notest`` are not run (see blocks.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.multirank import harness
from tests.unit.docs.blocks import ROOT, all_blocks

BIN = Path(sys.executable).parent
RUNNER = Path(__file__).with_name("run_blocks.py")
TIMEOUT = 400


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Starts the three runs at once and collects each rank's results: {run: {rank: {block id: result}}}."""
    tmp = tmp_path_factory.mktemp("blocks")
    runnable = [b for b in all_blocks() if "notest" not in b.tags]
    launch = [b for b in runnable if "launch" in b.tags]
    assert launch, "no launch example found: the README's replica example is one"
    todo = {"local": runnable, "mpirun": launch, "horovodrun": launch}
    py = [sys.executable, str(RUNNER)]
    argv = {"local": py,
            "mpirun": [str(BIN / "mpirun"), "-np", "2", *harness.MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", *py[1:]],
            "horovodrun": [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *py]}
    procs = {}
    for name, blocks in todo.items():
        (tmp / name).mkdir()
        spec = tmp / f"{name}.json"
        spec.write_text(json.dumps([{"id": b.id, "code": b.code} for b in blocks]))
        procs[name] = subprocess.Popen([*argv[name], str(spec), str(tmp / name)], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp)
    out = {}
    for name, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name}: the blocks did not finish within {TIMEOUT} s")
        ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (tmp / name).glob("rank-*.json")}
        expected = 1 if name == "local" else 2
        assert proc.returncode == 0 and len(ranks) == expected, f"{name}: exit {proc.returncode}\n{log[-4000:]}"
        assert all(set(r) == {b.id for b in todo[name]} for r in ranks.values()), name
        out[name] = ranks
        print(name, {b: r["seconds"] for b, r in ranks[0].items()})  # where the time goes (pytest -s)
    return out


@pytest.mark.parametrize("run", ["local", "mpirun", "horovodrun"])
def test_every_block_runs(runs, run):
    failed = {f"{block} (rank {rank})": r["error"] for rank, res in runs[run].items()
              for block, r in res.items() if not r["ok"]}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())


def _readme_example(results: dict) -> dict:
    return next(r for block, r in results.items() if block.startswith("README.md:") and "replica(s)" in r["stdout"])


def _losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"loss (\d+\.\d+)", stdout)]


def test_the_readme_example_learns_in_one_process_and_on_two_ranks(runs):
    local = _readme_example(runs["local"][0])["stdout"]
    assert local.count("on 1 replica(s) (local)") == 3, local
    block = next(b for b, r in runs["local"][0].items() if r is _readme_example(runs["local"][0]))
    for run in ("mpirun", "horovodrun"):
        chief = runs[run][0][block]["stdout"]
        assert chief.count("on 2 replica(s) (horovod)") == 3, chief  # the chief prints, once per epoch
        assert runs[run][1][block]["stdout"] == "", runs[run][1][block]["stdout"]  # the other rank does not
    for stdout in (local, runs["mpirun"][0][block]["stdout"]):
        losses = _losses(stdout)
        assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], stdout  # it visibly learns


# The launch examples that fix the global batch and the learning rate: 1 process and 2 ranks train the same
# experiment (docs/large-batch.md#which-batch-which-learning-rate), so they end at the same weights and print the
# same losses. Their sharding and batch counts allow it: every step's global batch holds the same rows.
SAME_EXPERIMENT = ("README.md", "docs/migrating-from-horovod.md")


def _same_experiment_blocks() -> list[str]:
    ids = [b.id for b in all_blocks() if "launch" in b.tags and b.path in SAME_EXPERIMENT]
    assert sorted({i.split(":")[0] for i in ids}) == sorted(SAME_EXPERIMENT), ids
    return ids


def _weights(result: dict) -> list[np.ndarray]:
    assert result["weights"], "the block left no Keras `model` to compare"
    with np.load(result["weights"]) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.mark.parametrize("block", _same_experiment_blocks())
def test_one_process_and_two_ranks_train_the_same_experiment(runs, block):
    local = runs["local"][0][block]
    assert local["ok"], local["error"]
    reference = _weights(local)
    printed = _losses(local["stdout"])
    assert printed, local["stdout"]
    for run in ("mpirun", "horovodrun"):
        for rank in (0, 1):
            got = _weights(runs[run][rank][block])
            assert len(got) == len(reference)
            for i, (a, b) in enumerate(zip(reference, got, strict=True)):
                np.testing.assert_allclose(b, a, rtol=0, atol=1e-5, err_msg=f"{run} rank {rank}, weight {i}")
        # The chief prints; its losses equal the single process's to the digits printed.
        assert _losses(runs[run][0][block]["stdout"]) == printed, (run, runs[run][0][block]["stdout"], printed)
