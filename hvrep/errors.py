"""Typed errors. Each message names the thing, shows the value and says the fix (STYLE.md, principle 6)."""

from __future__ import annotations

from dataclasses import dataclass


class HvrepError(Exception):
    """Base class of every error hvrep raises on purpose."""

    # Autograph re-raises an error from inside tf.function as the same type
    # only when its __init__ is Exception's; otherwise users would get a
    # generic StagingError instead of the typed hvrep error.
    __init__ = Exception.__init__


class SetupError(HvrepError):
    """The environment lacks something hvrep needs (a package, a build, a tool)."""


class LauncherError(HvrepError):
    """The launcher's environment variables contradict each other or are malformed."""


class ConfigError(HvrepError, ValueError):
    """A configuration value is unknown or out of range."""


class CollectiveError(HvrepError, ValueError):
    """A collective was misused: outside ``Replicator.run``, an unknown op, a dtype a backend cannot reduce."""


class ReplicaMismatchError(HvrepError):
    """Replicas issued different collectives (shapes, dtypes, order); continuing would hang."""


class ScopeError(HvrepError):
    """A variable that must start identical on every replica was created outside ``Replicator.scope()``."""


class DataError(HvrepError):
    """A data set is missing, malformed or corrupt; the message names the file."""


class CheckpointError(HvrepError):
    """A checkpoint could not be written or read; the message names the directory or folder."""


class KernelError(HvrepError):
    """A fused kernel was required (``use_kernel=True``) but cannot run; the message says why."""


class WatchdogError(HvrepError):
    """hvrep's hang watchdog cannot start: no port to listen on in the range, or an address it cannot bind."""


@dataclass(frozen=True)
class ExitCode:
    """One exit code an hvrep process leaves with, what it means and what ``slurm/preemptible.sbatch`` does.

    Attributes:
      code: the process's exit status.
      name: a short name ("hang").
      stopped: the ``stopped`` value of ``hvrep train``'s ``final`` event in ``metrics.jsonl``, or None when
        none is written.
      meaning: when a process exits with it.
      requeue: whether ``slurm/preemptible.sbatch`` requeues the job on it (a transient failure) or not (one
        that would fail the same way again).
    """

    code: int
    name: str
    stopped: str | None
    meaning: str
    requeue: bool


# Every exit code hvrep uses, read from here by the watchdog, the "Exit codes" table of docs/troubleshooting.md and
# the tests (tests/unit/replica/test_exit_codes.py checks that table and slurm/preemptible.sbatch against it).
EXIT_OK = ExitCode(0, "ok", None, "the run ended normally (completed, max_steps, target_accuracy), or stopped "
                   "cleanly on SIGTERM/SIGUSR1/Ctrl-C with a checkpoint (final event stopped=\"signal\": "
                   "requeued)", False)
EXIT_ERROR = ExitCode(1, "error", None, "an uncaught Python error (under `python -m mpi4py`, MPI_Abort ends "
                      "every rank with it); horovodrun also exits 1 whenever a rank exits non-zero", False)
EXIT_USAGE = ExitCode(2, "usage", None, "`hvrep train` refused its configuration or data with a typed hvrep "
                      "error (the message says the fix), or argparse refused its flags", False)
EXIT_MISMATCH = ExitCode(65, "mismatch", "mismatch", "hvrep's watchdog: the ranks wait in different collectives "
                         "(uneven input_fn, a collective on some ranks only); deterministic, so it would happen "
                         "again (EX_DATAERR)", False)
EXIT_HANG = ExitCode(75, "hang", "timeout", "hvrep's watchdog: a collective waited past comm.timeout_s (a rank "
                     "stopped, dead, or stuck elsewhere); transient (EX_TEMPFAIL)", True)
EXIT_INTERRUPTED = ExitCode(130, "interrupted", None, "`hvrep train` got Ctrl-C before training started, or a "
                            "second Ctrl-C: nothing new was saved (the shell's 128 + SIGINT)", False)
EXIT_NO_SPACE = ExitCode(74, "no_space", None, "`hvrep train` could not write its output (a checkpoint or "
                         "metrics.jsonl): the output file system is full (ENOSPC) or over quota (EDQUOT); the "
                         "checkpoints completed before are intact (EX_IOERR)", False)
EXIT_CODES: tuple[ExitCode, ...] = (EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH, EXIT_NO_SPACE, EXIT_HANG,
                                    EXIT_INTERRUPTED)
