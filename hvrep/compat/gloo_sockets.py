"""Closes the TCP connections of a Gloo world that Horovod 0.28.1 leaves open after ``hvd.shutdown()``.

Under Horovod's elastic driver, a worker that notices a dead peer shuts Horovod down and waits in ``hvd.init()``
for the new world. Its old Gloo connections stay ESTABLISHED there (Horovod's shutdown does not free the old
Gloo contexts: seen with ``ss -tnp`` on a worker waiting in ``hvd.init()``). A third worker that is waiting to
*receive* from that worker (Gloo's ring all-reduce receives from rank + 1; for instance in Horovod's
``GlooController::CrossRankBitwiseAnd``) is then never woken: its connection never closes, so its receive
fails only at ``HOROVOD_GLOO_TIMEOUT_SECONDS``. Shutting those connections down (``shutdown(2)``, which sends
the FIN at once) makes the waiting worker's Gloo pair read end-of-file and fail its pending receive, as it does
when the peer process dies.

Which sockets: Horovod's own, those its C++ background thread connected while ``hvd.init()`` ran (recorded by
:func:`recorded`), told apart from what other threads of this process opened in that window: a connection any
Python code connected or bound then (seen through Python's audit events ``socket.connect`` and ``socket.bind``,
on whichever thread) is not Horovod's, nor is one accepted by a socket that is still listening (Gloo's pairs
accept on listeners they close once connected). The rest that is still a connected TCP socket with the same inode
after ``hvd.shutdown()`` is shut down. The file descriptors stay open (Horovod's leaked objects own them); only the
connection is shut down. Linux only (``/proc/self/fd``); elsewhere a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

_FD_DIR = "/proc/self/fd"
# (fd, "socket:[inode]") of the connections the last hvd.init() opened.
_world: set[tuple[int, str]] = set()
# Descriptors Python code connected or bound while a recorded block ran: another thread's, not Horovod's.
_python: set[int] = set()
_watching = threading.Event()
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Called for every audit event of the process, for ever (a hook cannot be removed): return at once unless a
    # recorded block runs.
    if not _watching.is_set() or event not in ("socket.connect", "socket.bind"):
        return
    with contextlib.suppress(Exception):
        _python.add(args[0].fileno())


def _sockets() -> set[tuple[int, str]]:
    """This process's open sockets as (fd, "socket:[inode]"); empty where /proc is missing."""
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return set()
    found = set()
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(os.path.join(_FD_DIR, name))
            if target.startswith("socket:["):
                found.add((int(name), target))
    return found


def _tcp(fd: int) -> tuple[bool, tuple[Any, ...] | None]:
    """(listening, local address) of the TCP socket ``fd``; (False, None) for any other descriptor."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=fd)
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)), sock.getsockname()
        finally:
            sock.detach()
    return False, None


def _horovods(new: set[tuple[int, str]], python: set[int], everything: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """The sockets of ``new`` that Horovod opened: not Python's, not accepted by a listener that is still open."""
    listening = set()
    for fd, _ in everything:
        listens, local = _tcp(fd)
        if listens and local is not None:
            listening.add(local[:2])
    found = set()
    for fd, inode in new:
        if fd in python:
            continue
        _, local = _tcp(fd)
        if local is not None and local[:2] not in listening:
            found.add((fd, inode))
    return found


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Records the sockets Horovod opens inside the block (around ``hvd.init()``) as the world's connections."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    before = _sockets()
    _python.clear()
    _watching.set()
    try:
        yield
    finally:
        _watching.clear()
        after = _sockets()
        _world.clear()
        _world.update(_horovods(after - before, set(_python), after))
        _python.clear()


def world_connections() -> set[tuple[int, str]]:
    """The connections recorded by the last :func:`recorded` block, as (fd, "socket:[inode]")."""
    return set(_world)


def shut_down_world() -> int:
    """``shutdown(SHUT_RDWR)`` on each recorded connection still open and connected; returns how many.

    Call only after ``hvd.shutdown()`` returned: nothing of Horovod's uses these connections any more.
    """
    still = _sockets()
    done = 0
    for fd, _inode in sorted(_world & still):
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.getpeername()  # raises on a listening or unconnected socket: left alone
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            finally:
                sock.detach()  # the descriptor stays open: its owner closes it
    _world.clear()
    return done
