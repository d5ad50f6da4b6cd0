"""The package layout: one folder per layer, no import pointing upward, every documented module path exists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvrep"

# Lowest first (STYLE.md, "Layers"). A module may import its own layer and the ones before it.
# kernels sit below the replica layer: the fused all-reduce packs its buffers with them.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("hvrep.errors", "hvrep._env", "hvrep._version", "hvrep.compat")),
    ("kernels", ("hvrep.kernels",)),
    ("replica", ("hvrep.replica", "hvrep.elastic")),  # hvrep.elastic re-exports hvrep.replica.elastic
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
    assert top == ["_env", "_version", "cli", "errors", "layers", "models", "optimizers", "recipes",
                   "schedules"], top


# Where users and scripts name modules: `python -m X`, and dotted hvrep module paths in prose and code.
# (Tests import what they name: a wrong path there fails by itself.)
_DOC_FILES = ["README.md", "Makefile", ".ci/run", *map(str, sorted((ROOT / "slurm").glob("*"))),
              *map(str, sorted((ROOT / "docs").rglob("*.md"))),
              *map(str, sorted((ROOT / "benchmarks").glob("*.py")))]
_MODULE_PATH = re.compile(r"(?:python -m |\b)(hvrep(?:\.[a-z_][a-z0-9_]*)+)")


def _is_module_or_attribute(dotted: str) -> bool:
    """``dotted`` names a module, or an attribute of one (``hvrep.perf.costmodel.calibrate``)."""
    head, _, tail = dotted.rpartition(".")
    try:
        if importlib.util.find_spec(dotted) is not None:
            return True
    except ModuleNotFoundError:
        pass
    try:
        return bool(head) and hasattr(importlib.import_module(head), tail)
    except ModuleNotFoundError:
        return False


def test_no_import_hook_is_installed_and_the_old_module_paths_are_gone():
    import hvrep  # noqa: F401

    hooks = [f for f in sys.meta_path if type(f).__module__.startswith("hvrep")]
    assert hooks == [], hooks  # a global import hook of hvrep's would sit in every user's process
    for old in ("hvrep.config", "hvrep.replicator", "hvrep.summary", "hvrep.backends"):
        assert importlib.util.find_spec(old) is None, old


def test_the_docs_scripts_and_tests_name_only_module_paths_that_exist():
    wrong = set()
    for path in _DOC_FILES:
        text = (ROOT / path).read_text(errors="replace")
        for found in set(_MODULE_PATH.findall(text)):
            dotted = found.rstrip(".")
            if not _is_module_or_attribute(dotted):
                wrong.add(f"{Path(path).relative_to(ROOT) if Path(path).is_absolute() else path}: {dotted}")
    assert not wrong, "\n".join(sorted(wrong))


def _python_m(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


def test_python_m_summary_runs():
    res = _python_m("hvrep.perf.summary")  # no run directory: its usage line and exit 2, from its own main()
    assert res.returncode == 2, (res.stdout, res.stderr[-2000:])
    assert "usage: python -m hvrep.perf.summary RUN_DIR" in res.stderr


def test_python_m_hvrep_train_runs_the_training_cli():
    res = _python_m("hvrep.train", "--config", "demo", "--print-config", "train.epochs=7")
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"epochs": 7' in res.stdout
