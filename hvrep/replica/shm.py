"""hvrep's shared-memory all-reduce for ranks on one host: where it applies, and opening it.

Horovod reaches the other ranks of a host through its controller's transport, behind its background thread:
under ``horovodrun --gloo`` that is TCP over loopback (1.9 ms for the D4PG learner's 589 KB on 2 ranks here,
where the learner's step takes 1.4 ms alone). hvrep's in-step reductions are buckets it has already fused, so
where every rank is on one host it sums them itself (kernels/tf/shm.cc): every rank maps one file, copies its
bucket in (from the tensors themselves: ``Backend._reduce_parts``, no packed copy first), sums its 1/N share
across the ranks and copies the whole sum out, with no network. Sums are taken in rank order, the same bits on
every rank.

It applies to the horovod backend's in-step floating-point sums and means (``Backend._reduce_parts`` and
``_reduce_wire``: the buckets of ``all_reduce``, ``wrap_optimizer``, ``hvrep.keras``, PowerSGD and local SGD),
traced, on CPU tensors. Everything else stays Horovod's: eager ``reduce``, broadcasts, gathers, max/min and
integer sums, any rank with a GPU (NCCL's), more than one host, elastic training (its world changes under it).

Opening it is collective: every rank of the job creates its Replicator together, so the handshake below runs
a fixed sequence of Horovod's eager collectives on every rank, and every rank reaches the same answer.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from hvrep import _env
from hvrep.errors import ConfigError, SetupError
from hvrep.kernels import shm as native_shm

_log = logging.getLogger("hvrep")

# Bytes of one chunk of a collective (a bucket larger than this goes in chunks, each rank's part of one staying in
# its core's cache between the copy in, the sum and the copy out). Measured side by side under mpirun on 2 ranks
# (benchmarks/step_overhead.py, 2026-11-27): 4 MB all-reduces took 729-930 us with 256 KiB chunks, 853-1,111 with
# 1 MiB, 975-1,583 with 4 MiB (Open MPI's 959-1,193 in the same runs); 32 MB 5.7-7.7 ms, 5.7-7.5, 8.2-9.1. The file
# holds 2N + 2 chunks: 1.5 MiB for 2 ranks, 4.5 MiB for 8. Where /dev/shm has less than twice that free the chunk
# shrinks, down to MIN_CAP_BYTES; below that the file goes to the temporary folder instead.
CAP_BYTES = 256 << 10
MIN_CAP_BYTES = 64 << 10
_SHM_DIR = "/dev/shm"

_open: native_shm.Native | None = None  # this process's open transport (one world: not elastic)
_open_size = 0
_open_pid = 0  # the process that opened it: a forked child inherits the mapping but not the progress thread


def setting(config_value: str) -> str:
    """The transport asked for: CommConfig's value, or HVREP_LOCAL_TRANSPORT where that is "auto" and it is set."""
    if config_value != "auto":
        return config_value
    env = _env.local_transport_setting()
    if env in ("", "auto"):
        return "auto"
    if env not in ("horovod", "shm"):
        raise ConfigError(f"{_env.HVREP_LOCAL_TRANSPORT}={env!r} is not a local transport. Fix: 'horovod' (Horovod's "
                          "collectives), 'shm' (hvrep's shared-memory all-reduce) or unset (CommConfig decides).")
    return env


_ONE_RANK = "one rank: nothing to reduce across"
_ELASTIC = "elastic training (the world changes under the file)"
_GPU = "this rank has a GPU (its reductions are NCCL's)"
_NO_KERNELS = "hvrep's kernels are not loaded (`make setup`, `hvrep doctor`)"


def why_not(*, size: int, local_size: int, elastic: bool, gpu: bool) -> str:
    """Why the shared-memory all-reduce cannot serve this rank ("" where it can)."""
    if size < 2:
        return _ONE_RANK
    if local_size != size:
        return f"{size} ranks on several hosts ({local_size} on this one)"
    if elastic:
        return _ELASTIC
    if gpu:
        return _GPU
    if native_shm.native() is None:
        return _NO_KERNELS
    return ""


def per_rank(reason: str) -> bool:
    """Whether :func:`why_not`'s ``reason`` can differ between the ranks of one job (a GPU, the kernels), so that
    the ranks must agree; one rank, several hosts and elastic training hold for every rank alike."""
    return reason in (_GPU, _NO_KERNELS)


def _place(size: int) -> tuple[str, int]:
    """The folder for the file and the chunk size: /dev/shm where it has room, else the temporary folder."""
    nat = native_shm.native()
    assert nat is not None
    if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK):
        st = os.statvfs(_SHM_DIR)
        free = st.f_bavail * st.f_frsize
        cap = CAP_BYTES
        while cap > MIN_CAP_BYTES and nat.file_bytes(size, cap) > free // 2:
            cap //= 2
        if nat.file_bytes(size, cap) <= free // 2:
            return _SHM_DIR, cap
    return tempfile.gettempdir(), CAP_BYTES


def _create(size: int) -> tuple[str, str, int, str]:
    """Rank 0: a private folder with an empty private file in it. (folder, file, chunk bytes, error)."""
    parent, cap = _place(size)
    try:
        folder = tempfile.mkdtemp(prefix="hvrep-shm-", dir=parent)  # 0700: only this user opens the file
        path = os.path.join(folder, "allreduce")
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600))
    except OSError as e:
        return "", "", 0, f"could not create the file in {parent}: {e}"
    return folder, path, cap, ""


def open_transport(rank: int, size: int, reason: str, asked: str, agree: Callable[[bool], bool],
                   share: Callable[[Any], Any]) -> native_shm.Native | None:
    """Opens the transport on every rank, or on none (the same answer everywhere).

    Args:
      rank, size: this rank and the world's size.
      reason: :func:`why_not` for this rank ("" where it applies).
      asked: "auto" or "shm" (:func:`setting`); "shm" raises where it cannot open.
      agree: True on every rank iff it is True on every rank (an all-reduce of the flags, min).
      share: rank 0's value on every rank (a broadcast).

    Returns:
      The open transport, or None (Horovod's collectives serve).

    Raises:
      hvrep.errors.SetupError: ``asked`` is "shm" and it cannot open, on every rank alike.
    """
    global _open, _open_size, _open_pid
    if _open is not None and _open_size == size and _open.is_open() and _open_pid == os.getpid():
        return _open  # a later Replicator of the same world: every rank has it open
    if not agree(reason == ""):
        return refused(asked, reason or "another rank cannot use it (its log says why)")
    nat = native_shm.native()
    assert nat is not None
    folder, err, cap = "", "", 0
    try:
        if rank == 0:
            folder, path, cap, err = _create(size)
            if not err:
                err = nat.open(path, 0, size, cap, create=True)
            path, cap = share((path, cap) if not err else ("", 0))
        else:
            path, cap = share(None)
            err = nat.open(path, rank, size, cap, create=False) if path else "rank 0 could not create the file"
        if not agree(err == ""):
            nat.close()
            return refused(asked, err or "another rank could not open the file (its log says why)")
        if not agree(nat.peers_seen() == size):
            nat.close()
            return refused(asked, "a rank cannot see the others' processes (separate pid namespaces)")
    finally:
        if folder:  # every rank has it mapped (or gave up): nothing is left on disk
            shutil.rmtree(folder, ignore_errors=True)
    _open, _open_size, _open_pid = nat, size, os.getpid()
    return nat


def stats() -> dict[str, int] | None:
    """This process's shared-memory all-reduce since it opened, where it is open (else None): collectives, chunks
    and bytes, and nanoseconds summed over the collectives (``hvrep.kernels.shm.STATS``). Take two and subtract
    to split a stretch of steps' all-reduce into its parts (benchmarks/d4pg.py --learner-only)."""
    if _open is None or _open_pid != os.getpid():
        return None
    return _open.stats()


def refused(asked: str, reason: str) -> None:
    """None (Horovod's collectives serve), or for ``asked`` "shm" a SetupError with the reason."""
    if asked == "shm":
        raise SetupError(f"CommConfig(local_transport='shm') (or {_env.HVREP_LOCAL_TRANSPORT}=shm) cannot apply: "
                         f"{reason}. Fix: local_transport='auto' lets Horovod's collectives serve where it cannot.")
    _log.debug("hvrep: the shared-memory all-reduce does not apply (%s); Horovod's collectives serve", reason)


@atexit.register
def _close_at_exit() -> None:
    if _open is not None and _open_pid == os.getpid():  # not in a forked child: its thread is the parent's
        _open.close()
