"""`hvrep train` before training: answers at once (no TensorFlow import), refuses what would lose a run, and
explains what a user can fix in one line (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_", "TF_"))}
    return env


def _start(args: list[str]) -> subprocess.CompletedProcess:
    """`hvrep train ARGS` with Python's import log: stderr lists every module imported."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "hvrep.cli", "train", *args],
                          capture_output=True, text=True, env=_env(), timeout=120)


def _imported(res: subprocess.CompletedProcess) -> set[str]:
    return {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}


def _message(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stderr.splitlines() if not line.startswith("import time:")]


def _checkpointed_run(root: Path) -> Path:
    out = root / "run"
    (out / "checkpoints" / "ckpt-00000022").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"event": "config"}\n')
    return out


def test_help_and_config_errors_answer_without_importing_tensorflow(tmp_path):
    jpegs = tmp_path / "jpegs"
    (jpegs / "train" / "n01").mkdir(parents=True)
    (jpegs / "train" / "n01" / "a.JPEG").write_bytes(b"\xff\xd8\xff\xd9")
    out = _checkpointed_run(tmp_path)
    cases = {
        "help": (["--help"], 0, None),
        "typo": (["--config", "demo", "train.global_bach=1"], 2, "train has no setting 'global_bach'"),
        "warmup": (["--config", "demo", "train.epochs=1"], 2,
                   "optim.warmup_epochs=2 is longer than training (train.epochs=1)"),
        "no data_dir": ([], 2, "data.data_dir is empty. Fix: pass data.data_dir="),
        "missing data_dir": (["data.data_dir=/nonexistent/imagenet"], 2,
                             "data.data_dir=/nonexistent/imagenet is not a folder"),
        "jpeg folder": ([f"data.data_dir={jpegs}", f"output_dir={tmp_path / 'new'}"], 2, "Fix: add data.format=folder"),
        "run exists": (["--config", "demo", f"output_dir={out}"], 2,
                       f"output_dir={out} holds checkpoints of an earlier run. Fix: --resume to continue it, "
                       "--overwrite to start over"),
        "both flags": (["--config", "demo", f"output_dir={out}", "--resume", "--overwrite"], 2,
                       "--resume and --overwrite contradict each other"),
    }
    for name, (args, code, says) in cases.items():
        res = _start(args)
        assert res.returncode == code, (name, res.stdout, _message(res))
        assert "tensorflow" not in _imported(res), name
        if says is not None:
            lines = _message(res)
            assert len(lines) == 1 and lines[0].startswith("hvrep train: error: ") and says in lines[0], (name, lines)
    assert "--overwrite" in _start(["--help"]).stdout and (out / "checkpoints").is_dir()  # nothing was moved


def test_debug_shows_the_traceback():
    res = subprocess.run([sys.executable, "-m", "hvrep.cli", "train", "--debug", "--config", "demo",
                          "train.global_bach=1"], capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr


@pytest.mark.parametrize("optimizer", ["recipe"])
def test_a_recipe_too_long_for_the_run_names_the_settings(optimizer, tmp_path):
    from hvrep.errors import ConfigError
    from hvrep.train import config as configs
    from hvrep.train import optim

    cfg = configs.build("resnet50_imagenet", ["data.data_dir=/x", "train.epochs=1", "train.global_batch=1024",
                                              f"optim.optimizer={optimizer}"])
    with pytest.raises(ConfigError, match=r"train\.epochs=1 is too short for optim\.optimizer=recipe at "
                                          r"train\.global_batch=1024 .*Fix: a larger train\.epochs"):
        optim.build(cfg, 1281167)
