"""The Keras releases hvrep's reliances on Keras internals were verified against, and the one warning outside.

Two pieces of hvrep depend on what Keras does, not on what it documents:

* :mod:`hvrep.compat.keras_batch_norm` re-implements the training branch of
  ``BatchNormalization.call`` and calls its private ``_moments``;
* ``hvrep.keras.DistributedOptimizer`` recognises the wrong wrapping order
  (``LossScaleOptimizer(DistributedOptimizer(opt))``) by ``LossScaleOptimizer``
  setting its inner optimizer's ``loss_scale_factor`` to None, and relies on
  Keras skipping the assignment of a value an attribute already holds.

``setup.py`` does not pin Keras (``make setup`` installs requirements.txt's
3.15.1), so a user can run hvrep on a Keras these were never checked on.
Outside :data:`VERIFIED`, each piece keeps Keras' own behaviour or says what
it can no longer promise, with one warning per piece per process.
"""

from __future__ import annotations

import logging
import re
import threading

import keras

# [first, end): the Keras releases both pieces were checked on (the fidelity and batch-norm tests pass).
# Widen it after running tests/unit/blocks/test_fused_batch_norm.py and tests/unit/keras on the new release.
VERIFIED = ((3, 15, 0), (3, 16, 0))

KERAS_VERSION: str = keras.version()  # the installed Keras; tests substitute another release's number

_log = logging.getLogger("hvrep")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; a pre-release tag is dropped ("3.16.0rc1" -> (3, 16, 0))."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version.strip())
    return tuple(int(g or 0) for g in m.groups()) if m else (0, 0, 0)


def unverified(version: str | None = None) -> str | None:
    """Why Keras ``version`` (default: the installed one) is outside :data:`VERIFIED`, or None when inside."""
    version = KERAS_VERSION if version is None else version
    first, end = VERIFIED
    if first <= _release(version) < end:
        return None
    return (f"Keras {version} is outside the releases hvrep's Keras-internal code was verified on "
            f"({'.'.join(map(str, first))} up to, not including, {'.'.join(map(str, end))})")


def warn_once(key: str, message: str) -> None:
    """Logs ``message`` as a warning the first time ``key`` is warned about in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    _log.warning(message)
