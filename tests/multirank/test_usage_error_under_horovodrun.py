"""A user's own `horovodrun --gloo -np 2 hvrep train …` (static, and elastic with a host discovery script) with a
setting hvrep refuses: hvrep's one-line error is the last line of the output and the exit code is 2 (issue 47,
item 5), through hvrep's patch of Horovod's runner (hvrep.compat.build_horovod.GLOO_USAGE_EXIT_PATCH).

Without it horovodrun printed "Process N exit with status code 2." and a 20-line RuntimeError traceback after
hvrep's line ("failure count == 2 -> stop running" first, elastic), and exited 1. horovodrun runs from a copy of
the installed package with hvrep's runner patches applied (tests/unit/cluster/test_runner_patches.py), as
`make setup` applies them to the environment's own."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.compat import build_horovod
from tests.multirank import elastic_checks, harness
from tests.unit.cluster.test_runner_patches import horovod_copy

pytestmark = pytest.mark.multirank

LIMIT_S = 240


def _launch(tmp: Path, elastic: bool, settings: list[str]) -> tuple[int | None, str]:
    site = tmp / "site"
    site.mkdir()
    build_horovod.patch_runner(horovod_copy(site))
    horovodrun = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", "2"]
    if elastic:
        hosts = tmp / "hosts"
        hosts.write_text("localhost:1\n127.0.0.1:1\n")
        horovodrun += ["--min-np", "2", "--max-np", "4", "--host-discovery-script",
                       str(elastic_checks.discovery_script(tmp, hosts)), "--network-interface", "lo"]
    env = harness.clean_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(site)])  # hvrep's checkout first, then the copy
    cmd = [*horovodrun, str(Path(sys.executable).parent / "hvrep"), "train", "--config", "demo", *settings,
           f"output_dir={tmp / 'run'}"]
    return _run_to_the_end_of_output(cmd, env)


def _run_to_the_end_of_output(cmd: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    """What a terminal shows: the output up to the moment the last process holding it (multiprocessing's
    resource tracker outlives horovodrun) lets it go, not only up to horovodrun's exit. A process group of its own,
    killed on the way out."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=harness.ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("elastic", "settings", "says"), [
    (False, ["train.global_batch=63"], "hvrep train: error: train.global_batch=63 must divide by the 2 replicas."),
    (True, ["elastic.min_np=2", "elastic.max_np=4", "train.global_batch=66"],
     "hvrep train: error: train.global_batch=66 does not divide by world size(s) [4] of elastic.min_np=2"),
], ids=["static", "elastic"])
def test_hvreps_error_is_the_last_line_and_the_exit_is_2(tmp_path, elastic, settings, says):
    rc, out = _launch(tmp_path, elastic, settings)
    assert rc is not None, f"still running after {LIMIT_S} s:\n{out[-4000:]}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert "Traceback" not in out and "RuntimeError" not in out and "leaked" not in out, out[-4000:]
    assert says in lines[-1] and lines[-1].split(">:", 1)[0] in ("[0]<stderr", "[1]<stderr"), out[-4000:]
    assert rc == 2, out[-4000:]
