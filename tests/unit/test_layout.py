"""The package layout: one folder per layer, no import pointing upward, old module paths still resolve."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvrep"

# Lowest first (STYLE.md, "Layers"). A module may import its own layer and the ones before it.
# kernels sit below the replica layer: the fused all-reduce packs its buffers with them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("hvrep.errors", "hvrep._env", "hvrep._version", "hvrep._moved", "hvrep.compat")),
    ("kernels", ("hvrep.kernels",)),
    ("replica", ("hvrep.replica",)),
    ("keras building blocks", ("hvrep.layers", "hvrep.optimizers", "hvrep.schedules", "hvrep.models",
                               "hvrep.recipes", "hvrep.keras")),
    ("data", ("hvrep.data",)),
    ("training app", ("hvrep.train",)),
    ("tooling", ("hvrep.cluster", "hvrep.perf")),
    ("cli", ("hvrep.cli",)),
]


def _layer(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    """Every hvrep module ``module`` imports, in any statement (also inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from hvrep import errors` imports the module hvrep.errors; `from hvrep.x import f`, hvrep.x.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m == "hvrep" or m.startswith("hvrep.")}


def test_every_module_belongs_to_a_layer():
    homeless = sorted(m for m in _modules() if m != "hvrep" and _layer(m) is None)
    assert not homeless, f"modules outside every layer (add them to LAYERS or move them): {homeless}"


def test_no_module_imports_a_higher_layer():
    upward = []
    modules = _modules()
    for module, path in modules.items():
        mine = _layer(module)
        if mine is None:
            continue
        for target in _imports(module, path, set(modules)):
            if target == "hvrep":
                # The root only re-exports (lazily): the replica layer's names and the building blocks.
                if mine <= _layer("hvrep.replica"):
                    upward.append(f"{module} -> hvrep (the root re-exports layers above it)")
                continue
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    assert not upward, "imports that point upward:\n" + "\n".join(sorted(upward))


def test_the_top_level_holds_only_the_cross_cutting_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert top == ["_env", "_moved", "_version", "cli", "errors", "layers", "models", "optimizers", "recipes",
                   "schedules"], top


@pytest.mark.parametrize(("old", "new"), [
    ("hvrep.config", "hvrep.replica.comm"),
    ("hvrep.replicator", "hvrep.replica.api"),
    ("hvrep.costmodel", "hvrep.perf.costmodel"),
    ("hvrep.checkpoint", "hvrep.train.checkpoint"),
    ("hvrep.backends.horovod", "hvrep.replica.backends.horovod"),
])
def test_an_old_module_path_is_the_moved_module_itself(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), caught


def test_a_moved_package_never_loads_its_modules_twice():
    import hvrep
    from hvrep.backends.base import Backend  # the old path, through the alias

    assert Backend is importlib.import_module("hvrep.replica.backends.base").Backend
    duplicates = [name for name, m in sys.modules.items()
                  if name.startswith("hvrep.backends.") and m is not sys.modules.get("hvrep.replica" + name[5:])]
    assert not duplicates, duplicates
    assert hvrep.CommConfig is importlib.import_module("hvrep.config").CommConfig


def _python_m(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


@pytest.mark.parametrize("module", ["hvrep.perf.summary", "hvrep.summary"])
def test_python_m_summary_runs_under_the_old_and_the_new_path(module):
    res = _python_m(module)  # no run directory: its usage line and exit 2, from its own main()
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    assert "usage: python -m hvrep.perf.summary RUN_DIR" in res.stderr


def test_python_m_hvrep_train_runs_the_training_cli():
    res = _python_m("hvrep.train", "--config", "demo", "--print-config", "train.epochs=7")
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"epochs": 7' in res.stdout
