"""A rank killed by a signal says which, and at which step and input shapes (issue 48).

A crash in native code (TensorFlow, oneDNN, Horovod: SIGSEGV, SIGABRT from a corrupted heap, SIGBUS, SIGFPE,
SIGILL) ends the process before Python can say anything: the shell prints "Segmentation fault", a launcher
"exited on signal 11", the other ranks' watchdog a rank whose connection closed. Each rank of ``hvrep train``
therefore:

* enables Python's ``faulthandler`` into ``<output_dir>/crash/rank<R>.txt``: at a fatal signal, the
  signal's name and every thread's Python stack (the compiled step among them);
* notes, before each training step, what it is about to run (``train step 12: x float32[31, 32, 32, 3],
  y int32[31]``) in ``rank<R>.step``: one ``os.pwrite`` of a fixed-size record into a file opened once,
  so a crash in the step finds it on disk; no allocation or lock in the crashing process is needed (40-60 us
  a step with the shapes formatted, timed on the shared 2-core machine under load: under 0.1% of a demo step);
* starts a small watcher process (``_crash_watch.py``, no TensorFlow) that waits for the rank to end (a pipe
  only the rank holds). If the faulthandler file then names a fatal signal, the watcher prints one report on
  the rank's stderr: the rank, the signal, the step and shapes, where the stacks are, and what to try. A rank
  that ends otherwise (done, a Python error, the watchdog's exit, SIGKILL) leaves no fatal-signal record and
  the watcher says nothing.

On a clean exit the files are removed. docs/troubleshooting.md, "A rank died of a signal".
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# The step record's size on disk: fixed, so each note overwrites the last in place (one pwrite).
RECORD_BYTES = 1024
_WATCHER = Path(__file__).with_name("_crash_watch.py")


class CrashRecord:
    """This rank's faulthandler file, step record and watcher (:func:`start` makes one per process).

    Args:
      folder: where ``rank<R>.txt`` (the stacks) and ``rank<R>.step`` (the last note) go.
      rank: this process's rank, for the file names and the report.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.traceback_path = folder / f"rank{rank}.txt"
        self.step_path = folder / f"rank{rank}.step"
        self._stacks = self.traceback_path.open("w")
        self._fd = os.open(self.step_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=self._stacks, all_threads=True)
        # The watcher sees EOF on this pipe when the rank ends, however it ends; only this process holds the
        # write end (os.pipe's ends are not inherited by the rank's own subprocesses).
        read, self._alive = os.pipe()
        self._watcher = subprocess.Popen(
            [sys.executable, "-I", str(_WATCHER), str(read), str(rank), str(os.getpid()), str(self.step_path),
             str(self.traceback_path)],
            pass_fds=(read,), stdin=subprocess.DEVNULL, start_new_session=True)  # outlives a launcher's group kill
        os.close(read)
        self.note("start-up, before the first step")

    def note(self, what: str) -> None:
        """Records what this rank is about to run (overwrites the last note)."""
        data = what.encode()[: RECORD_BYTES - 1] + b"\n"
        os.pwrite(self._fd, data.ljust(RECORD_BYTES, b"\0"), 0)

    def close(self) -> None:
        """A clean end: faulthandler as it was, the watcher released, the (empty) files removed."""
        if self._fd < 0:
            return
        if faulthandler.is_enabled():
            faulthandler.disable()
        if self._was_enabled:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        os.close(self._alive)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._watcher.wait(timeout=5)
        os.close(self._fd)
        self._fd = -1
        self._stacks.close()
        for path in (self.step_path, self.traceback_path):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.step_path.parent.rmdir()  # only if empty: another rank's files stay


_current: CrashRecord | None = None


def start(output_dir: Path, rank: int) -> CrashRecord:
    """Starts this process's record under ``output_dir/crash`` (once; a second call returns the first)."""
    global _current
    if _current is None:
        _current = CrashRecord(Path(output_dir) / "crash", rank)
        atexit.register(_current.close)
    return _current


def note_step(step: int, x: Any, y: Any) -> None:
    """Before training step ``step``: its number and the shapes of its inputs (per replica), if recording."""
    if _current is not None:
        _current.note(f"train step {step}: x {_shapes(x)}, y {_shapes(y)}")


def note(what: str) -> None:
    """Records ``what`` (e.g. "model.fit, epoch 2"), if recording."""
    if _current is not None:
        _current.note(what)


def _shapes(value: Any) -> str:
    """``float32[31, 32, 32, 3]``, or one per replica for an in-graph per-replica value."""
    parts = getattr(value, "values", None)
    items = parts if isinstance(parts, tuple) else (value,)
    described = []
    for item in items:
        shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
        name = getattr(dtype, "name", str(dtype))
        described.append(f"{name}{list(shape) if shape is not None else '[?]'}")
    return described[0] if len(described) == 1 else "(" + ", ".join(described) + " per replica)"
