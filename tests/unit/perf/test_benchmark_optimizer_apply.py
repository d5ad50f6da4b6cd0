"""Smoke test of benchmarks/optimizer_apply.py: it runs and writes well-formed results (no speed checks).

It runs with --shrink 64: ResNet-50's 161 variables, each 1/64 as wide, so every optimizer, mode and roofline row
is built, checked and recorded in seconds; the full-size sweep is the benchmark's own run, not CI's. That the
default is ResNet-50's own sizes is tests/unit/blocks/test_models.py's check of resnet50_variable_shapes().
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from hvrep import kernels
from hvrep.models import resnet50_variable_shapes

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "optimizer_apply.py"
PER_VARIABLE = {"LARS per-variable", "MomentumSGD per-variable"}
FUSED = {"LARS fused", "MomentumSGD fused"}
OPTIMIZERS = PER_VARIABLE | FUSED | {"keras.SGD"}
MODES = {"eager", "tf.function", "xla"}
ROOFLINES = {"copy": 8, "add": 12, "add in place": 12}  # bytes per element, STREAM's count
RESNET50_VARIABLES = 161
SHRINK = 64


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("optimizer_apply_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_one_record_per_case(tmp_path):
    # CI builds the kernels (make setup): the fused rows must be timed, on the fused op.
    assert kernels.status().path == "fused", kernels.status().describe()
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--shrink", str(SHRINK), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]

    records = [json.loads(line) for line in out.read_text().splitlines()]
    keys = [(r["optimizer"], r["mode"]) for r in records]
    assert sorted(keys) == sorted([(o, m) for o in OPTIMIZERS for m in MODES] + [(k, "numpy") for k in ROOFLINES])
    assert len({r["run_id"] for r in records}) == 1
    # Each variable's last dimension divided by SHRINK, rounded up: conv1's (7, 7, 3, 64) -> (7, 7, 3, 1).
    params = sum(math.prod(s[:-1]) * math.ceil(s[-1] / SHRINK) for _, s in resnet50_variable_shapes())
    assert 25_557_032 // SHRINK < params < 25_557_032 // SHRINK * 2, params
    for r in records:
        case = f"{r['optimizer']} / {r['mode']}"
        config = r["config"]
        assert config["num_variables"] == RESNET50_VARIABLES, case
        assert config["num_params"] == params and config["shrink"] == SHRINK, case
        assert config["bytes_per_step"] == 20 * params, case
        assert config["baseline"] == ["LARS per-variable", "tf.function"], case
        assert r["env"]["tensorflow"] and r["env"]["keras"] and "doctor" in r["env"], case
        assert r["env"]["kernels"]["status"] == kernels.status().describe(), case
        assert r["env"]["kernels"]["build_key"] == kernels.status().build["key"], case

        if r["optimizer"] in FUSED and r["mode"] == "xla":
            # Never a fallback timed under the fused name.
            assert not r["ok"] and not r["applicable"] and "not applicable" in r["error"], case
            assert r["timings_ms"] == [] and r["summary"] is None, case
            continue
        assert r["ok"] and r["applicable"] and r["error"] is None, f"{case}: {r['error']}"
        assert len(r["timings_ms"]) == config["repeats"], case
        assert len(r["warmup_ms"]) == config["warmup"], case
        assert all(t > 0 for t in r["timings_ms"]), case
        summary = r["summary"]
        assert summary["min_ms"] <= summary["p10_ms"] <= summary["median_ms"] <= summary["p90_ms"], case
        assert summary["gbps_at_median"] > 0, case

        if r["kind"] == "roofline":
            assert r["optimizer"] in ROOFLINES and r["path"] is None, case
            assert r["bytes_per_call"] == ROOFLINES[r["optimizer"]] * params, case
            continue
        assert r["kind"] == "optimizer", case
        assert r["bytes_per_call"] == 20 * params, case
        assert summary["vs_lars_per_variable_tf_function"]["of_medians"] > 0, case
        assert set(summary["fraction_of_roofline"]) == set(ROOFLINES), case
        assert all(f["of_medians"] > 0 for f in summary["fraction_of_roofline"].values()), case
        assert r["traces"] in ((None,) if r["mode"] == "eager" else (1,)), case
        # The path each row claims is the path its graph holds.
        expected = "fused" if r["optimizer"] in FUSED else "per-variable" if r["optimizer"] in PER_VARIABLE else None
        assert r["path"] == expected, case
        if r["mode"] == "eager":
            assert r["fused_ops_in_graph"] is None, case
        else:
            assert r["fused_ops_in_graph"] == (1 if r["path"] == "fused" else 0), case

    headline = records[0]["headline"]
    assert all(r["headline"] == headline for r in records)
    assert headline["ok"], headline
    for key in ("speedup_vs_per_variable_tf_function", "speedup_vs_per_variable_xla", "speedup_vs_best_per_variable"):
        assert headline[key]["of_medians"] > 0, key
    assert headline["goal"] == 2.0 and isinstance(headline["goal_met"], bool)
    assert headline["best_per_variable_mode"] in MODES
    assert headline["fused_gbps"] > 0 and set(headline["roofline_gbps"]) == set(ROOFLINES)
    # --quick's settings.
    assert {(r["config"]["warmup"], r["config"]["repeats"]) for r in records} == {(2, 5)}
    assert "fused LARS vs per-variable LARS (tf.function):" in res.stdout
    assert "of the measured copy bandwidth" in res.stdout and "median ms" in res.stdout


def test_fused_rows_are_errors_not_timings_on_the_reference_path():
    bench = _load_benchmark()
    reference = kernels.KernelStatus("reference", reason="switched off by HVREP_KERNELS=off")
    problem = bench._fused_problem(reference)
    assert problem is not None and "HVREP_KERNELS=off" in problem
    assert bench._fused_problem(kernels.KernelStatus("fused", devices=("CPU",))) is None

    shapes = [("conv1/kernel", (3, 3, 3, 4)), ("bn1/gamma", (4,)), ("fc/bias", (10,))]
    grads = [bench.tf.zeros(s) for _, s in shapes]
    roofline = bench._Roofline(64, threads=1, seed=0)
    try:
        cases = bench._build_cases(shapes, grads, 0, problem, roofline)
    finally:
        roofline.pool.shutdown()
    fused = [c for c in cases if c.optimizer in FUSED]
    assert {(c.optimizer, c.mode) for c in fused} == {(o, m) for o in FUSED for m in MODES}
    for c in fused:
        assert c.error == problem and c.call is None and c.applicable, (c.optimizer, c.mode)
    others = [c for c in cases if c.optimizer not in FUSED]
    assert others and all(c.error is None and c.call is not None for c in others)
