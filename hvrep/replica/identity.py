"""Which process a pid is: proof enough to signal it, or to call it gone.

A pid alone names a process only on one kernel, in one pid namespace, until the process ends and the number is
given to another. So a process is recorded with the kernel's boot id (``/proc/sys/kernel/random/boot_id``), its
pid namespace (the ``/proc/<pid>/ns/pid`` link), its pid and its start time (field 22 of ``/proc/<pid>/stat``,
clock ticks after boot). Another process can check such a record only when it runs on the same boot and in the
same pid namespace; otherwise the answer is "cannot tell" (None), never a guess from a hostname, which
containers and nodes named ``localhost`` share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of ``pid``, or None when there is no such process."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    # Field 2, the command, is in parentheses and may hold spaces and ')': the fields after it follow the last ')'.
    rest = text[text.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, as long as it lives: kernel boot, pid namespace, pid, start time.

    Attributes:
      boot_id: the kernel's boot id (a UUID; a reboot changes it).
      pid_ns: the pid namespace's link text, e.g. ``pid:[4026531836]``.
      pid: the process id in that namespace.
      start: the process's start time, clock ticks after boot (field 22 of /proc/<pid>/stat).
    """

    boot_id: str
    pid_ns: str
    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """``pid``'s identity as this process sees it (same namespace), or None when it is gone or unreadable."""
        stat, boot = _stat(pid), _read(_BOOT_ID)
        try:
            ns = os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            # Another user's process: the link is not readable, but it is in our namespace if /proc shows it.
            ns = _own_namespace()
        if stat is None or boot is None or ns is None:
            return None
        return cls(boot, ns, pid, stat[1])

    @classmethod
    def mine(cls) -> ProcessIdentity:
        """This process's identity.

        Raises:
          OSError: /proc is not mounted (not Linux).
        """
        me = cls.of(os.getpid())
        if me is None:
            raise OSError("cannot read this process's identity from /proc (boot_id, ns/pid, stat)")
        return me

    def alive(self) -> bool | None:
        """True: this very process runs; False: it is proven gone; None: it cannot be told from here (another
        boot or another pid namespace than this process's, or /proc unreadable)."""
        boot, ns = _read(_BOOT_ID), _own_namespace()
        if boot is None or ns is None or boot != self.boot_id or ns != self.pid_ns:
            return None
        stat = _stat(self.pid)
        # A zombie has ended (only its exit status waits for its parent); a new start time is another process.
        return stat is not None and stat[0] != "Z" and stat[1] == self.start

    def to_json(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "pid_ns": self.pid_ns, "pid": self.pid, "start": self.start}

    @classmethod
    def from_json(cls, record: Any) -> ProcessIdentity | None:
        """The identity in ``record`` (``to_json``'s), or None when it is not one."""
        try:
            identity = cls(str(record["boot_id"]), str(record["pid_ns"]), int(record["pid"]), int(record["start"]))
        except (KeyError, TypeError, ValueError):
            return None
        return identity if identity.pid > 0 else None


def _own_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
