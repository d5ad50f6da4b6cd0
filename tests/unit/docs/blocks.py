"""The fenced ```python blocks of the docs and the README, and how each is run.

The info string after ``python`` holds tags: ``notest`` (never run: it needs a GPU, a cluster, ImageNet,
root...), ``launch`` (a launch example: run in one process AND on 2 ranks, under mpirun and horovodrun
--gloo). Every other block runs in one process. Blocks of one file do not share names: each is a
complete example.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One fenced python block: where it is, its tags and its code (dedented)."""

    path: str  # relative to the repository root
    line: int
    tags: frozenset[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The python blocks of one markdown file, in order."""
    text = path.read_text()
    out = []
    for m in _FENCE.finditer(text):
        indent = len(m["indent"])
        code = "\n".join(line[indent:] for line in m["body"].splitlines()) + "\n"
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(str(path.relative_to(ROOT)), line, frozenset(m["info"].split()), code))
    return out


def all_blocks() -> list[Block]:
    """Every python block of README.md and docs/**/*.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [b for f in files for b in blocks(f)]
