"""The hang watchdog's native markers (kernels/tf/watch.cc), or None where the fused kernels are not loaded.

:mod:`hvrep.replica.activity` records which collectives a rank is inside. With these, the two markers around
each collective in a traced step are ops that take a mutex, instead of ``tf.py_function`` calls that each take
Python's GIL and run Python (about 50 us apiece on a quiet core, on the step's critical path). Where the kernels
are not built, cannot load or are switched off (``HVREP_KERNELS=off``), the activity keeps its Python table and
``tf.py_function`` markers: the same records, slower.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from hvrep.kernels import loader

# Values hvrep_watch_snapshot writes before the pending calls: the last completed call, its label, when (ns).
_HEAD = 3


@dataclass(frozen=True)
class Snapshot:
    """One table's state. Times are ``time.monotonic()`` seconds (the C side reads the same clock)."""

    last_call: int
    last_label: int  # -1: none completed yet
    last_time: float
    pending: tuple[tuple[int, int, float], ...]  # (call, label id, entered), oldest call first


class Native:
    """The marker ops and the C functions that own the tables (one per Activity)."""

    def __init__(self, ops: Any, lib: ctypes.CDLL) -> None:
        self._ops, self._lib = ops, lib
        i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
        for name, args, res in (("hvrep_watch_new", [], i64), ("hvrep_watch_free", [i64], None),
                                ("hvrep_watch_bind", [i64], None), ("hvrep_watch_enter", [i64, i64], i64),
                                ("hvrep_watch_leave", [i64, i64], None),
                                ("hvrep_watch_snapshot", [i64, p64, i64], i64)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res

    def new(self) -> int:
        return int(self._lib.hvrep_watch_new())

    def free(self, table: int) -> None:
        self._lib.hvrep_watch_free(table)

    def bind(self, table: int) -> None:
        """Traced markers record into ``table`` from now on (0: into none)."""
        self._lib.hvrep_watch_bind(table)

    def enter(self, table: int, label: int) -> int:
        return int(self._lib.hvrep_watch_enter(table, label))

    def leave(self, table: int, call: int) -> None:
        self._lib.hvrep_watch_leave(table, call)

    def snapshot(self, table: int) -> Snapshot:
        cap = _HEAD + 3 * 64
        while True:
            buf = (ctypes.c_int64 * cap)()
            n = int(self._lib.hvrep_watch_snapshot(table, buf, cap))
            if n < 0:
                raise ValueError(f"no watchdog table {table}")
            if _HEAD + 3 * n <= cap:
                break
            cap = _HEAD + 3 * n + 3 * 64  # more pending than fitted (they may grow meanwhile: ask again)
        pending = tuple((buf[i], buf[i + 1], buf[i + 2] / 1e9) for i in range(_HEAD, _HEAD + 3 * n, 3))
        return Snapshot(buf[0], buf[1], buf[2] / 1e9, pending)

    def enter_op(self, label: int) -> tf.Tensor:
        """An op marking the bound table's rank inside collective ``label`` when it runs; a token for leave_op."""
        return self._ops.hvrep_watch_enter(label=label, name="hvrep_watchdog_enter")

    def leave_op(self, token: tf.Tensor) -> tf.Tensor:
        return self._ops.hvrep_watch_leave(token, name="hvrep_watchdog_leave")


@functools.cache
def native() -> Native | None:
    """The native markers, or None where the fused kernels are not loaded (or predate them)."""
    found = loader.with_library("hvrep_watch_enter")
    return None if found is None else Native(*found)
