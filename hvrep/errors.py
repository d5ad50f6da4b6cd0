"""Typed errors. Each message names the thing, shows the value and says the fix (STYLE.md, principle 6)."""

from __future__ import annotations


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
