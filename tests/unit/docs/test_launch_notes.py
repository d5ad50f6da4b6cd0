"""The docs' launch commands say what they do: every page that shows an mpirun command links the one note on
running it as root (Open MPI 5 refuses root without --allow-run-as-root), and no --gloo line claims MPI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
NOTE = "clusters.md#mpirun-as-root"


def _command_lines(text: str) -> list[str]:
    """The lines of the page's code blocks, and its inline code spans."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    return [line for b in blocks for line in b.splitlines()] + re.findall(r"`([^`\n]+)`", text)


def test_every_page_that_shows_mpirun_links_the_note_on_running_it_as_root():
    text = (ROOT / "docs" / "clusters.md").read_text()
    assert "{#mpirun-as-root}" in text and "--allow-run-as-root" in text and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" in text
    unlinked = [p.name for p in PAGES if p.name != "clusters.md" and NOTE not in p.read_text()
                and any(re.match(r"\s*mpirun -np ", line) for line in _command_lines(p.read_text()))]
    assert not unlinked, f"pages showing `mpirun -np` without a link to {NOTE}: {unlinked}"


def test_no_gloo_command_says_it_runs_over_mpi():
    commented = [(p.name, *line.split("#", 1)) for p in PAGES for line in _command_lines(p.read_text()) if "#" in line]
    wrong = [(page, command) for page, command, comment in commented
             if "--gloo" in command and re.search(r"\bover MPI\b", comment) and "without --gloo" not in comment]
    assert not wrong, wrong
