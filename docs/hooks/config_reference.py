"""MkDocs hook: renders the training app's configuration reference from the dataclasses themselves.

A page that holds the line ``<!-- hvrep:config-reference -->`` gets, in its place, one table per
``RunConfig`` section: every key as ``section.key=``, its type, its default, the value each preset sets
where it differs, and its meaning from the dataclass docstring's ``Attributes:`` section. So the page
cannot drift from the code: a field without a docstring entry fails the build (``mkdocs build --strict``
turns this hook's warning into an error).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import typing
from pathlib import Path
from typing import Any

MARKER = "<!-- hvrep:config-reference -->"
PRESETS = ("demo", "resnet50_imagenet")
log = logging.getLogger("mkdocs.plugins.hvrep.config_reference")
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's hvrep, whatever the venv has installed


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of a Google-style class docstring, by field name.

    An entry ``mean, std: text`` documents both names; continuation lines are indented deeper
    than the entry's name.
    """
    doc = cls.__doc__ or ""
    lines = doc.splitlines()
    docs: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return docs
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break  # the section ended
        m = re.match(r"\s*([\w, ]+):\s*(.*)$", line) if depth == indent else None
        if m:
            names = [n.strip() for n in m[1].split(",")]
            for n in names:
                docs[n] = m[2].strip()
        else:
            for n in names:
                docs[n] += " " + line.strip()
    return docs


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    text = text or str(hint).replace("typing.", "")
    return text.replace("NoneType", "None")


def _value(value: Any) -> str:
    if isinstance(value, str):
        home = str(Path.home())
        return '`""`' if value == "" else f"`{value.replace(home, '~')}`"
    if isinstance(value, float):
        return f"`{value:.6g}`"
    if isinstance(value, tuple):
        return "`" + ", ".join(_value(v).strip("`") for v in value) + "`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows(cfg: Any, presets: dict[str, Any], prefix: str = "") -> tuple[list[str], list[tuple[str, type, list[str]]]]:
    """Table rows for ``cfg``'s plain fields, and the nested dataclass sections to render after it."""
    hints = typing.get_type_hints(type(cfg))
    docs = attribute_docs(type(cfg))
    out, sections = [], []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            sections.append((key, value, {p: getattr(v, f.name) for p, v in presets.items()}))
            continue
        if f.name not in docs:
            log.warning("config reference: %s.%s (`%s`) has no entry in the Attributes: section of its docstring",
                        type(cfg).__name__, f.name, key)
        differs = [f"{p}: {_value(getattr(v, f.name))}" for p, v in presets.items() if getattr(v, f.name) != value]
        out.append(f"| `{key}` | `{_cell(_type_name(hints[f.name]))}` | {_value(value)} | {'<br>'.join(differs)} | "
                   f"{_cell(docs.get(f.name, ''))} |")
    return out, sections


def render() -> str:
    """The reference: the top-level keys, then one table per section, in the order RunConfig declares them."""
    from hvrep.train.config import RunConfig, preset

    header = ["| key | type | default | presets (where they differ) | meaning |", "|---|---|---|---|---|"]
    presets = {p: preset(p) for p in PRESETS}
    top, sections = rows(RunConfig(), presets)
    parts = ["### Top-level keys", "", *header, *top, ""]
    for key, value, section_presets in sections:
        body, nested = rows(value, section_presets, prefix=f"{key}.")
        assert not nested, f"{key}: nested sections are not rendered"
        summary = (type(value).__doc__ or "").strip().splitlines()[0]
        parts += [f"### `{key}`: {type(value).__name__}", "", summary, "", *header, *body, ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: put the rendered reference where a page asks for it."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
