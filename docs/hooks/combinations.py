"""MkDocs hook: renders "What combines with what" (docs/combinations.md) from hvrep's support table.

A page that holds the line ``<!-- hvrep:combinations -->`` gets, in its place, the table's axes and values,
every refused combination with its reason and fix, the reference each accepted combination is checked against,
and the covering array the combination test trains, all from ``hvrep.replica.support``: the page cannot drift
from the code (tests/unit/docs/test_site.py reads the built page back against the table).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- hvrep:combinations -->"
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's hvrep, whatever the venv has installed


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rule_settings(rule: Any) -> str:
    """A rule's settings as the page writes them: ``axis = v1 or v2``, joined by `` + ``."""
    return " + ".join(f"{axis} = {' or '.join(values)}" for axis, values in rule.when)


def render() -> str:
    from hvrep.replica import support

    parts = ["## The settings", "", "| axis | values | what it is |", "|---|---|---|"]
    for axis, values in support.AXES.items():
        parts.append(f"| {axis} | {', '.join(f'`{v}`' for v in values)} | {_cell(support.AXIS_DOCS[axis])} |")
    parts += ["", "## Refused combinations", "",
              "Each is a `ConfigError` naming the settings and the fix, raised when `CommConfig`, the `Replicator`, "
              "`wrap_optimizer`, `hvrep.keras.DistributedOptimizer`, `hvrep.elastic.State` or `hvrep train`'s "
              "configuration is built, before any step runs (`hvrep train` exits 2). Every combination not "
              "listed is accepted.", "",
              "| settings | refused by | why | fix |", "|---|---|---|---|"]
    for rule in support.RULES:
        scope = "hvrep train only" if rule.app_only else "everywhere"
        parts.append(f"| {rule_settings(rule)} | {scope} | {_cell(rule.reason)} | {_cell(rule.fix)} |")
    parts += ["", "## What an accepted combination is checked against", "",
              "The first row that matches names the reference (`hvrep.replica.support.reference`).", "",
              "| when | reference | tolerance |", "|---|---|---|"]
    examples = [("local_sgd = H", {"local_sgd": "H"}),
                ("compression = powersgd", {"compression": "powersgd"}),
                ("precision or compression fp16 or bf16", {"precision": "fp16"}),
                ("otherwise", {})]
    for when, combo in examples:
        ref = support.reference(combo)
        what = "exact: N replicas x B equal 1 x N·B in one process" if ref.kind == "exact" else ref.simulation
        parts.append(f"| {when} | {what} | by precision (below) |")
    parts += ["", "Tolerances: " + "; ".join(
        f"{label} {support.reference(c).tolerance:g} {'relative' if support.reference(c).relative else 'absolute'}"
        for label, c in (("fp32", {}), ("fp16 (precision or compression)", {"precision": "fp16"}),
                         ("bf16 (precision or compression)", {"precision": "bf16"}))) + ".", ""]
    cases = support.tested_cases()
    axes = list(support.AXES)
    gaps = "; ".join(f"{rule_settings(r)}: {r.reason}" for r in support.NOT_TESTABLE)
    parts += ["## The combinations the test trains", "",
              f"A covering array of {len(cases)} accepted combinations in which every pair of two settings' values "
              "that some accepted combination holds appears at least once (`hvrep.replica.support.tested_cases`, "
              "greedy and deterministic), over the backends this project's machines run "
              f"({', '.join(support.TESTED_BACKENDS)}: no TPU here). Not trained: {gaps}. "
              "Each case runs where its backend does: in-graph on 2 logical CPU devices, and on 2 ranks under "
              "`mpirun` and `horovodrun --gloo` (one launch each), for 4 updates; fp16 cases with an overflow at "
              "the second update that must be skipped.", "",
              "| # | " + " | ".join(axes) + " | reference |", "|" + "---|" * (len(axes) + 2)]
    for i, case in enumerate(cases, 1):
        ref = support.reference(case)
        parts.append(f"| {i} | " + " | ".join(case[a] for a in axes) + f" | {ref.kind} |")
    return "\n".join(parts) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: put the rendered table where a page asks for it."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
