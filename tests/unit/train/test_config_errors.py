"""`hvrep train` with a config file or data folder to fix: one line naming what and where, exit 2, no traceback
(the real CLI, as users run it; each answers before TensorFlow starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.data import write_demo

HVREP = str(Path(sys.executable).parent / "hvrep")


def _train(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([HVREP, "train", *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env})


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hvrep train: error: "), res.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(("text", "where"), [
    ('{"preset": "demo", train.epochs: 5}', "line 1, column 20"),
    ('{"preset": "demo",\n "train.epochs": 5,\n}\n', "line 3, column 1"),
], ids=["unquoted-key", "trailing-comma"])
def test_a_json_syntax_error_names_the_file_line_and_column(tmp_path, text, where):
    (tmp_path / "run.json").write_text(text)
    line = _one_error_line(_train(["--config", "run.json"], tmp_path))
    assert f"--config run.json: {where}: " in line and "Fix: " in line, line


@pytest.mark.parametrize("text", ['[{"preset": "demo"}]', '"demo"', "5"])
def test_a_json_file_that_is_not_an_object_is_one_line(tmp_path, text):
    (tmp_path / "run.json").write_text(text)
    line = _one_error_line(_train(["--config", "run.json"], tmp_path))
    assert "--config run.json holds a JSON " in line and "not an object of settings" in line, line


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> Path:
    """The demo's JPEG folder (train/<class>/*.jpg, val/<class>/*.jpg), in a cache folder of its own."""
    cache = tmp_path_factory.mktemp("cache")
    write_demo(cache / "demo-data")
    return cache


def test_jpeg_folders_read_as_tfrecords_suggest_data_format_folder(jpegs, tmp_path):
    folder = jpegs / "demo-data" / "folder"
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in sorted(f for f in (folder / "train").glob("*/*") if f.suffix.lower() in (".jpg", ".jpeg"))[:3]:
        (flat / f.name).write_bytes(f.read_bytes())
    # The demo's own folder (hvrep data demo's layout, under hvrep's cache), a split folder, a flat folder.
    cases = {folder: f"data.data_dir={folder} holds JPEG folders",
             folder / "train": f"Fix: data.data_dir={folder} data.format=folder",
             flat: "Fix: data.format=folder"}
    for data_dir, expected in cases.items():
        line = _one_error_line(_train(["--config", "demo", f"data.data_dir={data_dir}", "data.format=tfrecord",
                                       f"output_dir={tmp_path / 'run'}"], tmp_path, HVREP_CACHE_DIR=str(jpegs)))
        assert expected in line and "data.format=folder" in line and "data prepare SRC" not in line, line
