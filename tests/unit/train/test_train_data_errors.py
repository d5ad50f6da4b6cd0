"""A corrupt image under `hvrep train`: one message naming the file and the fix (exit 2), on 1 and 2 ranks;
with data.on_error=skip the skipped files are counted and named in the log and metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.data import write_demo

BIN = Path(sys.executable).parent
HVREP = str(BIN / "hvrep")


@pytest.fixture(scope="module")
def corrupt_folder(tmp_path_factory) -> tuple[Path, Path]:
    import dataclasses

    from hvrep.data import Segment, epoch_plan
    from hvrep.data.files import list_folder
    from hvrep.train import config as configs

    root = tmp_path_factory.mktemp("demo-data")
    write_demo(root)
    data = root / "folder"
    # The first image of the first epoch's first step on 1 and on 2 replicas (the controller's seed for epoch 0).
    cfg = configs.build("demo", [f"data.data_dir={data}", "data.format=folder"])
    plan = epoch_plan(dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000))
    files = list_folder(data, "train").files
    first = {int(plan.trained([Segment(n, 64, 1)])[0]) for n in (1, 2)}
    assert len(first) == 1, first  # one file, so that skip leaves out exactly one
    bad = Path(files[first.pop()])
    bad.write_bytes(bad.read_bytes()[:200])  # truncated: no end marker
    return data, bad


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_", "TF_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def test_a_corrupt_jpeg_is_one_message_with_the_file_and_the_fix_and_skip_names_it(corrupt_folder, tmp_path):
    data, bad = corrupt_folder
    common = ["--config", "demo", f"data.data_dir={data}", "data.format=folder", "train.max_steps=3"]
    mpirun = [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", HVREP, "train"]
    runs = {"one": [HVREP, "train", *common, f"output_dir={tmp_path / 'one'}"],
            "two": [*mpirun, *common, f"output_dir={tmp_path / 'two'}"],
            "skip": [HVREP, "train", *common, f"output_dir={tmp_path / 'skip'}", "data.on_error=skip"]}
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for k, cmd in runs.items()}
    res = {k: (p.communicate(timeout=420), p.returncode) for k, p in procs.items()}
    for key in ("one", "two"):
        (stdout, stderr), code = res[key]
        ours = [line for line in stderr.splitlines() if line.startswith("hvrep train: error:")]
        assert code == 2 if key == "one" else code != 0, (key, code, stderr[-3000:])
        assert ours and str(bad) in ours[0] and "data.on_error=skip" in ours[0] and "Fix: replace or delete" in ours[0]
        assert "Traceback" not in stderr and "on_error='skip'" not in stderr, (key, stderr[-3000:])
    assert len([line for line in res["one"][0][1].splitlines() if line.strip()]) == 1, res["one"][0][1]
    (stdout, stderr), code = res["skip"]
    assert code == 0, stderr[-3000:]
    assert f"data.on_error=skip leaves out 1 bad train image(s): {bad}" in stdout, stdout
    events = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "skipped"]
    assert [(e["split"], e["count"], e["files"]) for e in skipped] == [("train", 1, [str(bad)])], skipped
