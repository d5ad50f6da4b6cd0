"""Backend registry: one backend per process, chosen once at start-up (STYLE.md, principle 2).

One file per backend, each able to say whether it can run here (Horovod's ``common/ops/`` layout).
"""

from __future__ import annotations

import logging

from hvrep import _env
from hvrep.errors import ConfigError, SetupError
from hvrep.replica.backends.base import Backend
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext
from hvrep.replica.placement import resolve_placement

BACKENDS = ("horovod", "tpu", "local")
_log = logging.getLogger("hvrep")


def _class(name: str) -> type[Backend]:
    # Imported lazily: the horovod backend imports Horovod, the tpu backend probes for a TPU.
    if name == "horovod":
        from hvrep.replica.backends.horovod import HorovodBackend

        return HorovodBackend
    if name == "tpu":
        from hvrep.replica.backends.tpu import TPUBackend

        return TPUBackend
    from hvrep.replica.backends.local import LocalBackend

    return LocalBackend


def create(name: str, config: CommConfig, devices_per_replica: int = 1) -> Backend:
    """Creates the backend ``name``; "auto" is horovod when a launcher started more than one rank or horovodrun's
    elastic driver started this process (even as a world of one: others may join), else tpu when a TPU is
    attached, else local. Each replica owns ``devices_per_replica`` devices.

    Raises:
      hvrep.errors.SetupError: "auto" under a multi-rank launcher, and Horovod cannot start. Falling back to
        ``local`` would make every rank a one-replica job of its own, each one the chief.
    """
    if name not in (*BACKENDS, "auto"):
        raise ConfigError(f"backend must be one of {(*BACKENDS, 'auto')}, got {name!r}.")
    if name == "auto":
        placement = resolve_placement()
        if _multi_process(placement):
            try:
                backend = _class("horovod")(config, devices_per_replica)
            except SetupError as e:
                raise SetupError(
                    f"backend='auto': the launcher ({placement.launcher}) started {placement.size} ranks, so "
                    f"hvrep needs Horovod, and it cannot start: {e}"
                ) from e
            _log.info("hvrep: backend 'auto' chose 'horovod' (%s, %d ranks)", placement.launcher, placement.size)
            return backend
        name = resolve(name)
        _log.info("hvrep: backend 'auto' chose %r", name)
    return _class(name)(config, devices_per_replica)


def _multi_process(placement: object) -> bool:
    return placement.size > 1 or _env.horovod_elastic()


def resolve(name: str) -> str:
    """The backend ``create(name, ...)`` would create: ``name`` itself, or for "auto" the one it picks (without
    starting it), so that the support table can refuse a combination before anything starts."""
    if name not in (*BACKENDS, "auto"):
        raise ConfigError(f"backend must be one of {(*BACKENDS, 'auto')}, got {name!r}.")
    if name != "auto":
        return name
    if _multi_process(resolve_placement()):
        return "horovod"
    return next(n for n in BACKENDS[1:] if _class(n).available())


__all__ = ["BACKENDS", "Backend", "InputContext", "create", "resolve"]
