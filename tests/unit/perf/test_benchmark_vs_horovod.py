"""benchmarks/vs_horovod.py: hvrep vs plain Horovod on legacy Keras, launched alternately (speeds not judged)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hvrep
from hvrep.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "vs_horovod.py"


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("vs_horovod_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # Exported Horovod knobs must not reach either contender: both run at Horovod's stock settings.
    env["HOROVOD_FUSION_THRESHOLD"] = "1234"
    env["HOROVOD_CYCLE_TIME"] = "7"
    return env


def test_rounds_rotate_the_order():
    bench = _load_benchmark()
    assert bench.round_orders(["horovod", "hvrep:a", "hvrep:b"], 4) == [
        ["horovod", "hvrep:a", "hvrep:b"], ["hvrep:a", "hvrep:b", "horovod"],
        ["hvrep:b", "horovod", "hvrep:a"], ["horovod", "hvrep:a", "hvrep:b"]]


def test_hvrep_contenders_parse_into_comm_configs():
    bench = _load_benchmark()
    assert bench.parse_hvrep("default=") == bench.Contender("hvrep:default", "hvrep", {})
    c = bench.parse_hvrep("fuse4m=fusion_threshold_bytes=4194304,compression=fp16,horovod_fusion_threshold_bytes=none")
    assert c.comm_config == {"fusion_threshold_bytes": 4194304, "compression": "fp16",
                             "horovod_fusion_threshold_bytes": None}
    assert bench.parse_hvrep("nocheck=check_first_step=false").comm_config == {"check_first_step": False}
    fused = bench.parse_hvrep("f=bn=fused,fusion_threshold_bytes=0")
    assert (fused.batch_norm, fused.comm_config) == ("fused", {"fusion_threshold_bytes": 0})
    with pytest.raises(ConfigError, match=r"bn='cudnn'.*Fix: bn=fused"):
        bench.parse_hvrep("x=bn=cudnn")
    plain = bench.parse_hvrep("k=batch_norm=keras")
    assert (plain.batch_norm, plain.replicator_batch_norm, plain.comm_config) == ("keras", "keras", {})
    assert bench.parse_hvrep("default=").replicator_batch_norm == "fused"  # the Replicator's default
    with pytest.raises(ConfigError, match=r"batch_norm='none'.*Fix: batch_norm=fused"):
        bench.parse_hvrep("x=batch_norm=none")
    with pytest.raises(ConfigError, match="NAME=k=v"):
        bench.parse_hvrep("fusion_threshold_bytes")
    with pytest.raises(ConfigError, match="CommConfig field"):
        bench.parse_hvrep("x=bucket=1")
    with pytest.raises(ConfigError, match="fusion_threshold_bytes must be"):
        bench.parse_hvrep("x=fusion_threshold_bytes=-1")


def test_launches_strip_horovod_knobs_and_cap_threads():
    bench = _load_benchmark()
    base = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "5", "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_MCA_mpi_yield_when_idle": "1", "TF_USE_LEGACY_KERAS": "1", "PATH": "/bin"}
    horovod = bench.launch_env(bench.Contender("horovod", "horovod"), base, 1)
    mine = bench.launch_env(bench.Contender("hvrep:default", "hvrep", {}), base, 1)
    for env in (horovod, mine):
        assert not any(k.startswith(("HOROVOD_", "OMPI_")) for k in env)
        assert env["TF_NUM_INTRAOP_THREADS"] == env["TF_NUM_INTEROP_THREADS"] == "1"
    assert horovod["TF_USE_LEGACY_KERAS"] == "1" and "TF_USE_LEGACY_KERAS" not in mine


def test_horovodrun_launches_use_gloo_and_put_legacy_keras_on_the_ranks_command():
    # horovodrun imports Horovod's TensorFlow module in this venv (no tf_keras): the switch must not reach it.
    bench = _load_benchmark()
    args = bench._parse_args(["--launcher", "horovodrun", "--model", "small"])
    horovod = bench.Contender("horovod", "horovod")
    env = bench.launch_env(horovod, {"PATH": "/bin", "TF_USE_LEGACY_KERAS": "1"}, 1, "horovodrun")
    assert "TF_USE_LEGACY_KERAS" not in env
    argv = bench.launch_argv(horovod, "/legacy/python", args, env)
    assert argv[:6] == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"], argv
    assert argv[6:9] == ["env", "TF_USE_LEGACY_KERAS=1", "/legacy/python"], argv
    assert argv[-2:] == ["--ranks-via", "horovod"], argv
    mine = bench.launch_argv(bench.Contender("hvrep:default", "hvrep", {}), "/venv/python", args, env)
    assert mine[6] == "/venv/python" and "TF_USE_LEGACY_KERAS=1" not in mine
    mpirun = bench.launch_argv(horovod, "/legacy/python", bench._parse_args(["--model", "small"]), env)
    assert mpirun[0] == "mpirun" and "--ranks-via" not in mpirun, mpirun
    # horovodrun prefixes every line of a rank's output
    assert bench._RESULT_LINE.match("[0]<stdout>:VS_HOROVOD_RESULT {}")
    assert bench._RESULT_LINE.match("VS_HOROVOD_RESULT {}") and not bench._RESULT_LINE.match("x VS_HOROVOD_RESULT")


@pytest.mark.multirank
def test_quick_run_launches_both_contenders_alternately(tmp_path):
    out = tmp_path / "vs.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--model", "small", "--rounds", "1", "--warmup", "1", "--steps", "2",
           "--hvrep", "default=", "--horovod-keras3", "--timeout", "300", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({r["run_id"] for r in records}) == 1
    launches = [r for r in records if r["record"] == "launch"]
    assert [(r["round"], r["position"], r["contender"]) for r in launches] == [
        (0, 0, "horovod"), (0, 1, "horovod-keras3"), (0, 2, "hvrep:default")]
    assert launches[0]["config"]["orders"] == [["horovod", "horovod-keras3", "hvrep:default"]]
    for r in launches:
        assert r["ok"] and r["error"] is None, r["error"]
        # (The best step's rate need not exceed the whole loop's: the ranks' fastest steps need not coincide.)
        assert r["images_per_sec"] > 0 and r["best_step_images_per_sec"] > 0
        result = r["result"]
        assert result["num_ranks"] == 2 and len(result["per_rank"]) == 2
        assert all(len(p["step_s"]) == 2 and len(p["warmup_s"]) == 1 for p in result["per_rank"])
        variables = result["worker_env"]["variables"]
        assert not any(k.startswith("HOROVOD_") for k in variables), variables
        assert variables["TF_NUM_INTRAOP_THREADS"] == variables["TF_NUM_INTEROP_THREADS"] == "1"
    horovod, keras3, mine = (r["result"] for r in launches)
    assert horovod["framework"]["keras"].startswith("tf_keras ")
    assert horovod["worker_env"]["variables"]["TF_USE_LEGACY_KERAS"] == "1"
    assert "legacy-keras-venv" in horovod["worker_env"]["python"]
    assert mine["framework"]["keras"].startswith("keras 3") and mine["framework"]["backend"] == "horovod"
    assert mine["comm_config"] == dataclasses.asdict(hvrep.CommConfig())
    # hvrep asked Open MPI to yield a waiting rank's core; plain Horovod runs with Open MPI's stock busy polling.
    assert mine["worker_env"]["variables"]["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert "OMPI_MCA_mpi_yield_when_idle" not in horovod["worker_env"]["variables"]
    # The keras.applications-style model as built; inside run its 3 BatchNormalization layers train with the
    # fused kernel (Replicator's default), on the horovod backend.
    assert (mine["batch_norm"], mine["replicator_batch_norm"]) == ("keras", "fused")
    assert mine["traced_batch_norm_ops"] == {"FusedBatchNormV3": 3, "SquaredDifference": 0}
    # Horovod's own step on Keras 3, from this venv:
    assert keras3["framework"]["keras"].startswith("keras 3") and "hvrep" not in keras3["framework"]
    assert "TF_USE_LEGACY_KERAS" not in keras3["worker_env"]["variables"]
    assert "legacy-keras-venv" not in keras3["worker_env"]["python"]
    # one hvd.allreduce per trainable variable of the small CNN
    assert horovod["collectives_per_step"] == keras3["collectives_per_step"] == 11

    summaries = {r["contender"]: r for r in records if r["record"] == "summary"}
    assert set(summaries) == {"horovod", "horovod-keras3", "hvrep:default"}
    assert summaries["horovod"]["vs_horovod"] is None
    vs = summaries["hvrep:default"]["vs_horovod"]
    expected = launches[2]["images_per_sec"] / launches[0]["images_per_sec"]
    assert vs["per_round"] == [pytest.approx(expected)]
    assert vs["of_medians"] == pytest.approx(expected)
    assert vs["min"] == vs["max"] == pytest.approx(expected)
    for s in summaries.values():
        assert s["rounds_ok"] == 1 and s["images_per_sec"]["median"] > 0 and s["errors"] == []
        assert s["best_step_images_per_sec"] > 0  # not >= the loop rate: see the launch check above
    assert "hvrep:default" in res.stdout and "vs horovod" in res.stdout


@pytest.mark.multirank
def test_quick_run_under_horovodrun_gloo(tmp_path):
    out = tmp_path / "vs.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--model", "small", "--rounds", "1", "--warmup", "1", "--steps", "2",
           "--launcher", "horovodrun", "--timeout", "300", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    launches = [r for r in map(json.loads, out.read_text().splitlines()) if r["record"] == "launch"]
    assert [r["contender"] for r in launches] == ["horovod", "hvrep:default"]
    for r in launches:
        assert r["ok"] and r["config"]["launcher"] == "horovodrun" and "--gloo" in r["argv"], r["error"]
        result = r["result"]
        assert result["num_ranks"] == 2 and len(result["per_rank"]) == 2
        assert sorted(p["rank"] for p in result["per_rank"]) == [0, 1]
    horovod, mine = (r["result"] for r in launches)
    assert horovod["framework"]["keras"].startswith("tf_keras ")
    assert horovod["framework"]["horovod_controller"] == "gloo"
    assert mine["framework"]["backend"] == "horovod"
    assert "(horovodrun --gloo)" in res.stdout
