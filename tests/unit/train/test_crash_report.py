"""A rank killed by a signal inside a training step is reported: which rank, which signal, which step and shapes.

The step kills its own process with SIGSEGV (segv_in_step.py: `hvrep train` with a step that does so at
step 3), as a native crash in TensorFlow would (issue 48). Before hvrep.train.crash the shell said only
"Segmentation fault" (1 process) and mpirun "exited on signal 11".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.multirank import harness

HERE = Path(__file__).resolve().parent


def _env() -> dict[str, str]:
    env = harness.clean_env()
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _args(demo_data: Path, out: Path) -> list[str]:
    return ["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}", "train.global_batch=14",
            "train.steps_per_loop=1", "train.max_steps=6"]


def _report(rank: int, pid: str, per_rank_batch: int) -> str:
    return (rf"hvrep train: rank {rank} \(pid {pid}\) died of SIGSEGV \(Segmentation fault\) in train step 3: "
            rf"x float32\[{per_rank_batch}, 32, 32, 3\], y int32\[{per_rank_batch}\]\. Its Python stacks at the "
            r"crash are in (\S+)\. ")


def test_one_process_that_dies_of_sigsegv_in_a_step_names_the_signal_step_and_shapes(demo_data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(HERE / "segv_in_step.py"), "0", "3", *_args(demo_data, out)],
                          capture_output=True, text=True, env=_env(), timeout=300, cwd=harness.ROOT)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-3000:]
    found = re.search(_report(0, r"\d+", 14), proc.stderr)
    assert found, proc.stderr[-3000:]
    stacks = Path(found.group(1).rstrip("."))
    assert stacks == out / "crash" / "rank0.txt"
    text = stacks.read_text()
    assert "Fatal Python error: Segmentation fault" in text and "segv_in_step.py" in text, text[:2000]


def test_a_clean_run_leaves_no_crash_files_and_no_report(demo_data, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(HERE / "segv_in_step.py"), "0", "1000", *_args(demo_data, out)],
                          capture_output=True, text=True, env=_env(), timeout=300, cwd=harness.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "died of" not in proc.stderr
    assert not (out / "crash").exists(), list((out / "crash").iterdir())


def test_a_rank_of_two_that_dies_of_sigsegv_is_named_under_mpirun_and_horovodrun(demo_data, tmp_path):
    procs = {}
    for launcher in harness.LAUNCHERS:
        out = tmp_path / launcher
        cmd = harness.two_ranks(launcher, [str(HERE / "segv_in_step.py"), "1", "3", *_args(demo_data, out)])
        procs[launcher] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                           env=_env(), cwd=harness.ROOT, start_new_session=True)
    for launcher, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode != 0, f"{launcher}:\n{output[-3000:]}"
        found = re.search(_report(1, r"\d+", 7), output)
        assert found, f"{launcher}:\n{output[-4000:]}"
        assert Path(found.group(1).rstrip(".")) == tmp_path / launcher / "crash" / "rank1.txt"
        assert "hvrep train: rank 0 (pid" not in output, output[-3000:]  # rank 0 was ended, not crashed
