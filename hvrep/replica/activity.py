"""What a rank is doing, for the hang watchdog (:mod:`hvrep.replica.watchdog`): the collectives it is inside.

:class:`Watched` wraps Horovod's module so that each collective function marks itself: eagerly around the call,
and in a traced step with a marker op before the collective's op and one that runs once its result exists, so
the mark follows the op as it executes, not as it is traced. The marks go to an :class:`Activity`, the table the
watchdog's heartbeat reads; traced marks go to the activity bound as this process's (:func:`bind`), found when
the step executes.

Where hvrep's kernels are loaded (``make setup``; :mod:`hvrep.kernels.watch`) the table lives in C++ and the
markers are two ops that take a mutex. Otherwise it is a Python dict and the markers are ``tf.py_function``
calls, each taking Python's GIL: about 50 us apiece on a quiet core, on the step's critical path, 2 per
collective (docs/performance.md measures both: ``benchmarks/step_overhead.py``'s breakdown).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from hvrep.kernels import watch as native_watch

# At most this many labels of the collectives a rank is inside travel in a heartbeat.
_WAITING_SHOWN = 16


def _now() -> float:
    return time.monotonic()


# Labels travel to the native table as ids (an op attribute); one process-wide list, append-only.
_LABELS: list[str] = []
_LABEL_IDS: dict[str, int] = {}
_LABELS_LOCK = threading.Lock()


def _label_id(label: str) -> int:
    with _LABELS_LOCK:
        found = _LABEL_IDS.get(label)
        if found is None:
            found = _LABEL_IDS[label] = len(_LABELS)
            _LABELS.append(label)
        return found


def _label(label_id: int) -> str:
    return _LABELS[label_id] if 0 <= label_id < len(_LABELS) else f"label #{label_id}"


class Activity:
    """What this rank is doing: the collectives it is inside, entered and left from TensorFlow's threads.

    Its table is native (:mod:`hvrep.kernels.watch`; a mutex, no Python, no I/O) where the kernels are loaded,
    else Python (a counter and single dict operations, atomic under the GIL). ``native=False`` asks for the
    Python table.
    """

    def __init__(self, native: bool | None = None) -> None:
        self._native = native_watch.native() if native is not False else None
        self._table = self._native.new() if self._native is not None else 0
        self._calls = itertools.count(1)
        self._pending: dict[int, tuple[str, float]] = {}  # call number -> (label, monotonic time entered)
        self._last: tuple[int, str] = (0, "starting")  # the last collective that completed
        self._since = _now()  # when it completed, or when this activity began
        self.step = ""  # the step the training loop noted, if any

    @property
    def is_native(self) -> bool:
        return self._native is not None

    def enter(self, what: str) -> int:
        if self._native is not None:
            return self._native.enter(self._table, _label_id(what))
        call = next(self._calls)
        self._pending[call] = (what, _now())
        return call

    def leave(self, call: int) -> None:
        if self._native is not None:
            self._native.leave(self._table, call)
            return
        entry = self._pending.pop(call, None)
        if entry is not None:
            self._last, self._since = (call, entry[0]), _now()

    @contextlib.contextmanager
    def inside(self, what: str) -> Iterator[None]:
        """Marks one collective, eagerly, from entry to return."""
        call = self.enter(what)
        try:
            yield
        finally:
            self.leave(call)

    def _state(self) -> tuple[dict[int, tuple[str, float]], tuple[int, str], float]:
        if self._native is None:
            return self._pending.copy(), self._last, self._since
        snap = self._native.snapshot(self._table)
        pending = {call: (_label(label), entered) for call, label, entered in snap.pending}
        if snap.last_label < 0:
            return pending, (0, "starting"), self._since
        return pending, (snap.last_call, _label(snap.last_label)), snap.last_time

    @property
    def pending(self) -> dict[int, tuple[str, float]]:
        """call number -> (label, monotonic time entered), for the collectives this rank is inside."""
        return self._state()[0]

    @property
    def last(self) -> tuple[int, str]:
        """(call number, label) of the last collective that completed; (0, "starting") before any."""
        return self._state()[1]

    def snapshot(self) -> dict[str, Any]:
        pending, (call, what), since = self._state()
        now = _now()
        if pending:
            call = min(pending)
            what, entered = pending[call]
            labels = sorted({w for w, _ in pending.values()})
            return {"call": call, "what": what, "in": True, "age": round(now - entered, 2), "step": self.step,
                    "waiting": labels[:_WAITING_SHOWN], "more": len(labels) > _WAITING_SHOWN}
        return {"call": call, "what": what, "in": False, "age": round(now - since, 2), "step": self.step}

    def close(self) -> None:
        """Frees the native table (a traced marker still holding a token of it then records nothing)."""
        if self._native is not None and self._table:
            self._native.free(self._table)
            self._table = 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# --- the activity traced markers record into ---------------------------------------------------------------

_BOUND: Activity | None = None


def bind(activity: Activity | None) -> None:
    """Makes ``activity`` the one traced markers record into when they execute (None: none; markers then do
    nothing). A graph traced while none is bound gets no markers at all."""
    global _BOUND
    _BOUND = activity
    nat = native_watch.native()
    if nat is not None:
        nat.bind(activity._table if activity is not None and activity.is_native else 0)


def bound() -> Activity | None:
    return _BOUND


# --- the one mechanism that marks every collective ---------------------------------------------------------

# Horovod's collective functions (horovod.tensorflow): each is marked when called through `Watched`.
HOROVOD_COLLECTIVES = frozenset({
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join", "broadcast_object",
    "allgather_object", "broadcast_variables"})


class Watched:
    """Horovod's module, each collective function of which marks itself in the bound activity.

    The horovod backend holds Horovod through this, so every collective hvrep
    issues is watched wherever it runs: eagerly, around the call; in a traced
    step, by a marker op that runs before the collective's op and one that
    runs once its result exists. A graph traced while no activity is bound
    gets no markers; one traced with markers finds the bound activity when it
    executes. Other attributes are Horovod's own.

    Args:
      module: ``horovod.tensorflow``.
      context: what the caller is doing (e.g. "run(step_fn)"), asked when a collective is issued (traced or
        eager); the label it makes must be the same on every rank for the same collective.
    """

    def __init__(self, module: Any, context: Callable[[], str]) -> None:
        self._module, self._context = module, context

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name in HOROVOD_COLLECTIVES and callable(value):
            return functools.partial(_watched_call, name, value, self._context, None)
        return value


def watched(fn: Callable[..., Any], op: str, context: Callable[[], str], describe: Any = None) -> Callable[..., Any]:
    """``fn`` (a collective outside Horovod's module: hvrep's shared-memory all-reduce) marked as Watched marks
    Horovod's: the watchdog sees a rank inside it, labelled ``op`` and its first argument's dtypes and shapes, or
    ``describe``'s where given (a ``tf.TensorSpec`` of the buffer a collective of a bucket's parts reduces, so its
    label reads as the packed buffer's does on every transport)."""
    return functools.partial(_watched_call, op, fn, context, describe)


def _signature(value: Any) -> str:
    flat = tf.nest.flatten(value) if value is not None else []
    parts = [f"{t.dtype.name}{t.shape.as_list()}" for t in flat[:4] if hasattr(t, "dtype") and hasattr(t, "shape")]
    return ",".join(parts) + (f",+{len(flat) - 4}" if len(flat) > 4 else "")


def _watched_call(op: str, fn: Callable[..., Any], context: Callable[[], str], describe: Any, /, *args: Any,
                  **kwargs: Any) -> Any:
    # Positional-only: Horovod's own functions take `name=`.
    activity = _BOUND
    if activity is None:
        return fn(*args, **kwargs)
    label = f"{context()}: {op} {_signature(describe if describe is not None else args[0] if args else None)}"
    label = label.rstrip()
    if tf.executing_eagerly():
        with activity.inside(label):
            return fn(*args, **kwargs)
    entered, leave = _markers(label, activity.is_native)
    with tf.control_dependencies([entered]):
        out = fn(*args, **kwargs)
    with tf.control_dependencies([t for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor | tf.Operation)]):
        left = leave(entered)
    with tf.control_dependencies([left]):
        return tf.nest.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, out)


def _markers(label: str, native: bool) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """The enter marker's token and the leave marker's builder: native ops, or ``tf.py_function`` calls."""
    nat = native_watch.native() if native else None
    if nat is not None:
        return nat.enter_op(_label_id(label)), nat.leave_op
    entered = tf.py_function(functools.partial(_enter, label), [], tf.int64, name="hvrep_watchdog_enter")
    return entered, lambda token: tf.py_function(_leave, [token], tf.int64, name="hvrep_watchdog_leave")


def _enter(label: str) -> int:
    activity = _BOUND
    return activity.enter(label) if activity is not None else 0


def _leave(call: tf.Tensor) -> int:
    activity = _BOUND
    if activity is not None:
        activity.leave(int(call.numpy()))
    return 0
