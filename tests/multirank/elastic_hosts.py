"""The hosts file an elastic test's discovery script prints, as the workers change it (elastic_worker.py,
elastic_fit_worker.py): the driver reads the script every second."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path


class HostsFile:
    """``path``, listing ``names`` (comma-separated) one slot each; ``others``: the hosts but this worker's."""

    def __init__(self, path: Path, names: str, record: Callable[..., None]) -> None:
        self.path, self.all, self.record = path, names.split(","), record
        me = os.environ["HOROVOD_HOSTNAME"]
        self.others = [h for h in self.all if h != me]

    def write(self, listed: Iterable[str]) -> None:
        """Lists ``listed`` (atomically: the driver never reads half a file)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}:1\n" for h in listed))
        tmp.replace(self.path)

    def commit_until_update(self, state, what: str) -> None:
        """Commits ``state`` every 0.2 s until the driver's news arrives (the commit raises Horovod's
        HostsUpdatedInterrupt); every worker of the world must call it, since a commit runs a collective."""
        self.record(event="waiting", what=what, at=time.time())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state.commit()
            time.sleep(0.2)
        raise RuntimeError(f"no host update arrived within 90 s after {what}")
