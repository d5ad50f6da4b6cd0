"""The fault campaign's shared interface (issue 49).

An injection is one fault of one kind at one named point; its outcome says whether the run came back to the
expected state and whether anything was lost. A kind lives in ``benchmarks/_faults/<topic>.py`` and each such
module exposes ``KINDS: list`` of objects with ``name``, ``points(rng)`` and ``run(inj, workdir)``;
``benchmarks/faults.py`` finds them with :mod:`pkgutil`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Injection:
    """One fault to inject.

    Attributes:
        kind: The kind's ``name``.
        point: The named injection point, one of ``kind.points(rng)``.
        seed: Seed of this injection (chooses the point and any offset inside it).
        launcher: ``"mpirun"`` or ``"gloo"`` (``horovodrun --gloo``); kinds without ranks ignore it.
    """

    kind: str
    point: str
    seed: int
    launcher: str


@dataclass
class Outcome:
    """What one injection did.

    Attributes:
        recovered: The run came back to the expected state (resumed and finished, or stopped as documented).
        steps_lost: Steps of work redone after the fault (at most the checkpoint interval).
        recover_s: Seconds from the fault to the end of the recovering run.
        lost: Anything lost, one short line each (a checkpoint unreadable, a metrics line gone, a process left
            behind, weights that differ); the goal is an empty list.
        exit_code: The faulted run's exit code as the user sees it (launcher or Slurm script included).
        expected_exit: The code docs/troubleshooting.md's table gives for this fault.
        detail: Free text for the report.
    """

    recovered: bool
    steps_lost: int
    recover_s: float
    lost: list[str]
    exit_code: int | None
    expected_exit: int | None
    detail: str = ""


class Kind(Protocol):
    """A kind of fault: where it can be injected and how one injection runs."""

    name: str

    def points(self, rng: random.Random) -> list[str]:
        """The named injection points this kind chooses from."""

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        """Inject ``inj`` in a fresh run under ``workdir`` and report what happened."""
