"""backend="auto" under a real multi-rank launcher, and Horovod's world against the launcher's.

A process that falls back to ``local`` under ``mpirun -np 2`` becomes a
one-replica job of its own and the chief: two jobs writing one folder. These
launch real ranks (mpirun and horovodrun --gloo) with Horovod made
unimportable, and one process that Slurm's variables call rank 0 of 2 while
Horovod starts alone (srun without an MPI plugin).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multirank import harness

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
SCRIPT = """
import hvrep
try:
    r = hvrep.Replicator({backend!r})
except hvrep.errors.SetupError as e:
    print("SETUP_ERROR", e, flush=True)
    raise SystemExit(3)
print("BACKEND", r.backend, r.num_replicas, r.is_chief, flush=True)
"""


def _env(tmp_path: Path, break_horovod: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "SLURM_", "HOROVOD_"))}
    paths = [str(ROOT)]
    if break_horovod:
        fake = tmp_path / "fake" / "horovod"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('simulated: this horovod build is broken')\n")
        paths.insert(0, str(fake.parent))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="3",
               TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1")
    return env


def _launch(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


LAUNCHERS = {
    "mpirun": [str(BIN / "mpirun"), "-np", "2", *harness.MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", "-c"],
    "horovodrun": [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-c"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_auto_under_a_two_rank_launcher_without_horovod_fails_naming_why(tmp_path, launcher):
    env = _env(tmp_path, break_horovod=True)
    argv = [*LAUNCHERS[launcher], SCRIPT.format(backend="auto")]
    if launcher == "horovodrun":
        # horovodrun itself needs Horovod: only the ranks it starts get the broken one.
        i = argv.index(sys.executable)
        argv[i:i] = ["env", f"PYTHONPATH={env['PYTHONPATH']}"]
        env["PYTHONPATH"] = str(ROOT)
    out = _launch(argv, env)
    text = out.stdout + out.stderr
    assert "BACKEND" not in text, text[-3000:]  # no rank became a job of its own
    assert out.returncode != 0, text[-3000:]
    assert text.count("SETUP_ERROR") == 2, text[-3000:]
    assert "started 2 ranks" in text and "simulated: this horovod build is broken" in text, text[-3000:]


def test_auto_under_a_two_rank_launcher_is_horovod_with_one_chief(tmp_path):
    out = _launch([*LAUNCHERS["mpirun"], SCRIPT.format(backend="auto")], _env(tmp_path, break_horovod=False))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    lines = sorted(line for line in text.splitlines() if line.startswith("BACKEND"))
    assert lines == ["BACKEND horovod 2 False", "BACKEND horovod 2 True"], text[-3000:]


def test_horovod_world_smaller_than_the_launchers_is_refused(tmp_path):
    # What `srun -n 2` without an MPI plugin gives: Slurm says rank 0 of 2, Horovod starts alone.
    env = _env(tmp_path, break_horovod=False)
    env.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_TASKS_PER_NODE="2")
    out = _launch([sys.executable, "-c", SCRIPT.format(backend="horovod")], env)
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    assert "rank 0 of 2" in text and "1 process(es)" in text and "srun --mpi=pmix" in text, text[-3000:]
