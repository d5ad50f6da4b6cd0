"""``key=value`` settings for an app's frozen configuration (the GAN, the agent), read as ``hvrep train`` reads
``section.key=value``: the app's own fields, and one nested section's as ``<section>.key=value``.

    cfg = apply_settings(AppConfig(), ["steps=500", "agent.hidden=256,256"], section="agent")

No TensorFlow here: an app checks its settings before it imports it, so a typo costs no start-up.
``app_main`` is an app's whole command line: ``sys.exit(app_main("d4pg", config, run))``.
``check_ranges`` is an app configuration's range check, one line per bad value as ``hvrep train``'s: a NaN, an
infinity or a value outside its interval would otherwise start a run that waits for ever or diverges.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hvrep.errors import EXIT_OK, EXIT_USAGE, ConfigError, HvrepError

T = TypeVar("T")


def _parse(value: str, like: Any) -> Any:
    """``value`` as the type of the default ``like``: true/false, a tuple of ints (``256,256``), none or an int
    where the default is None, else ``type(like)(value)``."""
    if isinstance(like, bool):
        if value.lower() not in ("true", "false"):
            raise ValueError(value)
        return value.lower() == "true"
    if isinstance(like, tuple):
        return tuple(int(v) for v in value.split(","))
    if like is None:
        return None if value.lower() == "none" else int(value)
    return type(like)(value)


def _interval(text: str) -> tuple[float, float, bool, bool]:
    """"[0, 1)" -> (0.0, 1.0, low closed, high open)."""
    low, high = (float(x) for x in text[1:-1].split(","))
    return low, high, text[0] == "[", text[-1] == "]"


def check_ranges(config: Any, ranges: dict[str, str], prefix: str = "") -> None:
    """Raises ConfigError when a field of the dataclass ``config`` lies outside its interval.

    Args:
      config: a dataclass instance (called from its ``__post_init__``).
      ranges: field name -> interval as text, e.g. ``{"gamma": "[0, 1]", "lr": "(0, inf)"}``. A field whose
        default is an int must hold an int; a value None passes (the field's "as the machine allows"); a float
        must be finite (NaN and infinities are refused even where a bound is ``inf``).
      prefix: how the setting is typed on the command line before its name ("agent.").

    Raises:
      hvrep.errors.ConfigError: one line naming the setting, the value, the interval and the default as a fix.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name, text in ranges.items():
        value, default = getattr(config, name), defaults[name]
        if value is None:
            continue
        low, high, low_closed, high_closed = _interval(text)
        # A None default (threads, actors_per_rank) stands for an int the machine picks.
        whole = (isinstance(default, int) and not isinstance(default, bool)) or default is None
        number = isinstance(value, int | float) and not isinstance(value, bool) and (
            isinstance(value, int) if whole else math.isfinite(value))
        inside = number and (low < value or (low_closed and value == low)) and (
            value < high or (high_closed and value == high))
        if not inside:
            kind = "an integer" if whole else "a finite number"
            fix = f" Fix: e.g. {prefix}{name}={default} (the default)." if default is not dataclasses.MISSING else ""
            raise ConfigError(f"{prefix}{name} must be {kind} in {text}, got {value!r}.{fix}")


def apply_settings(base: T, overrides: Sequence[str], section: str) -> T:
    """``base`` with ``key=value`` (its own fields) and ``<section>.key=value`` (the fields of its dataclass field
    ``section``) applied; each dataclass's own checks run on the result.

    Raises:
      hvrep.errors.ConfigError: an unknown key (the message lists the valid ones) or a value of the wrong type.
    """
    inner = getattr(base, section)
    names = {"": {f.name for f in dataclasses.fields(base)} - {section},
             section: {f.name for f in dataclasses.fields(inner)}}
    changes: dict[str, dict[str, Any]] = {"": {}, section: {}}
    for item in overrides:
        key, sep, value = item.partition("=")
        where = section if key.startswith(f"{section}.") else ""
        name = key.removeprefix(f"{section}.")
        if not sep or name not in names[where]:
            raise ConfigError(f"unknown setting {item!r}. Fix: key=value with key one of {sorted(names[''])} or "
                              f"{section}.<key> with <key> one of {sorted(names[section])}.")
        like = getattr(inner if where else base, name)
        try:
            changes[where][name] = _parse(value, like)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not of type {type(like).__name__}. Fix: e.g. {key}={like}.") \
                from None
    return dataclasses.replace(base, **changes[""], **{section: dataclasses.replace(inner, **changes[section])})


def app_main(name: str, config: Callable[[Sequence[str]], Any], run: Callable[..., Any],
             argv: Sequence[str] | None = None) -> int:
    """An app's command line: ``key=value`` settings (``config``) and ``--resume``, then ``run(cfg, resume=...)``.

    Returns:
      The exit code: 0, or hvrep's usage code (2) after one line ``<name>: error: ...`` for an error the user can
      fix (``HvrepError``: a setting, a folder that holds another run).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        run(config([a for a in args if a != "--resume"]), resume="--resume" in args)
    except HvrepError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return EXIT_USAGE.code
    return EXIT_OK.code
