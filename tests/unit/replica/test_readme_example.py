"""The README's replica-API example runs as printed: one process, and 2 ranks under mpirun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The replica API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path_factory.mktemp("readme") / "example.py"
    path.write_text(code)
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"loss (\d+\.\d+)", stdout)]


def test_readme_example_runs_in_one_process(example):
    res = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "on 1 replica(s) (local)" in res.stdout
    losses = _losses(res.stdout)
    assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], res.stdout  # it visibly learns


def test_readme_example_runs_on_two_ranks_under_mpirun(example):
    cmd = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "mpi4py", str(example)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("on 2 replica(s) (horovod)") == 5  # chief only, once per epoch
    losses = _losses(res.stdout)
    assert losses[-1] < 0.5 * losses[0], res.stdout


def test_readme_large_batch_snippet_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Large-batch training", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "large_batch.py"
    path.write_text(code)
    res = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    peak, _warmup, _epochs, smoothing, *source = res.stdout.split()
    assert 11.0 < float(peak) < 19.0 and float(smoothing) == 0.1 and "MLPerf" in " ".join(source)
