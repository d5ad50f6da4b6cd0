"""Plain `horovodrun -np 2 python prog.py` (MPI, no --gloo, no --binding-args) on Open MPI 5, with the runner fix
hvrep's Horovod build applies (hvrep.compat.build_horovod.patch_runner)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.compat import build_horovod
from tests.unit.cluster.test_runner_patches import horovod_copy

_PROG = """
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
total = hvd.allreduce(tf.constant(float(hvd.rank() + 1)), op=hvd.Sum)
print(f"RANK {hvd.rank()} OF {hvd.size()} SUM {float(total):g}", flush=True)
"""


def test_the_fix_refuses_another_horovod(tmp_path):
    other = tmp_path / "other" / "runner"
    other.mkdir(parents=True)
    (other / "mpi_run.py").write_text("def _get_mpi_implementation_flags():\n    return [], [], None\n")
    (other / "gloo_run.py").write_text("")
    with pytest.raises(build_horovod.SetupError, match=r"mpi_run\.py lacks the lines hvrep's runner patch replaces"):
        build_horovod.patch_runner(other.parent)


def test_bare_horovodrun_starts_and_runs_two_ranks(tmp_path):
    build_horovod.patch_runner(horovod_copy(tmp_path))
    prog = tmp_path / "prog.py"
    prog.write_text(_PROG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    # root in CI containers; the ranks find the fixed runner first (horovodrun passes the environment on)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))
    horovodrun = [sys.executable, "-c", "import sys; from horovod.runner.launch import run_commandline; "
                  "sys.argv[0] = 'horovodrun'; sys.exit(run_commandline())"]
    res = subprocess.run([*horovodrun, "-np", "2", sys.executable, str(prog)], capture_output=True, text=True,
                         env=env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert "Executable: none" not in res.stdout + res.stderr
    lines = sorted(line.split("RANK", 1)[1] for line in res.stdout.splitlines() if "RANK" in line)
    assert lines == [" 0 OF 2 SUM 3", " 1 OF 2 SUM 3"], res.stdout[-2000:]
