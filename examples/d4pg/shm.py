"""A learner rank's shared-memory folder (its replay and board), and the removal of a dead run's.

The folder is made with an ``owner.json`` naming the learner and its actors by process identity (kernel boot,
pid namespace, pid and start time: ``hvrep.replica.identity``). A learner that ends by SIGKILL or ``os._exit``
(the hang watchdog) removes nothing, and a Humanoid-sized replay holds about 620 MB of memory per rank. The next
start on the node (:func:`remove_dead`) removes such a folder only once its owner is proven gone: a folder whose
learner still runs, or that another namespace or boot made, or whose owner file cannot be read, is left alone.
A leftover actor of a dead run (proven the same process) is continued and killed first, as a stopped actor
cannot take a signal that ends it otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

from hvrep.replica.identity import ProcessIdentity

PREFIX = "hvrep-d4pg-"
OWNER = "owner.json"


def _base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def make_folder(prefix: str) -> Path:
    """A fresh folder in shared memory (/dev/shm where there is one), owned by this process."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=_base()))
    record_owner(folder, [])
    return folder


def record_owner(folder: Path, actor_pids: list[int]) -> None:
    """Writes ``folder``'s owner file: this process and the actors it runs now (atomically)."""
    actors = [i.to_json() for i in map(ProcessIdentity.of, actor_pids) if i is not None]
    tmp = folder / f".{OWNER}.tmp"
    tmp.write_text(json.dumps({"learner": ProcessIdentity.mine().to_json(), "actors": actors}))
    os.replace(tmp, folder / OWNER)


def remove_dead(prefix: str = PREFIX, base: str | os.PathLike | None = None) -> list[str]:
    """Removes the folders named ``prefix*`` in ``base`` (default: /dev/shm or the temporary folder) whose learner
    is proven gone, ending their leftover actors first; returns one line per folder removed."""
    root = Path(base if base is not None else _base() or tempfile.gettempdir())
    removed = []
    for folder in sorted(root.glob(f"{prefix}*")):
        try:
            record = json.loads((folder / OWNER).read_text())
            learner = ProcessIdentity.from_json(record["learner"])
            actors = [ProcessIdentity.from_json(a) for a in record.get("actors", [])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # no owner to prove gone (being made, or not ours): left alone
        if learner is None or learner.alive() is not False:
            continue
        ended = []
        for actor in actors:
            if actor is not None and actor.alive():
                os.kill(actor.pid, signal.SIGCONT)  # a stopped actor: continued, then killed
                os.kill(actor.pid, signal.SIGKILL)
                ended.append(actor.pid)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"{folder} (learner pid {learner.pid} is gone" +
                       (f"; ended its actor(s) {', '.join(map(str, ended))})" if ended else ")"))
    return removed
