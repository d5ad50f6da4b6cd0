"""Ctrl-C on `hvrep train`: every rank stops at the same step, the chief saves, and the last line says how to go
on, in one process and under horovodrun --gloo and mpirun (through `hvrep launch`), with either loop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.unit.train.test_train_cli import BIN, HVREP


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_", "TF_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _events(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


_LAUNCH = {
    "python": [HVREP, "train"],
    "horovodrun-gloo": [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", HVREP, "train"],
    "mpirun": [HVREP, "launch", "--np", "2", "--launcher", "mpirun", "--allow-run-as-root", "--overcommit", "--",
               HVREP, "train"],
}


def test_ctrl_c_stops_every_rank_at_a_step_saves_and_says_how_to_continue(demo_data, tmp_path):
    runs = {(launch, loop): tmp_path / f"{launch}-{loop}" for launch, loop in
            (("python", "custom"), ("python", "fit"), ("horovodrun-gloo", "custom"), ("mpirun", "fit"))}
    procs = {key: subprocess.Popen(
        [*_LAUNCH[key[0]], "--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}", "train.epochs=50",
         "train.log_every=1", "train.steps_per_loop=1", f"train.loop={key[1]}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
        for key, out in runs.items()}
    try:
        waiting, deadline = dict(runs), time.time() + 420
        while waiting and time.time() < deadline:
            for key, out in list(waiting.items()):
                if any(e["event"] == "train" for e in _events(out)):
                    procs[key].send_signal(signal.SIGINT)  # what the terminal sends the launcher on Ctrl-C
                    del waiting[key]
                assert procs[key].poll() is None, (key, procs[key].communicate())
            time.sleep(0.5)
        assert not waiting, f"never started training: {list(waiting)}"
        results = {key: proc.communicate(timeout=240) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for key, (stdout, stderr) in results.items():
        final = _events(runs[key])[-1]
        assert final["event"] == "final" and final["stopped"] == "signal" and final["epoch"] < 50, (key, stderr[-3000:])
        assert Path(final["checkpoint"]).name == f"ckpt-{final['step']:08d}", key
        # horovodrun prefixes each rank's lines with "[rank]<stdout>:"
        ours = [re.sub(r"^\[\d+\]<stdout>:", "", line) for line in stdout.splitlines() if "hvrep train:" in line]
        assert ours and re.search(rf"stopped at step {final['step']} \(saved .*\); continue with `--resume`$",
                                  ours[-1]), (key, stdout[-2000:], stderr[-2000:])
        assert stdout.count("continue with `--resume`") == 1, key  # the chief says it
        if key[0] == "horovodrun-gloo":
            # 1 when horovodrun terminated its ranks' shells before they exited, which races with their exit
            # (docs/training-app.md, "Stopping a run with Ctrl-C"); either way the run was saved (checked above)
            assert procs[key].returncode in (0, 1), (key, stderr[-2000:])
        else:
            assert procs[key].returncode == 0 and "Traceback" not in stderr, (key, stderr[-3000:])


def test_resuming_at_an_epochs_end_prints_no_empty_epoch_and_overwrite_moves_the_run_aside(demo_data, tmp_path):
    out = tmp_path / "run"
    common = [HVREP, "train", "--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}"]
    res = subprocess.run([*common, "train.max_steps=22"], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]  # the demo's epoch is 22 steps: stopped after its last one
    res = subprocess.run([*common, "train.max_steps=23", "--resume"], capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "epoch 1/15  trained before the resume  val top-1" in res.stdout, res.stdout
    assert " 0 images/s" not in res.stdout and "loss 0.0000" not in res.stdout
    assert res.stderr.strip() == "", res.stderr  # quiet: TensorFlow's start-up notices are gone
    epoch = [e for e in _events(out) if e["event"] == "epoch"][-1]
    assert epoch["epoch"] == 1 and "loss" not in epoch and "top1" in epoch

    res = subprocess.run([*common, "train.max_steps=1", "--overwrite"], capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (old,) = tmp_path.glob("run.old-*")
    assert "--overwrite: the earlier run in this output_dir was moved to" in res.stdout
    assert [e["event"] for e in _events(out)].count("config") == 1 and _events(out)[-1]["step"] == 1
    assert (old / "checkpoints" / "ckpt-00000023").is_dir() and [e["event"] for e in _events(old)].count("config") == 2
