"""A worker that Horovod's elastic driver drops: one line and an exit, not a C++ abort.

When the host discovery script stops listing a worker's host, the worker re-forms the world like the others
(``hvd.shutdown()``, ``hvd.init()``), and Horovod 0.28.1 learns only inside ``hvd.init()``, in its background
thread, that the driver's rendezvous has no place for it: ``gloo_context.cc`` throws
``std::runtime_error("<host>[<slot>] has been removed from elastic job")`` there, nothing catches it, and the
process prints libstdc++'s ``terminate called after throwing an instance of 'std::runtime_error'`` and aborts
(exit 134; the driver ignores the exit of a dropped worker).

While the world re-forms, :func:`one_line_on_removal` installs a C++ terminate handler (``std::set_terminate``
through ctypes) that names the exception in one line and exits: 0 when the worker was removed (the job goes on
without it, as asked), 1 for any other exception thrown there. The exception's type and ``what()`` are read
through the Itanium C++ ABI that GCC and Clang share on Linux (``__cxa_current_exception_type``, and
``what()``, the third slot of a ``std::exception``'s vtable, after its two destructors), for the standard and
Gloo exception types only; another type is named without its message. Where libstdc++ cannot be loaded
(another platform) nothing is installed and Horovod's own behaviour stays.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator

_REMOVED = "has been removed from elastic job"
# Mangled names of the exception classes whose what() is read: std::exception and its standard subclasses
# that Horovod and Gloo throw, and Gloo's own (gloo/common/error.h: all derive from std::runtime_error).
_STD_EXCEPTIONS = frozenset({"St9exception", "St13runtime_error", "St11logic_error", "St12out_of_range",
                             "St16invalid_argument", "N4gloo9ExceptionE", "N4gloo11IoExceptionE",
                             "N4gloo16EnforceNotMetE"})
_HANDLER = ctypes.CFUNCTYPE(None)
_WHAT = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)


def _libstdcxx() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    except OSError:
        return None


def _current_exception(lib: ctypes.CDLL) -> tuple[str, str | None]:
    """The exception being handled: its type's mangled name and, for a std::exception, its what()."""
    type_of = lib.__cxa_current_exception_type
    type_of.restype = ctypes.c_void_p
    info = type_of()
    if not info:
        return "", None
    # std::type_info: a vtable pointer, then the mangled name.
    name = ctypes.cast(info + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p))[0]
    mangled = (name or b"").decode(errors="replace").lstrip("*")
    if mangled not in _STD_EXCEPTIONS:
        return _demangled(lib, mangled), None
    # std::current_exception() returns a std::exception_ptr (one pointer, to the thrown object) through a
    # hidden result pointer, as any class with a destructor; its reference is never released: the process ends.
    current = lib._ZSt17current_exceptionv
    current.argtypes, current.restype = [ctypes.c_void_p], None
    holder = ctypes.c_void_p()
    current(ctypes.byref(holder))
    if not holder.value:
        return _demangled(lib, mangled), None
    vtable = ctypes.cast(holder.value, ctypes.POINTER(ctypes.c_void_p))[0]
    what = _WHAT(ctypes.cast(vtable, ctypes.POINTER(ctypes.c_void_p))[2])(holder.value)
    return _demangled(lib, mangled), (what or b"").decode(errors="replace")


def _demangled(lib: ctypes.CDLL, mangled: str) -> str:
    """``std::runtime_error`` for ``St13runtime_error`` (``abi::__cxa_demangle``); the mangled name if that fails."""
    demangle = lib.__cxa_demangle
    demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    demangle.restype = ctypes.c_void_p
    status = ctypes.c_int(-1)
    out = demangle(mangled.encode(), None, None, ctypes.byref(status))
    return ctypes.string_at(out).decode(errors="replace") if out and status.value == 0 else mangled


@contextlib.contextmanager
def one_line_on_removal(what_this_is: str) -> Iterator[None]:
    """Within the block (``hvd.init()`` re-forming an elastic world), an exception Horovod's thread does not catch
    ends the process with one line on stderr instead of libstdc++'s abort: exit 0 when the driver removed this
    worker, 1 otherwise. ``what_this_is`` names the process in that line (e.g. "hvrep: elastic worker")."""
    lib = _libstdcxx()
    if lib is None:
        yield
        return

    def on_terminate() -> None:
        try:
            mangled, what = _current_exception(lib)
        except Exception as e:  # reading the exception must not stop the one line
            mangled, what = "", f"(the exception could not be read: {e})"
        if what is not None and _REMOVED in what:
            line = (f"{what_this_is}: the elastic driver dropped this worker ({what.strip()}: the host discovery "
                    "script no longer lists its host); it exits, the job goes on without it")
            code = 0
        else:
            line = (f"{what_this_is}: Horovod failed while the elastic world re-formed: {mangled or 'an exception'}"
                    + (f": {what.strip()}" if what else ""))
            code = 1
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(code)

    handler = _HANDLER(on_terminate)
    set_terminate = lib._ZSt13set_terminatePFvvE
    set_terminate.argtypes, set_terminate.restype = [ctypes.c_void_p], ctypes.c_void_p
    previous = set_terminate(ctypes.cast(handler, ctypes.c_void_p))
    try:
        yield
    finally:
        set_terminate(previous)
