"""Fixtures the training app's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvrep.data import write_demo


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """The shipped digits written as TFRecord shards, once per test module: the folder for ``data.data_dir``."""
    root = tmp_path_factory.mktemp("demo-data")
    write_demo(root)
    return root / "tfrecord"
