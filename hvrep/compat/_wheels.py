"""Shared by the two builders: the wheel cache and the environment's markers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hvrep.compat import shim_path


def marker(name: str) -> Path:
    """A file in this environment that records the cache key of what it holds."""
    return shim_path().parent / f"{name}.key"


def is_current(name: str, key: str) -> bool:
    m = marker(name)
    return m.is_file() and m.read_text().strip() == key


def mark(name: str, key: str) -> None:
    m = marker(name)
    m.parent.mkdir(parents=True, exist_ok=True)
    m.write_text(key + "\n")


def cached_wheel(dest: Path, pattern: str) -> Path | None:
    found = sorted(dest.glob(pattern)) if dest.is_dir() else []
    return found[0] if found else None


def publish(wheel: Path, dest: Path) -> Path:
    """Copies a freshly built wheel into the cache folder ``dest`` atomically.

    A half-copied wheel must never look cached (a build killed mid-copy, a
    full disk), so the folder is filled under another name and renamed.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    shutil.copy2(wheel, staging / wheel.name)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)
    return dest / wheel.name


def install(wheel: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
         "--no-cache-dir", str(wheel)],
        check=True,
    )
