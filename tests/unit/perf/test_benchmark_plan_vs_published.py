"""benchmarks/plan_vs_published.py's inputs file and its band (no Keras models built: a hand-made layer list)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "plan_vs_published.py"
INPUTS = json.loads((ROOT / "benchmarks" / "plan_vs_published_inputs.json").read_text())


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_vs_published_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _ranged_inputs(node, path=""):
    """Every {"point": ...} object in the inputs file, with where it is."""
    if isinstance(node, dict):
        if "point" in node:
            yield path, node
        for key, value in node.items():
            yield from _ranged_inputs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _ranged_inputs(value, f"{path}[{i}]")


def test_every_input_names_its_source_and_every_unpublished_one_has_a_range_around_its_point():
    found = list(_ranged_inputs(INPUTS))
    assert len(found) >= 20, found
    for where, spec in found:
        assert spec.get("source"), f"{where} has no source"
        assert "published" in spec, f"{where} does not say whether it is published"
        if not spec["published"]:
            low, high = spec["range"]
            assert low <= spec["point"] <= high, f"{where}: point {spec['point']} outside {spec['range']}"
    for point in INPUTS["points"]:
        assert point["published_source"] and point["software"] and point["per_gpu_batch_source"], point["label"]
        assert point["model"] in INPUTS["models"] and point["cluster"] in INPUTS["clusters"], point["label"]


def test_the_band_holds_the_point_estimate_and_spans_the_input_ranges(bench):
    point = next(p for p in INPUTS["points"] if p["label"] == "Horovod, VGG-16, 512 GPUs")
    # forward order: 100 small costly layers, then one 400 MB cheap one; reversed, the backward order (the big
    # one first, as VGG-16's fully connected layers)
    layers = [(4e6, 1.0)] * 100 + [(400e6, 0.1)]
    r = bench.evaluate(point, INPUTS["clusters"][point["cluster"]], INPUTS["shared"], layers[::-1])
    assert r["low"] <= r["point"] <= r["high"] and r["high"] - r["low"] > 0.01, r
    assert r["corners"] == 2 ** len(r["swings"])
    assert r["no_overlap"] < r["point"]  # reducing after the backward pass can only be slower
    for low, high in r["swings"].values():  # each input alone stays inside the band
        assert r["low"] - 1e-12 <= min(low, high) and max(low, high) <= r["high"] + 1e-12
    # The collectives' contention for the GPU is an input: none (σ = 0) is the most efficient end of its range.
    # Here the link is busy past the backward pass, which a slower pass hides behind: it moves the step little.
    no_contention, most = r["swings"]["overlap_slowdown"]
    assert no_contention >= r["point"] >= most and r["contention_s"] > 0
    # 100 layers of 4 MB, the reduction hidden: the contention is what the step pays.
    hidden = bench.evaluate(point, INPUTS["clusters"][point["cluster"]], INPUTS["shared"], [(4e6, 1.0)] * 100)
    no_contention, most = hidden["swings"]["overlap_slowdown"]
    assert no_contention > hidden["point"] > most and hidden["contention_s"] > 0


def test_the_horovod_runs_fuse_at_launch_and_the_implied_bandwidth_meets_the_published_figure(bench):
    cluster = INPUTS["clusters"]["horovod_pascal_25gbe"]
    assert cluster["bucketing"]["point"] == "launch" and cluster["bucketing"]["source"]
    point = next(p for p in INPUTS["points"] if p["label"] == "Horovod, VGG-16, 128 GPUs")
    layers = ([(4e6, 1.0)] * 100 + [(400e6, 0.1)])[::-1]
    r = bench.evaluate(point, cluster, INPUTS["shared"], layers)
    implied = r["implied_inter_bandwidth_GBps"]
    at_point = {k: v[0] for k, v in bench._inputs_of(point, cluster, INPUTS["shared"]).items()}
    got = bench.efficiency(point, cluster, layers, {**at_point, "inter_bandwidth_GBps": implied})[0]
    assert got == pytest.approx(point["published_efficiency"], abs=1e-6)
    # the launch groups, fixed ahead: the 400 MB layer alone, then the 100 layers of 4 MB in groups of 16
    # (16 x 4e6 <= 64 MiB < 17 x 4e6): 1 + ceil(100 / 16) = 8 collectives
    assert r["collectives"] == 8
