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


def _cells(html: str) -> list[list[str]]:
    """Each table row's cells as text (tags and entities stripped)."""
    import html as entities

    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", html, flags=re.S):
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, flags=re.S)
        rows.append([entities.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells])
    return rows


def test_the_combinations_page_says_what_the_support_table_says(site):
    from hvrep.replica import support

    page = (site / "combinations" / "index.html").read_text()
    rows = _cells(page)
    axes = {r[0]: r[1] for r in rows if len(r) == 3 and r[0] in support.AXES}
    assert axes == {a: ", ".join(v) for a, v in support.AXES.items()}, axes
    refused = [r[0] for r in rows if len(r) == 4 and r[1] in ("everywhere", "hvrep train only")]
    assert refused == [" + ".join(f"{a} = {' or '.join(v)}" for a, v in rule.when) for rule in support.RULES]
    for rule in support.RULES:
        assert any(rule.reason in " ".join(r) for r in rows), rule.reason
    axis_names = list(support.AXES)
    trained = [dict(zip(axis_names, r[1:-1], strict=True)) for r in rows
               if len(r) == len(axis_names) + 2 and r[0].isdigit()]
    assert trained == support.tested_cases()
    index = (site / "index.html").read_text()
    assert 'href="combinations/"' in index, "the support matrix does not link the combinations page"
