"""Stopping cleanly on SIGTERM / SIGUSR1 (Slurm preemption, ``sbatch --signal``) and Ctrl-C (SIGINT).

A signal may reach only some ranks: ``srun`` signals every task, ``mpirun``
and ``horovodrun`` forward differently. So the handler only sets a local flag,
and the training loop agrees on stopping by reducing the flag (max) across
replicas at each step boundary: everyone stops at the same step, the chief
saves, all exit 0, ready for requeue. Ctrl-C does the same (a second Ctrl-C stops at once, without saving).

What reaches the ranks on Ctrl-C depends on the launcher: one process gets SIGINT; ``horovodrun`` catches it and
sends its ranks SIGTERM, then kills what still runs 5 s later (hvrep's ranks stop in time at a step of the demo's
size); Open MPI 5's ``mpirun`` sends SIGTERM and SIGKILL 0.25 s later, too soon to save: stop an mpirun job with
``kill -USR1 <mpirun's pid>`` (forwarded to every rank), or start it with ``hvrep launch``, which does that on
Ctrl-C.
"""

from __future__ import annotations

import signal
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """Set by a signal handler; read by the loop."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self, repl: Any) -> bool:
        """Whether any replica of ``repl`` was asked to stop (one reduce: call it on every rank at the same step)."""
        import tensorflow as tf

        return int(repl.reduce(tf.constant(int(self.requested)), "sum")) > 0

    def _handle(self, signum: int, _frame: types.FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now
        self.signum = signum


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = SIGNALS) -> Iterator[StopRequest]:
    """Installs handlers that record the signal instead of dying; restores the old ones after."""
    request = StopRequest()
    previous = {s: signal.signal(s, request._handle) for s in signals}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
