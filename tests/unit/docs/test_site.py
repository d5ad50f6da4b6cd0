"""The documentation site builds with --strict, and its generated parts cover the code: every public name in
the API reference under the module that defines it, every RunConfig key on the configuration page; the README
stays short."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PUBLIC_MODULES = ("hvrep", "hvrep.keras", "hvrep.data", "hvrep.optimizers", "hvrep.schedules", "hvrep.elastic")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def _inventory(site: Path) -> set[str]:
    """The identifiers mkdocstrings rendered (the Sphinx inventory it writes: 4 header lines, then zlib)."""
    body = zlib.decompress((site / "objects.inv").read_bytes().split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines()}


def _canonical(module: str, name: str) -> str:
    """Where ``module.name`` is defined: a module's own name, a class's or function's module, or for a constant
    the module that assigns it (found statically), unless that module is private (``hvrep._version``)."""
    obj = getattr(importlib.import_module(module), name)
    if inspect.ismodule(obj):
        return obj.__name__
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    import griffe

    member = griffe.load(module, search_paths=[str(ROOT)], resolve_aliases=True)[name]
    path = member.target_path if member.is_alias else member.path
    return f"{module}.{name}" if any(p.startswith("_") for p in path.split(".")[:-1]) else path


def test_the_site_builds_strictly(site):
    assert (site / "index.html").is_file() and (site / "api" / "replica" / "index.html").is_file()


def test_every_public_name_is_in_the_api_reference_under_its_canonical_path(site):
    rendered = _inventory(site)
    missing = []
    for module in PUBLIC_MODULES:
        names = importlib.import_module(module).__all__
        assert names, module
        missing += [f"{module}.{n} (as {_canonical(module, n)})" for n in names
                    if _canonical(module, n) not in rendered]
    assert not missing, "not in the API reference (docs/api/*.md):\n" + "\n".join(missing)


def _keys(cfg, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out += _keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [f"{prefix}{f.name}"]
    return out


def test_every_run_config_key_is_on_the_configuration_page(site):
    from hvrep.train.config import RunConfig

    keys = _keys(RunConfig())
    assert {"train.global_batch", "data.data_dir", "comm.timeout_s", "output_dir"} <= set(keys)
    page = (site / "config" / "index.html").read_text()
    rows = set(re.findall(r"<tr>\s*<td><code>([\w.]+)</code></td>", page))
    assert sorted(set(keys) - rows) == [], "keys missing from docs/config.md's generated tables"


def test_the_readme_is_short_and_holds_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make demo" in readme and "make test" in readme
