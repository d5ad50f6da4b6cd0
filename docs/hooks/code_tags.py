"""MkDocs hook: includes README sections in pages, and strips the test tags from fenced code blocks.

- A line ``--8<-- "README.md:NAME"`` is replaced by the README's lines between its
  ``--8<-- [start:NAME]`` and ``--8<-- [end:NAME]`` markers (so the README's example is written once and is
  run once by the tests, which read the README itself).
- The test suite reads the tags after a fence's language (```` ```python notest ````,
  ```` ```python launch ````; tests/unit/docs/blocks.py); Markdown's fences take a language only, and would
  otherwise not close the block, so the tags are removed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TAGS = ("notest", "launch")
_FENCE = re.compile(r"^(?P<fence>[ \t]*```+\s*python)(?P<tags>(?:[ \t]+(?:" + "|".join(TAGS) + r"))+)[ \t]*$", re.M)
_INCLUDE = re.compile(r'^--8<-- "(?P<file>[^":]+):(?P<name>[\w-]+)"[ \t]*$', re.M)


class IncludeError(Exception):
    """An include names a file or section that does not exist."""


def _section(match: re.Match) -> str:
    path = ROOT / match["file"]
    text = path.read_text() if path.is_file() else ""
    start, end = f"--8<-- [start:{match['name']}]", f"--8<-- [end:{match['name']}]"
    lines = text.splitlines()
    try:
        i = next(k for k, line in enumerate(lines) if start in line)
        j = next(k for k, line in enumerate(lines) if end in line and k > i)
    except StopIteration:
        raise IncludeError(f"{match[0]}: no section between '{start}' and '{end}' in {path}") from None
    return "\n".join(lines[i + 1:j])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: README sections in, then ```` ```python notest ```` becomes ```` ```python ````."""
    markdown = _INCLUDE.sub(_section, markdown)
    return _FENCE.sub(lambda m: m["fence"], markdown)
