"""Closes the TCP connections of a Gloo world that Horovod 0.28.1 leaves open after ``hvd.shutdown()``.

Under Horovod's elastic driver, a worker that notices a dead peer shuts Horovod down and waits in ``hvd.init()``
for the new world. Its old Gloo connections stay ESTABLISHED there (Horovod's shutdown does not free the old
Gloo contexts: seen with ``ss -tnp`` on a worker waiting in ``hvd.init()``). A third worker that is waiting to
*receive* from that worker (Gloo's ring all-reduce receives from rank + 1; for instance in Horovod's
``GlooController::CrossRankBitwiseAnd``) is then never woken: its connection never closes, so its receive
fails only at ``HOROVOD_GLOO_TIMEOUT_SECONDS``. Shutting those connections down (``shutdown(2)``, which sends
the FIN at once) makes the waiting worker's Gloo pair read end-of-file and fail its pending receive, as it does
when the peer process dies.

Which sockets: those this process opened during ``hvd.init()`` (recorded by :func:`recorded`) that are still
connected TCP sockets with the same inode after ``hvd.shutdown()``. The file descriptors stay open (Horovod's
leaked objects own them); only the connection is shut down. Linux only (``/proc/self/fd``); elsewhere a no-op.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

_FD_DIR = "/proc/self/fd"
# (fd, "socket:[inode]") of the connections the last hvd.init() opened.
_world: set[tuple[int, str]] = set()


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


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Records the sockets opened inside the block (around ``hvd.init()``) as the world's connections."""
    before = _sockets()
    try:
        yield
    finally:
        _world.clear()
        _world.update(_sockets() - before)


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
