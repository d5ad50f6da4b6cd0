"""The outer loop for an app's own step (Orbit's controller for any workload): the cadence is the library's.

An app (a GAN, an agent, anything that is not ``hvrep train``'s classifier) says what a training loop of
``n`` steps and an evaluation are (:class:`App`); :func:`run_loop` decides when each runs, when the chief
saves a checkpoint (``CheckpointManager``: atomic), what goes to ``metrics.jsonl`` and TensorBoard
(``MetricsWriter``), and stops every rank together on SIGTERM / SIGUSR1 / Ctrl-C after saving, as
``hvrep train`` does. The classifier's own controller (``controller.py``) keeps its epoch-shaped loop
(data positions, schedules, elastic commits).

    loop = LoopConfig(max_steps=2000, steps_per_loop=20, eval_every=500, checkpoint_every=500)
    summary = run_loop(app, loop, repl=repl, step=step, checkpoints=ckpt, metrics=metrics)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.replica import watchdog
from hvrep.train.checkpoint import CheckpointManager
from hvrep.train.metrics import MetricsWriter
from hvrep.train.preemption import stop_on_signals


class App(Protocol):
    """What an app gives the loop. Both methods are called on every rank alike (they may use collectives)."""

    def train(self, steps: int) -> Mapping[str, float]:
        """Runs ``steps`` training steps; returns the loop's figures (e.g. mean losses), the same on every rank."""

    def evaluate(self, step: int) -> Mapping[str, Any]:
        """Evaluates at global step ``step``; returns the figures for metrics.jsonl (numbers also go to
        TensorBoard)."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """When things happen, in global steps.

    Attributes:
      max_steps: the run's length; a resumed run trains up to it.
      steps_per_loop: steps between host round-trips (the stop agreement, a ``train`` line).
      eval_every: evaluate every this many steps (0: only at the end).
      checkpoint_every: save every this many steps (0: only at the end and on a stop).
    """

    max_steps: int
    steps_per_loop: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        for name in ("max_steps", "steps_per_loop"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}.")


def _next_boundary(step: int, cfg: LoopConfig) -> int:
    """The first step after ``step`` at which the loop must come back to the host."""
    ends = [cfg.max_steps, (step // cfg.steps_per_loop + 1) * cfg.steps_per_loop]
    ends += [(step // every + 1) * every for every in (cfg.eval_every, cfg.checkpoint_every) if every]
    return min(ends)


def run_loop(app: App, cfg: LoopConfig, *, repl: Any, step: tf.Variable, checkpoints: CheckpointManager,
             metrics: MetricsWriter, metadata: Callable[[], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Trains ``app`` from ``step``'s value to ``cfg.max_steps``; call on every rank.

    Args:
      repl: the app's ``hvrep.Replicator`` (the stop agreement is one reduce per loop).
      step: the global step, a variable the checkpoints carry (assigned here after each loop).
      checkpoints, metrics: as ``hvrep train``'s (the chief writes; other ranks' do nothing).
      metadata: extra checkpoint.json entries, asked at each save.

    Returns:
      {"stopped": "completed" | "signal", "step", "wall_sec", "eval": the last evaluation's figures}.
    """
    t_start = time.time()
    s = int(step.numpy())
    last_eval: dict[str, Any] = {}
    stopped = "completed"

    def save() -> None:
        watchdog.note_step(f"checkpoint at step {s}")
        checkpoints.save(s, metadata=dict(metadata()) if metadata else None)

    def evaluate() -> None:
        nonlocal last_eval
        watchdog.note_step(f"evaluation at step {s}")
        last_eval = dict(app.evaluate(s))
        metrics.write("eval", s, **last_eval)

    with stop_on_signals() as stop:
        while s < cfg.max_steps:
            n = _next_boundary(s, cfg) - s
            watchdog.note_step(f"train steps {s + 1}-{s + n}")
            t0 = time.perf_counter()
            figures = dict(app.train(n))
            s += n
            step.assign(s)
            # A signal may have reached only some ranks: agree on stopping.
            stop_agreed = stop.agreed(repl)
            metrics.write("train", s, steps_per_sec=n / max(time.perf_counter() - t0, 1e-9), **figures)
            if cfg.eval_every and s % cfg.eval_every == 0 and s < cfg.max_steps:
                evaluate()
            if cfg.checkpoint_every and s % cfg.checkpoint_every == 0 and s < cfg.max_steps:
                save()
            if stop_agreed:
                stopped = "signal"
                save()
                break
        else:
            evaluate()
            save()
    return {"stopped": stopped, "step": s, "wall_sec": time.time() - t_start, "eval": last_eval}
