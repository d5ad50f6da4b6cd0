"""A learner rank's actor processes: started clean, watched, restarted when one dies.

Each actor is ``python -m examples.d4pg.actor SPEC`` started with ``subprocess`` (fork and exec at once: nothing
of the learner's threads, TensorFlow or Horovod is inherited), in an environment without the launcher's job
variables (``hvrep._env.job_free_environ``), one NumPy/BLAS thread. ``check`` (the learner calls it between
loops) restarts an actor that exited, with a new seed, and says so; the job goes on. ``restart_stalled`` ends
and restarts an actor that inserted nothing for a while (stopped by SIGSTOP, or stuck in its environment): with a
rate limiter, or on one rank, a learner waiting for stopped actors would otherwise wait for ever. An actor ends
with the learner however the learner ends (``actor.die_with_parent``); ``close`` continues a stopped actor before
it ends it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from examples.d4pg.actor import ActorSpec
from hvrep import _env

ROOT = Path(__file__).resolve().parents[2]  # the checkout: `examples` must import in the actor
STARTUP_S = 60.0  # restart_stalled's least wait for an actor's first row
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ActorPool:
    """The actors of one learner rank.

    Args:
      specs: one per actor (its ring, its seed).
      log_dir: each actor's output goes to ``<log_dir>/<name>-actor<i>.log`` (appended across restarts).
      name: this rank's part of the log names.
    """

    def __init__(self, specs: list[ActorSpec], log_dir: Path, name: str) -> None:
        self.specs, self.log_dir, self.name = list(specs), log_dir, name
        self.procs: list[subprocess.Popen | None] = [None] * len(specs)
        self._logs: list[IO[bytes] | None] = [None] * len(specs)
        self.restarts = [0] * len(specs)
        # Per actor: (its progress counter when last seen to move, when, whether it has moved since the actor
        # started), for restart_stalled; None: not seen since it started.
        self._moved: list[tuple[int, float, bool] | None] = [None] * len(specs)
        # An actor's parent-death signal follows the thread that started it: only the thread that made the pool
        # (the learner's main thread, which lives as long as the learner) starts actors.
        self._thread = threading.current_thread()

    def _start(self, i: int) -> None:
        if threading.current_thread() is not self._thread:
            raise RuntimeError(f"ActorPool starts actors only from the thread that made it ({self._thread.name}): "
                               "an actor is killed when the thread that started it ends")
        spec = dataclasses.replace(self.specs[i], parent=os.getpid())
        if self.restarts[i]:  # a new seed: the same seed would replay the episodes the dead actor sent
            spec = dataclasses.replace(spec, seed=spec.seed + 100_003 * self.restarts[i])
        pythonpath = _env.job_free_environ().get(_env.PYTHONPATH, "")
        env = _env.job_free_environ({**_ONE_THREAD, _env.PYTHONPATH: ":".join(filter(None, [str(ROOT), pythonpath]))})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self._logs[i] is None:
            self._logs[i] = open(self.log_dir / f"{self.name}-actor{i}.log", "ab")  # closed in close()
        self._moved[i] = None  # a new actor's clock starts when it is next checked
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "examples.d4pg.actor", json.dumps(dataclasses.asdict(spec))], env=env,
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._logs[i], stderr=subprocess.STDOUT)

    def start(self) -> None:
        for i in range(len(self.specs)):
            self._start(i)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def check(self) -> list[dict[str, Any]]:
        """Restarts every actor that exited; returns one event per restart (for metrics.jsonl)."""
        events = []
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            self.restarts[i] += 1
            self._start(i)
            events.append({"actor": i, "exit_code": proc.returncode, "old_pid": proc.pid,
                           "new_pid": self.procs[i].pid, "restarts": self.restarts[i],
                           "log": str(self.log_dir / f"{self.name}-actor{i}.log")})
        return events

    def restart_stalled(self, progress: Sequence[int], timeout_s: float) -> list[dict[str, Any]]:
        """Ends (continued first, then SIGKILL) and restarts every actor whose ``progress`` (its rows inserted) has
        not moved for ``timeout_s`` seconds of this pool's checks; one event per restart, as ``check``'s, with
        ``stalled_s``. ``timeout_s`` 0: never. An actor that has not inserted yet since it started gets at least
        ``STARTUP_S``: starting one (an interpreter, NumPy, gymnasium) took over 3 s on a loaded 2-core machine,
        and a short ``timeout_s`` restarted every new actor before its first row, for ever."""
        now, events = time.monotonic(), []
        for i, proc in enumerate(self.procs):
            value, seen = int(progress[i]), self._moved[i]
            if seen is None or seen[0] != value:
                self._moved[i] = (value, now, seen is not None)
                continue
            limit = timeout_s if seen[2] else max(timeout_s, STARTUP_S)
            if timeout_s <= 0 or proc is None or proc.poll() is not None or now - seen[1] < limit:
                continue
            proc.send_signal(signal.SIGCONT)  # a stopped process takes SIGKILL too; continued, it leaves no doubt
            proc.kill()
            proc.wait()
            self.restarts[i] += 1
            self._start(i)
            events.append({"actor": i, "exit_code": proc.returncode, "old_pid": proc.pid,
                           "new_pid": self.procs[i].pid, "restarts": self.restarts[i],
                           "log": str(self.log_dir / f"{self.name}-actor{i}.log"),
                           "stalled_s": round(now - seen[1], 1)})
        return events

    def close(self) -> None:
        """Ends every actor (a stopped one is continued first, so it can take the SIGTERM)."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            if log is not None:
                log.close()
        self._logs = [None] * len(self.specs)
