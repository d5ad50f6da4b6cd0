"""``hvrep report``: reading runs and benchmark lines, the comparability check, the table, the plots."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from hvrep.errors import ConfigError, DataError
from hvrep.perf import costmodel, report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
H100 = "NVIDIA H100 80GB HBM3"


def _write_run(path: Path, *, replicas: int, global_batch: int, epoch_ips: list[float], model: str = "small_resnet",
               width: int = 16, breakdown: dict[str, float] | None = None) -> Path:
    """A metrics.jsonl as ``hvrep train`` writes it (config, train, epoch and final events)."""
    config = {
        "name": "demo", "output_dir": str(path),
        "model": {"name": model, "num_classes": 10, "data_format": "channels_last", "zero_init_residual": True,
                  "width": width},
        "data": {"image_size": 32, "backend": "tfdata"},
        "train": {"global_batch": global_batch, "epochs": len(epoch_ips), "precision": "fp32"},
        "comm": {"fusion_threshold_bytes": 134217728},
    }
    t = 1_795_362_921.0
    events: list[dict[str, Any]] = [{
        "event": "config", "time": t, "config": config, "replicas": replicas, "backend": "horovod",
        "fast_path": {"precision": "fp32", "jit_compile": False, "input": "tfdata"}, "optimizer": "LARS",
        "epochs": len(epoch_ips), "steps_per_epoch": 22, "resumed_from": None}]
    for epoch, ips in enumerate(epoch_ips, start=1):
        events.append({"event": "train", "time": t + epoch, "step": 22 * epoch - 2, "epoch": epoch - 1, "loss": 1.0,
                       "lr": 0.1, "images_per_sec": ips * 0.9, "train_top1": 0.5})
        events.append({"event": "epoch", "time": t + epoch, "step": 22 * epoch, "epoch": epoch, "loss": 1.0,
                       "images_per_sec": ips, "train_top1": 0.5, "top1": 0.6, "top5": 0.9})
    final = {"event": "final", "time": t + 99, "step": 22 * len(epoch_ips), "stopped": "completed",
             "epoch": len(epoch_ips), "top1": 0.6, "top5": 0.9,
             "images_per_sec": sorted(epoch_ips)[len(epoch_ips) // 2], "replicas": replicas, "wall_sec": 12.5,
             "output_dir": str(path), "checkpoint": None}
    if breakdown is not None:
        final["step_time_breakdown"] = breakdown
    events.append(final)
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _bench_line(ranks: int, ips: float, *, per_replica_batch: int = 256, cpu_count: int = 64,
                gpus: str = H100, model: str = "resnet50", ok: bool = True) -> dict[str, Any]:
    """One scaling-benchmark line in the benchmarks/ layout (config, env, raw timings, summary)."""
    step = per_replica_batch * ranks / ips
    return {
        "benchmark": "scaling", "run_id": "20261122T154047Z-cdadfb48", "ok": ok, "error": None if ok else "boom",
        "config": {"model": model, "ranks": ranks, "per_replica_batch": per_replica_batch, "image_size": 224,
                   "backend": "horovod", "repeats": 20, "warmup": 5},
        "env": {"python": "3.11.7", "platform": "Linux-6.8-x86_64-with-glibc2.36", "cpu_count": cpu_count,
                "hostname": "node01", "gpus": [gpus] * ranks},
        "timings_ms": [1e3 * step] * 20,
        "summary": {"images_per_sec": ips, "median_ms": 1e3 * step,
                    "step_time_breakdown": {"compute_s": 0.8 * step, "communication_s": 0.15 * step,
                                            "input_wait_s": 0.05 * step}},
    }


def _write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _row(report_md: str, ranks: int) -> list[str]:
    """The cells of the measured-throughput table's row for ``ranks``."""
    table = report_md.split("## Measured throughput", 1)[1].split("\n\n", 2)[1]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == str(ranks):
            return cells
    raise AssertionError(f"no row for {ranks} ranks in:\n{table}")


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 300, (path, width, height)
    assert len(data) > 10_000, (path, len(data))  # a real plot, not an empty canvas


@pytest.fixture
def strong(tmp_path: Path) -> list[Path]:
    # Median over epochs without the first: 1 rank [800, 840, 850] -> 840; 2 ranks [600, 620, 640] -> 620.
    return [_write_run(tmp_path / "demo-1rank", replicas=1, global_batch=64, epoch_ips=[300, 800, 850, 840]),
            _write_run(tmp_path / "demo", replicas=2, global_batch=64, epoch_ips=[200, 600, 640, 620])]


def test_training_runs_give_a_strong_scaling_table(strong: list[Path], tmp_path: Path):
    runs = report.load_results(strong)
    assert [(r.ranks, r.global_batch, r.per_replica_batch, r.images_per_sec) for r in runs] == [
        (1, 64, 64, 840.0), (2, 64, 32, 620.0)]
    assert runs[0].model == runs[1].model and "width=16" in runs[0].model
    assert report.check_comparable(runs).mode == "strong"

    path = report.render(runs, tmp_path / "out")
    text = path.read_text()
    speedup = 620 / 840  # 0.738
    efficiency = speedup / (2 / 1)  # 0.369
    assert _row(text, 1) == ["1", "1", "840.0", "840.0-840.0", "1.00x", "100.0%"]
    assert _row(text, 2) == ["2", "1", "620.0", "620.0-620.0", f"{speedup:.2f}x", f"{100 * efficiency:.1f}%"]
    assert _row(text, 2)[4:] == ["0.74x", "36.9%"]
    assert "strong scaling (global batch 64" in text
    for name in ("throughput.png", "efficiency.png"):
        _assert_png(tmp_path / "out" / name)
        assert f"]({name})" in text


def test_missing_breakdown_says_not_recorded(strong: list[Path], tmp_path: Path):
    out = tmp_path / "out"
    (out).mkdir()
    (out / "breakdown.png").write_bytes(b"stale")  # from an earlier report
    text = report.render(report.load_results(strong), out).read_text()
    section = text.split("## Step-time breakdown", 1)[1].split("##", 1)[0]
    assert "Not recorded" in section and "none is estimated" in section
    assert not (out / "breakdown.png").exists()
    assert "hardware: not recorded" in text


def test_breakdown_from_a_training_run_and_not_recorded_for_the_other(tmp_path: Path):
    runs = report.load_results([
        _write_run(tmp_path / "a", replicas=1, global_batch=64, epoch_ips=[300, 800, 850, 840]),
        _write_run(tmp_path / "b", replicas=2, global_batch=64, epoch_ips=[200, 600, 640, 620],
                   breakdown={"compute_s": 0.05, "communication_s": 0.04, "input_wait_s": 0.01}),
    ])
    assert runs[0].breakdown is None
    assert runs[1].breakdown == report.StepBreakdown(0.05, 0.04, 0.01)
    out = tmp_path / "out"
    section = report.render(runs, out).read_text().split("## Step-time breakdown", 1)[1].split("##", 1)[0]
    assert "| 2 | 50.00 | 40.00 | - | 10.00 | 40.0% |" in section  # 0.04 / (0.05 + 0.04 + 0.01)
    assert f"Not recorded in: {tmp_path / 'a'}." in section
    _assert_png(out / "breakdown.png")


def test_weak_scaling_is_decided_from_a_constant_per_replica_batch(tmp_path: Path):
    runs = report.load_results([
        _write_run(tmp_path / "a", replicas=1, global_batch=64, epoch_ips=[300, 800, 850, 840]),
        _write_run(tmp_path / "b", replicas=2, global_batch=128, epoch_ips=[500, 1500, 1560, 1530]),
    ])
    assert report.check_comparable(runs).mode == "weak"
    rows = report.scaling_table(runs)
    assert rows[1].speedup == pytest.approx(1530 / 840)
    assert rows[1].efficiency == pytest.approx(1530 / 840 / 2)  # 91.1%
    text = report.render(runs, tmp_path / "out").read_text()
    assert _row(text, 2)[4:] == ["1.82x", "91.1%"]
    assert "weak scaling (per-replica batch 64" in text


def test_benchmark_lines_with_breakdown_and_repeats(tmp_path: Path):
    results = _write_jsonl(tmp_path / "scaling.jsonl", [
        _bench_line(1, 2900.0), _bench_line(2, 5600.0), _bench_line(2, 5500.0),
        _bench_line(4, 1.0, ok=False),  # a failed case is skipped
    ])
    runs = report.load_results([results])
    assert [r.source for r in runs] == [f"{results}:1", f"{results}:2", f"{results}:3"]
    assert runs[0].hardware == report.Hardware("Linux-6.8-x86_64-with-glibc2.36", 64, (H100,))
    assert report.check_comparable(runs).mode == "weak"
    out = tmp_path / "out"
    text = report.render(runs, out).read_text()
    median = (5600 + 5500) / 2
    assert _row(text, 2) == ["2", "2", "5,550.0", "5,500.0-5,600.0", f"{median / 2900:.2f}x",
                             f"{100 * median / 2900 / 2:.1f}%"]
    _assert_png(out / "breakdown.png")
    section = text.split("## Step-time breakdown", 1)[1].split("##", 1)[0]
    # 1 rank: step = 256 / 2900 s = 88.28 ms; compute 80% = 70.62 ms, communication 15% = 13.24 ms.
    assert "| 1 | 70.62 | 13.24 | - | 4.41 | 15.0% |" in section
    assert "Not recorded" not in section
    assert f"Linux-6.8-x86_64-with-glibc2.36, 64 CPUs, GPUs: {H100}" in text


@pytest.mark.parametrize(("second", "field"), [
    ({"model": "resnet101"}, "model differs"),
    ({"cpu_count": 32}, "hardware cpu_count differs"),
    ({"gpus": "NVIDIA A100-SXM4-80GB"}, "hardware gpus differs"),
])
def test_mixing_models_or_machines_is_refused_naming_the_field(tmp_path: Path, second: dict[str, Any], field: str):
    a = _write_jsonl(tmp_path / "a.jsonl", [_bench_line(1, 2900.0)])
    b = _write_jsonl(tmp_path / "b.jsonl", [_bench_line(2, 5600.0, **second)])
    runs = report.load_results([a, b])
    with pytest.raises(ConfigError, match=field) as caught:
        report.check_comparable(runs)
    message = str(caught.value)
    assert f"{a}:1" in message and f"{b}:1" in message and "--allow-mixed" in message
    with pytest.raises(ConfigError, match=field):
        report.render(runs, tmp_path / "out")
    comparison = report.check_comparable(runs, allow_mixed=True)
    assert any(field in d for d in comparison.differences)
    text = report.render(runs, tmp_path / "out", allow_mixed=True).read_text()
    assert "Mixed results (`--allow-mixed`)" in text and field in text


def test_two_per_replica_batches_without_a_constant_global_batch_are_refused(tmp_path: Path):
    runs = report.load_results([
        _write_run(tmp_path / "a", replicas=1, global_batch=64, epoch_ips=[300, 800, 850, 840]),
        _write_run(tmp_path / "b", replicas=2, global_batch=256, epoch_ips=[500, 1500, 1560, 1530]),
    ])
    with pytest.raises(ConfigError, match="per_replica_batch") as caught:
        report.check_comparable(runs)
    assert "global_batch=256, per_replica_batch=128" in str(caught.value)
    assert "model" not in str(caught.value).split("not comparable")[1].split("Fix:")[0]
    assert report.check_comparable(runs, allow_mixed=True).mode == "mixed"


def test_two_models_in_training_runs_are_refused(tmp_path: Path):
    runs = report.load_results([
        _write_run(tmp_path / "a", replicas=1, global_batch=64, epoch_ips=[300, 800, 850, 840]),
        _write_run(tmp_path / "b", replicas=2, global_batch=64, epoch_ips=[200, 600, 640, 620], width=32),
    ])
    with pytest.raises(ConfigError, match=r"model differs.*width=16.*width=32"):
        report.check_comparable(runs)


def test_main_writes_the_report_and_refuses_mixed(strong: list[Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "report"
    assert report.main([str(p) for p in strong] + ["--out", str(out)]) == 0
    assert (out / "report.md").is_file()
    assert "36.9%" in capsys.readouterr().out

    other = _write_run(tmp_path / "other", replicas=2, global_batch=64, epoch_ips=[1, 2, 3], model="resnet50")
    args = [str(strong[0]), str(other), "--out", str(tmp_path / "mixed")]
    assert report.main(args) == 2
    err = capsys.readouterr().err
    assert "hvrep report: error:" in err and "model differs" in err and "--allow-mixed" in err
    assert report.main([*args, "--allow-mixed"]) == 0


def test_interconnect_adds_the_labelled_model_table(strong: list[Path], tmp_path: Path):
    out = tmp_path / "report"
    assert report.main([str(p) for p in strong] + ["--out", str(out), "--interconnect", "ndr"]) == 0
    text = (out / "report.md").read_text()
    section = text.split("## Model: predicted scaling (cost model, not a measurement)", 1)[1]
    assert "**MODEL.**" in section and "46 GB/s" in section and "35.8 ms" in section
    assert "the model's FORM" in section and "NOT checked" in section  # what the netbed validates, and not
    rows = [line for line in section.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows[:8]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    # The 256-GPU row: one fused ring over NDR, by the model's formula.
    eff = costmodel.predict_efficiency(256, costmodel.H100_RESNET50_COMPUTE_S, costmodel.RESNET50_GRAD_BYTES,
                                       costmodel.NDR_INFINIBAND, 1)
    assert f"| {100 * eff:.1f}% |" in rows[5] and "Goyal" in rows[5]
    assert "Horovod" in rows[6] and "MLPerf" in rows[0]
    assert "Not recorded" in text  # the measured part is unchanged


def test_unreadable_inputs_name_the_file(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        report.load_results([tmp_path / "nope"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match=r"without metrics\.jsonl"):
        report.load_results([tmp_path / "empty_dir"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{truncated\n")  # only a line a crash cut off: nothing to report
    with pytest.raises(DataError, match=re.escape(f"{bad} is empty")):
        report.load_results([bad])
    optimizer_line = {"benchmark": "optimizer_apply", "ok": True, "config": {"repeats": 20}, "summary": {}}
    with pytest.raises(DataError, match=r"config\.ranks"):
        report.load_results([_write_jsonl(tmp_path / "opt.jsonl", [optimizer_line])])
