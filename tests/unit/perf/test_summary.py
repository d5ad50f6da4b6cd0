"""`python -m hvrep.perf.summary RUN BASELINE...`: the efficiency against each baseline, labelled weak or strong."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvrep.perf.summary import scaling_rule, summarize


def _run(path, replicas, global_batch, epoch_rates):
    path.mkdir()
    events = [{"event": "config", "config": {"train": {"global_batch": global_batch}}, "replicas": replicas,
               "backend": "horovod" if replicas > 1 else "local", "fast_path": {}, "optimizer": "LARS"}]
    events += [{"event": "epoch", "epoch": i + 1, "images_per_sec": r} for i, r in enumerate(epoch_rates)]
    events.append({"event": "final", "stopped": "completed", "top1": 0.99, "top5": 1.0, "step": 99, "wall_sec": 9})
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_efficiency_against_a_weak_and_a_strong_baseline(tmp_path):
    # First epochs (compiling) are slow and excluded; medians: run 1,400, weak 900, strong 1,000.
    run = _run(tmp_path / "run", 2, 64, [300, 1400, 700, 1450, 1390])
    weak = _run(tmp_path / "weak", 1, 32, [200, 900, 880, 950])
    strong = _run(tmp_path / "strong", 1, 64, [250, 1000, 990, 1010])
    s = summarize(run, weak, strong)
    assert s["images_per_sec"] == 1400
    assert [(b["rule"], b["images_per_sec"]) for b in s["baselines"]] == [("weak", 900), ("strong", 1000)]
    assert s["baselines"][0]["scaling_efficiency"] == pytest.approx(1400 / 1800)
    assert s["baselines"][1]["scaling_efficiency"] == pytest.approx(0.7)
    assert s["scaling_efficiency"] == pytest.approx(1400 / 1800)  # the first baseline's, as before
    out = subprocess.run([sys.executable, "-m", "hvrep.perf.summary", str(run), str(weak), str(strong)],
                         capture_output=True, text=True, check=True).stdout
    assert "scaling efficiency 78% at 2 replicas (weak scaling, the same 32 images per replica)" in out
    assert "scaling efficiency 70% at 2 replicas (strong scaling, the same global batch of 64)" in out


@pytest.mark.parametrize(("run", "baseline", "rule"), [
    ((64, 2), (32, 1), "weak"), ((64, 2), (64, 1), "strong"), ((64, 2), (48, 1), "mixed"),
    ((512, 8), (128, 2), "weak")])
def test_the_rule_compares_per_replica_and_global_batches(run, baseline, rule):
    assert scaling_rule(run, baseline) == rule
