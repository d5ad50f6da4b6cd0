"""hvrep's patches to the installed Horovod's Python runner (hvrep.compat.build_horovod.RUNNER_PATCHES): each
an exact replacement, applied once to Horovod 0.28.1's files, refused (and nothing written) on other text.

``horovod_copy`` is the view of the installed package the launch tests run horovodrun from, so no test writes
to the environment's own Horovod."""

from __future__ import annotations

import importlib.metadata as md
import shutil
from pathlib import Path

import pytest

from hvrep.compat import build_horovod
from hvrep.errors import SetupError

_FILES = sorted({patch.file for patch in build_horovod.RUNNER_PATCHES})


def horovod_copy(root: Path, pristine: bool = False) -> Path:
    """``root/horovod``: links to the installed horovod package, except the files the runner patches touch, which
    are copies (``pristine``: with any patch the environment already holds taken back out, i.e. Horovod 0.28.1's
    text). Put ``root`` first on PYTHONPATH and horovodrun runs from it."""
    installed = Path(md.distribution("horovod").locate_file("horovod"))
    view = root / "horovod"

    def mirror(src: Path, dst: Path) -> None:
        dst.mkdir()
        for entry in src.iterdir():
            rel = str(entry.relative_to(installed))
            if entry.is_dir() and any(f.startswith(rel + "/") for f in _FILES):
                mirror(entry, dst / entry.name)
            elif rel in _FILES:
                shutil.copy(entry, dst / entry.name)
            else:
                (dst / entry.name).symlink_to(entry)

    mirror(installed, view)
    if pristine:
        for patch in build_horovod.RUNNER_PATCHES:
            path = view / patch.file
            path.write_text(path.read_text().replace(patch.new, patch.old))
    return view


def test_every_patch_applies_to_horovods_own_runner_once(tmp_path):
    view = horovod_copy(tmp_path, pristine=True)
    for patch in build_horovod.RUNNER_PATCHES:
        assert patch.old in (view / patch.file).read_text()
    assert build_horovod.patch_runner(view) is True
    assert build_horovod.patch_runner(view) is False
    for patch in build_horovod.RUNNER_PATCHES:
        text = (view / patch.file).read_text()
        in_file = sum(other.file == patch.file for other in build_horovod.RUNNER_PATCHES)
        assert patch.new in text and text.count("# hvrep:") == in_file, patch.file  # each once
    # The patched runner still imports: the replacements are valid Python where they land.
    for name in _FILES:
        compile((view / name).read_text(), name, "exec")


def test_a_changed_runner_is_refused_and_left_as_it_was(tmp_path):
    view = horovod_copy(tmp_path, pristine=True)
    gloo = view / "runner" / "gloo_run.py"
    changed = gloo.read_text().replace("print('Process {idx} exit with status code", "print('Worker {idx} exit")
    gloo.write_text(changed)
    before = {name: (view / name).read_text() for name in _FILES}
    with pytest.raises(SetupError, match=r"gloo_run\.py lacks the lines hvrep's runner patch replaces \(a worker's "
                                         r"usage error .*Fix: install Horovod 0\.28\.1"):
        build_horovod.patch_runner(view)
    assert {name: (view / name).read_text() for name in _FILES} == before  # mpi_run.py not patched either


def test_the_environment_marker_names_the_patch_list():
    assert build_horovod.installed_key(build_horovod.make_plan("off")).endswith("-" + build_horovod.RUNNER_PATCH_ID)
    assert build_horovod.RUNNER_PATCH_ID != "runner1"  # runner1 was the binding patch alone
