"""Builds (once) and installs the DALI TensorFlow plugin for this TensorFlow.

The plugin compiles against the installed TensorFlow when pip builds it, and
pip's own wheel cache would hand a plugin built for another TensorFlow to a
later install, which then fails with an undefined symbol. So it is built with
``--no-cache-dir`` and kept in hvrep's cache under a key naming the DALI,
TensorFlow and Python versions it was built for.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
import tempfile
from pathlib import Path

from hvrep import _env
from hvrep.compat import _wheels
from hvrep.compat.build_horovod import _tf_distribution
from hvrep.errors import SetupError

DALI_VERSION = "2.4.0"
PLUGIN = "nvidia-dali-tf-plugin-cuda120"


def _log(msg: str) -> None:
    print(f"[build_dali_plugin] {msg}", flush=True)


def plugin_key() -> str:
    _, tf_version = _tf_distribution()
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return f"dali{DALI_VERSION}-tf{tf_version}-{py}"


def ensure_plugin(cache_dir: Path | None = None) -> str:
    key = plugin_key()
    try:
        installed = md.version(PLUGIN)
    except md.PackageNotFoundError:
        installed = None
    if installed == DALI_VERSION and _wheels.is_current("dali-tf-plugin", key):
        _log(f"up to date: {key}")
        return key
    dest = (cache_dir or _env.cache_dir()) / "dali-tf-plugin" / key
    wheel = _wheels.cached_wheel(dest, "*.whl")
    if wheel is None:
        _log(f"building {PLUGIN}=={DALI_VERSION} against TensorFlow ({key}); about 1 min")
        with tempfile.TemporaryDirectory(prefix="hvrep-dali-") as tmp:
            res = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                 "--no-cache-dir", f"{PLUGIN}=={DALI_VERSION}", "-w", tmp],
            )
            built = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or len(built) != 1:
                raise SetupError(
                    f"building {PLUGIN}=={DALI_VERSION} failed (exit {res.returncode}). It needs "
                    f"nvidia-dali-cuda120=={DALI_VERSION} and TensorFlow installed first, and a C++ "
                    "compiler. Fix: run `make setup`."
                )
            wheel = _wheels.publish(built[0], dest)
    else:
        _log(f"installing the cached wheel {wheel}")
    _wheels.install(wheel)
    _wheels.mark("dali-tf-plugin", key)
    return key


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        ensure_plugin(args.cache_dir)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
