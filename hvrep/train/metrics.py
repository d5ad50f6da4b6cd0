"""What a training run tells the world: metrics.jsonl, TensorBoard, console lines and the progress bar.

Chief-only output is decided once, here, when the run starts (jaxline's
``is_chief`` assembled at start-up, STYLE.md): every other rank gets writers
that do nothing, so the loop never asks which rank it is.

Other records of the run (the MLPerf log of ``train.mllog``, ``mlperf.py``) are
:class:`Listener` objects of the chief's writer: they hear every event written to
metrics.jsonl and the moments metrics.jsonl does not record (:meth:`MetricsWriter.mark`:
an epoch's or an evaluation's start), so both loops feed them through the
calls they make anyway.

Every reader of metrics.jsonl (resume's append, ``slurm/env.sh``, ``hvrep report``, the summary) goes
through :func:`read_events`: a line cut off by a crash mid-write, or one that is not an event, is skipped
with a warning instead of stopping the reader (a Slurm script under ``set -e`` would never requeue again).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

_log = logging.getLogger("hvrep")


def read_json_lines(path: str | Path, key: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The JSON objects of a JSON-lines file as (line number, object), in order.

    A line that is not JSON (torn by a crash mid-write), not an object, or (with ``key``) an object without
    ``key`` is skipped with a warning naming the file and line. Blank lines are skipped silently.

    Raises:
      OSError: the file cannot be read.
    """
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                _log.warning("hvrep: %s:%d is not JSON (%s: a line cut off by a crash mid-write?); skipped it",
                             path, number, e.msg)
                continue
            if not isinstance(record, dict) or (key is not None and key not in record):
                what = f"an object without {key!r}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
                _log.warning("hvrep: %s:%d is %s, not a record of this file; skipped it", path, number, what)
                continue
            records.append((number, record))
    return records


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a metrics.jsonl in order, each a dict with an ``"event"``; torn or foreign lines skipped
    with a warning (:func:`read_json_lines`).

    Raises:
      OSError: the file cannot be read.
    """
    return [record for _, record in read_json_lines(path, key="event")]


def _end_torn_line(path: Path) -> None:
    """Ends a last line a crash cut off, so that the next record starts a line of its own instead of being
    glued to the fragment (and lost with it)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return
            f.seek(-1, 2)
            if f.read(1) == b"\n":
                return
    except FileNotFoundError:
        return
    _log.warning("hvrep: the last line of %s was cut off (a crash mid-write); appending after it on a new line",
                 path)
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n")


class Listener(Protocol):
    """Hears the chief's events: those of metrics.jsonl (``write``, ``record_only``) and ``mark``'s."""

    def hear(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        """One event, with the values as written (before JSON encoding)."""

    def close(self) -> None:
        """The run's output ends (``MetricsWriter.close``)."""


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class LineProgress:
    """tqdm's ``update``/``set_postfix``/``close`` as one stdout line every ``every`` steps (and at the end)."""

    def __init__(self, total: int, initial: int, desc: str, every: int) -> None:
        self.total, self.n, self.desc, self.every = total, initial, desc, max(1, every)
        self._postfix: dict[str, Any] = {}
        self._printed = initial
        self._t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        before = self.n
        self.n += n
        if self.n // self.every > before // self.every or self.n >= self.total:
            self._line()

    def set_postfix(self, **values: Any) -> None:
        self._postfix = values

    def _line(self) -> None:
        extra = "".join(f", {k}={v}" for k, v in self._postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total} ({time.perf_counter() - self._t0:.0f} s{extra})", flush=True)
        self._printed = self.n

    def close(self) -> None:
        if self.n != self._printed:
            self._line()


class MetricsWriter:
    """metrics.jsonl, TensorBoard scalars and console lines; a no-op on every rank but the chief."""

    def __init__(self, output_dir: Path, enabled: bool, listeners: Sequence[Listener] = ()) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._listeners = tuple(listeners) if enabled else ()
        self._fault = None
        if enabled:
            import tensorflow as tf

            # Imported here, not at the top: slurm/env.sh loads this file by its path, without the hvrep package.
            from hvrep.train import faultpoint

            if faultpoint.ARMED:  # the fault campaign's point (benchmarks/faults.py); None otherwise
                self._fault = faultpoint.reached

            output_dir.mkdir(parents=True, exist_ok=True)
            _end_torn_line(output_dir / "metrics.jsonl")
            self._file = open(output_dir / "metrics.jsonl", "a")
            self._tb = tf.summary.create_file_writer(str(output_dir / "tensorboard"))

    def write(self, event: str, step: int | None = None, **values: Any) -> None:
        """Appends one record ``{"event", "time", "step"?, **values}``; numbers also go to TensorBoard at ``step``."""
        if not self.enabled or self._file is None:
            return
        record = {"event": event, "time": time.time(), **({"step": step} if step is not None else {}), **values}
        if self._fault is not None:
            self._fault("metrics.write", where=Path(self._file.name).parent)
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        self._tell(event, step, values)
        if self._tb is not None and step is not None:
            import tensorflow as tf

            with self._tb.as_default(step=step):
                for k, v in values.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        tf.summary.scalar(f"{event}/{k}", v)

    def image(self, name: str, step: int, picture: Any) -> None:
        """Writes one picture (H, W, 3) uint8 to TensorBoard's images at ``step`` (an app's samples)."""
        if self._tb is None:
            return
        import tensorflow as tf

        with self._tb.as_default(step=step):
            tf.summary.image(name, tf.convert_to_tensor(picture)[None], max_outputs=1)

    def record_only(self, event: str, **values: Any) -> None:
        """Appends one record to metrics.jsonl and nothing to TensorBoard: safe from another thread while the
        main thread is blocked inside TensorFlow (the hang watchdog's last words)."""
        if self.enabled and self._file is not None:
            self._file.write(json.dumps({"event": event, "time": time.time(), **values}, default=str) + "\n")
            self._file.flush()
            self._tell(event, None, values)

    def mark(self, event: str, **values: Any) -> None:
        """A moment the listeners hear and metrics.jsonl does not record ("epoch_start", "eval_start")."""
        self._tell(event, None, values)

    def _tell(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        for listener in self._listeners:
            listener.hear(event, step, values)

    def say(self, line: str) -> None:
        """Prints ``line`` to stdout on the chief."""
        if self.enabled:
            print(line, flush=True)

    def progress(self, total: int, initial: int, desc: str, every: int = 0) -> Any:
        """Progress on the chief only: a tqdm bar when stderr is a terminal, else a plain line every ``every`` steps.

        ``horovodrun`` and ``mpirun`` pipe a rank's output and prefix each
        chunk (``[0]<stderr>:``), so a bar's carriage returns would become
        thousands of fragments in a log; lines stay readable (``every`` 0:
        about ten lines an epoch).
        """
        if self.enabled and not _is_terminal(sys.stderr):
            return LineProgress(total, initial, desc, every or max(1, total // 10))
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not self.enabled,
                    file=sys.stderr, leave=False)

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.flush()
