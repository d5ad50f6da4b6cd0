"""`hvrep train train.loop=fit`: the demo run trained by Keras' model.fit through hvrep.keras (the real CLI), and
its checkpoints, which either loop resumes."""

from __future__ import annotations

import concurrent.futures
import subprocess
from pathlib import Path

import pytest
import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train.checkpoint import read_metadata
from tests.unit.train.test_mlperf_log import check_one_attempt
from tests.unit.train.test_train_cli import BIN, HVREP, _command, _env, _events


def test_loop_is_validated_and_custom_stays_the_default():
    assert configs.build("demo").train.loop == "custom"
    assert configs.build("demo", ["train.loop=fit"]).train.loop == "fit"
    with pytest.raises(ConfigError, match=r"train\.loop must be one of \('custom', 'fit'\), got 'keras'"):
        configs.build("demo", ["train.loop=keras"])


def _launch(launcher: str, args: list[str]) -> list[str]:
    """``hvrep train ARGS`` on 2 ranks, as users launch it."""
    if launcher == "mpirun":
        return _command(args, 2)
    return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", HVREP, "train", *args]


def _run(launcher: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_launch(launcher, args), capture_output=True, text=True, env=_env(), timeout=300)


def _iterations(checkpoint: Path) -> int:
    return int(tf.train.load_checkpoint(str(checkpoint / "ckpt")).get_tensor(
        "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))


def _fit_then_custom_then_fit(launcher: str, data: Path, out: Path) -> None:
    """fit stops mid-epoch at step 6; the custom loop resumes it to 9; fit resumes that to 12. Raises on a fault.

    Each attempt also writes its MLPerf log (train.mllog), from rank 0 only: a new file per attempt."""
    common = ["--config", "demo", f"data.data_dir={data}", f"output_dir={out}", "train.steps_per_loop=2",
              "train.log_every=2", f"train.mllog={out}/mllog/result.txt"]
    res = _run(launcher, [*common, "train.loop=fit", "train.max_steps=6"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "with model.fit" in res.stdout
    events = _events(out)
    config = next(e for e in events if e["event"] == "config")
    assert config["fast_path"]["loop"] == "fit" and config["replicas"] == 2
    assert [e["step"] for e in events if e["event"] == "train"] == [2, 4, 6]  # as the custom loop logs
    assert all(e["lr"] > 0 and e["loss"] > 0 for e in events if e["event"] == "train")
    final = events[-1]
    assert final["event"] == "final" and final["stopped"] == "max_steps" and final["step"] == 6, final
    checkpoint = Path(final["checkpoint"])
    meta = read_metadata(checkpoint)
    # The custom loop's layout: the optimizer saved as itself (not nested in the DistributedOptimizer).
    assert {k: meta[k] for k in ("format", "loop", "epoch", "position", "segments", "global_batch")} == {
        "format": 2, "loop": "fit", "epoch": 0, "position": 6, "segments": [[2, 64, 6]], "global_batch": 64}, meta
    assert _iterations(checkpoint) == 6

    res = _run(launcher, [*common, "train.loop=custom", "train.max_steps=9", "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    resumed = [e for e in events if e["event"] == "config"][-1]
    assert resumed["resumed_from"] == str(checkpoint)
    later = events[events.index(resumed):]
    change = next(e for e in later if e["event"] == "schedule")
    assert change["lr"][0] == pytest.approx(change["lr"][1]) and change["global_batch"] == [64, 64], change
    assert [e["step"] for e in later if e["event"] == "train"] == [8]  # every train.log_every=2
    checkpoint = Path(later[-1]["checkpoint"])
    meta = read_metadata(checkpoint)
    assert meta["loop"] == "custom" and meta["segments"] == [[2, 64, 9]], meta
    assert _iterations(checkpoint) == 9  # the optimizer's state went on from fit's

    res = _run(launcher, [*common, "train.loop=fit", "train.max_steps=12", "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    resumed = [e for e in events if e["event"] == "config"][-1]
    assert resumed["resumed_from"] == str(checkpoint) and resumed["fast_path"]["loop"] == "fit"
    later = events[events.index(resumed):]
    # Executions of 2 steps from step 9: each logs at its end, once it has passed a multiple of log_every; the
    # last one is cut to max_steps (12), not run whole.
    assert [e["step"] for e in later if e["event"] == "train"] == [11, 12]
    checkpoint = Path(later[-1]["checkpoint"])
    assert read_metadata(checkpoint)["segments"] == [[2, 64, 12]]
    assert _iterations(checkpoint) == 12

    # One log per attempt (the rules allow one run_start), each written once: a second writer would repeat its
    # lines or leave another file. Every attempt stopped at train.max_steps, in the first epoch.
    logs = out / "mllog"
    assert sorted(p.name for p in logs.iterdir()) == ["result.2.txt", "result.3.txt", "result.txt"]
    for name in ("result.txt", "result.2.txt", "result.3.txt"):
        records = check_one_attempt(logs / name, "aborted")
        assert [r["metadata"]["epoch_num"] for r in records if r["key"] == "epoch_start"] == [1], name
        assert next(r["value"] for r in records if r["key"] == "submission_platform") in ("2xCPU", "2xGPU")


def test_fit_and_custom_loop_checkpoints_resume_in_each_other_under_mpirun_and_horovodrun(demo_data, tmp_path):
    # The two launchers' sequences side by side (much of each run is TensorFlow's start-up).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {launcher: pool.submit(_fit_then_custom_then_fit, launcher, demo_data, tmp_path / launcher)
                   for launcher in ("mpirun", "horovodrun")}
        for launcher, future in futures.items():
            try:
                future.result()
            except AssertionError as e:
                raise AssertionError(f"under {launcher}: {e}") from e
