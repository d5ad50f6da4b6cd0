"""Named fault-injection points: a test hook for the fault campaign (``benchmarks/faults.py``) and its tests.

``HVREP_FAULT="<action>:<point>[@<n>][+<bytes>][/<rank>]"`` (read once, at import) injects one fault the
``n``-th time (default 1) this process reaches ``point``, on rank ``rank`` only (default: every rank). Points:

  ``ckpt.before_data``      a checkpoint save, its temporary folder made, before TensorFlow writes the data
  ``ckpt.data``             the data written; ``kill`` first cuts the data file to ``bytes`` (what a process killed
                            after writing that much of it leaves: the file is not yet fsynced or renamed);
                            ``fill`` fills the disk before the data, leaving ``bytes``, so the write stops there
  ``ckpt.before_metadata``  the data written, before ``checkpoint.json``
  ``ckpt.before_rename``    the folder complete and fsynced, before the rename that publishes it
  ``step.collective``       the custom loop's end-of-loop reduce, before this rank joins it (the other ranks are
                            inside the collective, waiting for it)
  ``step.between``          between steps: the end of a loop, after its metrics line and checkpoint
  ``metrics.write``         before a line is appended to ``metrics.jsonl``

Actions: ``kill`` (SIGKILL this process: no handler, no flush, as the out-of-memory killer or a lost node) and
``fill`` (fill the file system the point writes to, leaving ``bytes`` free, default 0: the write that follows
meets a real ``ENOSPC``; the filler is ``FILL_NAME`` in that folder, deleted to make space again).

Unset, which is always the case outside the campaign, every point is one comparison of a module global.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from hvrep import _env
from hvrep.errors import ConfigError

POINTS = ("ckpt.before_data", "ckpt.data", "ckpt.before_metadata", "ckpt.before_rename", "step.collective",
          "step.between", "metrics.write")
ACTIONS = ("kill", "fill")
FILL_NAME = ".hvrep-fault-fill"
_SPEC = re.compile(r"(?P<action>\w+):(?P<point>[\w.]+)(?:@(?P<n>\d+))?(?:\+(?P<bytes>\d+))?(?:/(?P<rank>\d+))?")


@dataclass(frozen=True)
class Fault:
    """One fault to inject (parsed ``HVREP_FAULT``)."""

    action: str
    point: str
    n: int = 1
    nbytes: int = 0
    rank: int | None = None

    def spec(self) -> str:
        """The ``HVREP_FAULT`` value that injects this fault."""
        rank = "" if self.rank is None else f"/{self.rank}"
        return f"{self.action}:{self.point}@{self.n}+{self.nbytes}{rank}"


def parse(text: str) -> Fault | None:
    """``HVREP_FAULT``'s value as a Fault; None for "".

    Raises:
      hvrep.errors.ConfigError: not of the form above, or an unknown action or point.
    """
    if not text:
        return None
    m = _SPEC.fullmatch(text)
    if m is None or m["action"] not in ACTIONS or m["point"] not in POINTS:
        raise ConfigError(f"{_env.HVREP_FAULT}={text!r} is not '<action>:<point>[@<n>][+<bytes>][/<rank>]' with an "
                          f"action in {ACTIONS} and a point in {POINTS}. Fix: unset it (it is a test hook).")
    return Fault(m["action"], m["point"], int(m["n"] or 1), int(m["bytes"] or 0),
                 None if m["rank"] is None else int(m["rank"]))


_FAULT = parse(_env.fault_spec())
if _FAULT is not None and _FAULT.rank is not None and _FAULT.rank != _env.launcher_rank():
    _FAULT = None
ARMED = _FAULT is not None  # False outside the campaign: callers may skip reached() entirely
_seen = 0


def reached(point: str, where: str | os.PathLike | None = None, data_file: str | os.PathLike | None = None) -> None:
    """Injects the armed fault if this is its point and its turn.

    Args:
      point: one of ``POINTS``.
      where: a folder on the file system the point is about to write to (``fill``).
      data_file: the checkpoint data file (``ckpt.data``'s ``kill`` cuts it to the fault's bytes).
    """
    global _seen
    if _FAULT is None:
        return
    # Filling the disk "after k bytes of the data" must happen before the data is written: the write then
    # stops where the space ends.
    armed_at = "ckpt.before_data" if (_FAULT.action, _FAULT.point) == ("fill", "ckpt.data") else _FAULT.point
    if point != armed_at:
        return
    _seen += 1
    if _seen != _FAULT.n:
        return
    if _FAULT.action == "fill":
        if where is not None:
            _fill(Path(where), _FAULT.nbytes)
        return
    if data_file is not None and Path(data_file).is_file():
        size = Path(data_file).stat().st_size
        os.truncate(data_file, min(_FAULT.nbytes, max(size - 1, 0)))
    os.kill(os.getpid(), signal.SIGKILL)


def _fill(folder: Path, leave: int) -> None:
    """Takes all but ``leave`` bytes of ``folder``'s file system with one file, ``folder/FILL_NAME``."""
    folder.mkdir(parents=True, exist_ok=True)
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    with open(folder / FILL_NAME, "ab") as f:
        try:
            os.posix_fallocate(f.fileno(), f.tell(), max(free - leave, 1))
        except OSError:
            pass  # full already: the file takes what there was
