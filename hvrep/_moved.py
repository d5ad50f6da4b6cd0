"""Module paths from before the package layout (one folder per layer) keep working.

``import hvrep.config``, ``from hvrep.costmodel import Interconnect`` or
``python -m hvrep.summary`` in users' scripts resolve to the module's new home
(the same module object, so ``isinstance`` and module state are shared) with a
DeprecationWarning naming it. A meta-path finder (a supported import hook, not
a patch of anything) placed first, so a moved package's submodules are never
loaded a second time under their old names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

# old module -> new module; a moved package's submodules follow it (hvrep.backends.horovod).
MOVED = {
    "hvrep.backends": "hvrep.replica.backends",
    "hvrep.bench": "hvrep.perf.bench",
    "hvrep.checkpoint": "hvrep.train.checkpoint",
    "hvrep.collectives": "hvrep.replica.collectives",
    "hvrep.config": "hvrep.replica.comm",
    "hvrep.configs": "hvrep.train.config",
    "hvrep.costmodel": "hvrep.perf.costmodel",
    "hvrep.doctor": "hvrep.cluster.doctor",
    "hvrep.fusion": "hvrep.replica.fusion",
    "hvrep.launch": "hvrep.cluster.launch",
    "hvrep.optimizer_wrapper": "hvrep.replica.wrap",
    "hvrep.placement": "hvrep.replica.placement",
    "hvrep.preemption": "hvrep.train.preemption",
    "hvrep.replicator": "hvrep.replica.api",
    "hvrep.report": "hvrep.perf.report",
    "hvrep.summary": "hvrep.perf.summary",
}


def new_name(old: str) -> str | None:
    """The current name of module ``old``, or None if it did not move."""
    head = old
    while head:
        if head in MOVED:
            return MOVED[head] + old[len(head):]
        head = head.rpartition(".")[0]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(f"{module.__name__} is now {self.target}; import that instead.", DeprecationWarning,
                      stacklevel=2)
        # The import system returns whatever sys.modules holds after exec_module.
        sys.modules[module.__name__] = importlib.import_module(self.target)

    def get_code(self, fullname: str) -> CodeType | None:
        # `python -m <old name>` (runpy) runs the new module's code as __main__.
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec and spec.loader else None  # type: ignore[attr-defined]

    def is_package(self, fullname: str) -> bool:
        return False


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname)
        if new is None:
            return None
        origin = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new),
                                               origin=origin.origin if origin else None)


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
