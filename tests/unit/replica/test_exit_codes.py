"""hvrep.errors.EXIT_CODES is the one table of exit codes: the watchdog uses it, and the "Exit codes" section of
docs/troubleshooting.md and slurm/preemptible.sbatch must say the same."""

from __future__ import annotations

import re
from pathlib import Path

from hvrep.errors import EXIT_CODES, EXIT_HANG, EXIT_MISMATCH

ROOT = Path(__file__).resolve().parents[3]


def test_each_code_is_distinct_and_the_docs_list_each_with_what_slurm_does():
    assert len({e.code for e in EXIT_CODES}) == len(EXIT_CODES)
    assert len({e.stopped for e in EXIT_CODES if e.stopped}) == len([e for e in EXIT_CODES if e.stopped])
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = page.split("\n## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*$", section, flags=re.M)}
    assert sorted(rows) == sorted(e.code for e in EXIT_CODES), rows
    for e in EXIT_CODES:
        if e.stopped:
            assert f"`{e.stopped}`" in rows[e.code], rows[e.code]
        assert ("not requeued" in rows[e.code]) != e.requeue or e.code == 0, rows[e.code]


def _decision(script: str) -> list[tuple[str, str]]:
    """The branches of the decision after srun (the chain that ends in `scontrol requeue`): (condition, body)."""
    start = script.index("\nif [[ $status -eq 65")
    end = script.index("\nfi\n", script.index("scontrol requeue", start))
    chain = script[start + 1 : end]
    parts = re.split(r"^(?:if|elif) \[\[(.*)\]\]; then$", chain, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_the_preemptible_script_requeues_exactly_the_codes_the_table_marks_transient():
    branches = _decision((ROOT / "slurm" / "preemptible.sbatch").read_text())
    # The first branch refuses; a job that scancel ended is never requeued, so its branch comes before the requeue.
    refuse = branches[0][0]
    names = [i for i, (_, body) in enumerate(branches) if "scontrol requeue" in body]
    assert len(names) == 1, branches
    requeue = branches[names[0]][0]
    cancelled = [i for i, (cond, _) in enumerate(branches) if "$cancelled" in cond]
    assert cancelled and cancelled[0] < names[0], branches
    assert "scontrol requeue" not in branches[cancelled[0]][1]
    assert f"$status -eq {EXIT_HANG.code}" in requeue and f"$stopped == {EXIT_HANG.stopped}" in requeue
    assert f"$status -eq {EXIT_MISMATCH.code}" in refuse and f"$stopped == {EXIT_MISMATCH.stopped}" in refuse
    for e in EXIT_CODES:
        if not e.requeue and e.code:
            assert f"-eq {e.code} " not in requeue, e
