"""Train D4PG with asynchronous actors and a replicated learner; the same command on one process.

    python -m examples.d4pg.train                                             # Pendulum-v1, one learner
    horovodrun -np 2 -H localhost:2 --gloo python -m examples.d4pg.train output_dir=runs/d4pg
    mpirun -np 2 python -m examples.d4pg.train env=Pendulum-v1 actors_per_rank=2 agent.lr_critic=1e-3
    python -m examples.d4pg.train --resume output_dir=runs/d4pg               # continue from the newest checkpoint

Settings are ``key=value`` (``agent.key=value`` for the agent's, see :class:`AppConfig` and
``examples.d4pg.agent.D4PGConfig``). Each learner rank starts its own actor processes (``actors.py``: clean
interpreters, NumPy only) and samples its own replay (``replay.py``); the learner's step is ``agent.py``'s. The
loop's cadence, checkpoints, ``metrics.jsonl`` / TensorBoard and the stop on SIGTERM / SIGUSR1 / Ctrl-C are
``hvrep.train.loop``'s. Outputs in ``output_dir``: ``metrics.jsonl`` (``train`` lines: losses, learner steps/s,
actor environment steps/s, replay size, sample age; ``eval`` lines: the return of 10 fixed-seed episodes;
``actor_restart`` events), ``actors/`` (each actor's log, each rank's actor process ids) and ``checkpoints/``.
A resumed run continues the learner and its optimizers; the replay starts empty (actors refill it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from examples.d4pg.agent import D4PGConfig
from hvrep.errors import ConfigError
from hvrep.train.settings import app_main, apply_settings, check_ranges


@dataclasses.dataclass(frozen=True)
class AppConfig:
    """One run.

    Attributes:
      output_dir: metrics, actor logs and checkpoints go here.
      env: a continuous-control gymnasium environment id (a Box action space).
      steps: learner steps (each on the global batch).
      per_replica_batch: transitions per replica and learner step (the global batch is per_replica_batch x
        replicas: each replica samples its own replay). The setting's old name ``batch=`` still works, with a
        DeprecationWarning (docs/large-batch.md#which-batch-which-learning-rate).
      actors_per_rank: actor processes per learner rank (None: max(1, the node's cores less its learner ranks,
        shared among them)).
      actor_timeout_s: an actor that inserts nothing for this many seconds (stopped, or stuck in its environment)
        is ended and restarted, as a dead one is (0: never). Below comm.timeout_s (600 s), so that a learner
        waiting for its actors restarts them before the watchdog calls that wait a hang.
      actor_steps_per_sec: each actor's cap on environment steps per second (0: none). Actors that run flat out
        take the cores the learner needs; the cap does not make an actor wait for the learner.
      sigma: Gaussian exploration noise, a fraction of the action range's half-width.
      n_step: the returns' length in environment steps.
      replay_size: transitions each rank's replay keeps (a ring per actor).
      min_replay: transitions each rank's replay holds before its learner starts.
      samples_per_insert: if > 0, a rank's learner waits while it has sampled more than this many transitions per
        transition inserted (past min_replay): a rate limiter. 0: the learner never waits once min_replay is met.
      publish_every: learner steps between two publications of the policy to the actors.
      steps_per_loop: steps between host round-trips (a ``train`` line, the stop agreement, an actor check).
      eval_every: learner steps between evaluations (0: only at the end).
      eval_episodes: fixed-seed episodes of the deterministic policy per evaluation.
      checkpoint_every: learner steps between checkpoints (0: only at the end and on a stop).
      seed: the actors' environments and noise, the replay's sampling.
      threads: each rank's TensorFlow threads (None: its share of the node's cores).
      agent: the agent and its optimisation.
    """

    output_dir: str = "runs/d4pg"
    env: str = "Pendulum-v1"
    steps: int = 20000
    per_replica_batch: int = 256
    actors_per_rank: int | None = None
    actor_timeout_s: float = 300.0
    actor_steps_per_sec: float = 250.0
    sigma: float = 0.2
    n_step: int = 5
    replay_size: int = 200_000
    min_replay: int = 2000
    samples_per_insert: float = 0.0
    publish_every: int = 50
    steps_per_loop: int = 250
    eval_every: int = 2500
    eval_episodes: int = 10
    checkpoint_every: int = 5000
    seed: int = 0
    threads: int | None = None
    agent: D4PGConfig = dataclasses.field(default_factory=D4PGConfig)

    def __post_init__(self) -> None:
        # samples_per_insert=nan or a negative rate would leave the learner waiting for ever (the watchdog then
        # calls it a hang, exit 75, and preemptible.sbatch requeues it): refused here, before any process starts.
        check_ranges(self, _RANGES)
        if not 1 <= self.min_replay <= self.replay_size // 2:
            raise ConfigError(f"min_replay must be in [1, replay_size / 2 = {self.replay_size // 2}], got "
                              f"{self.min_replay}.")

    @property
    def batch(self) -> int:
        """Deprecated: ``per_replica_batch`` (the same value)."""
        warnings.warn("AppConfig.batch is deprecated: it is the batch per replica; read per_replica_batch.",
                      DeprecationWarning, stacklevel=2)
        return self.per_replica_batch


_RANGES = {"steps": "[1, inf)", "per_replica_batch": "[1, inf)", "actors_per_rank": "[1, inf)",
           "actor_timeout_s": "[0, inf)", "actor_steps_per_sec": "[0, inf)", "sigma": "[0, inf)", "n_step": "[1, inf)",
           "replay_size": "[2, inf)", "samples_per_insert": "[0, inf)", "publish_every": "[1, inf)",
           "steps_per_loop": "[1, inf)", "eval_every": "[0, inf)", "eval_episodes": "[1, inf)",
           "checkpoint_every": "[0, inf)", "seed": "[0, inf)", "threads": "[1, inf)"}

# Settings renamed so that a batch says whether it is global or per replica: old name -> new name (same meaning).
RENAMED = {"batch": "per_replica_batch"}


def config(overrides: Sequence[str]) -> AppConfig:
    """``AppConfig`` with ``key=value`` / ``agent.key=value`` overrides applied (``agent.hidden=256,256``).

    A renamed setting's old name (``RENAMED``) is read as the new one, with a DeprecationWarning.

    Raises:
      hvrep.errors.ConfigError: an unknown key, a value of the wrong type, or a setting given by both names.
    """
    items = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not (sep and key in RENAMED):
            items.append(item)
            continue
        new = RENAMED[key]
        # stacklevel=1: attributed to this module, which is __main__ under ``python -m``, so Python shows it.
        warnings.warn(f"d4pg: the setting {key}= is deprecated: it counts transitions per replica; write "
                      f"{new}={value} (the same value).", DeprecationWarning, stacklevel=1)
        if any(o.partition("=")[0] == new for o in overrides):
            raise ConfigError(f"{item!r} and {new}= are the same setting. Fix: give {new}= only.")
        items.append(f"{new}={value}")
    return apply_settings(AppConfig(), items, section="agent")


def env_spec(env_id: str) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(obs_dim, act_dim, low, high) of a gymnasium environment with a Box action space."""
    import gymnasium as gym

    try:
        env = gym.make(env_id)
    except gym.error.Error as e:
        raise ConfigError(f"env={env_id!r}: gymnasium cannot make it ({e}). Fix: a registered id, e.g. "
                          f"env=Pendulum-v1.") from None
    if not isinstance(env.action_space, gym.spaces.Box):
        raise ConfigError(f"env={env_id!r} has a {type(env.action_space).__name__} action space; D4PG needs a "
                          f"continuous (Box) one. Fix: e.g. env=Pendulum-v1.")
    obs_dim, act_dim = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
    low = np.asarray(env.action_space.low, np.float32).reshape(-1)
    high = np.asarray(env.action_space.high, np.float32).reshape(-1)
    env.close()
    return obs_dim, act_dim, low, high


def evaluate_policy(env_id: str, flat: np.ndarray, hidden: tuple[int, ...], episodes: int,
                    seed: int = 10_000) -> list[float]:
    """Returns of ``episodes`` episodes (seeds seed, seed+1, ...) with the deterministic NumPy policy."""
    import gymnasium as gym

    from examples.d4pg import policy

    env = gym.make(env_id)
    obs_dim, act_dim, low, high = env_spec(env_id)
    weights = policy.unflatten(flat, policy.layer_shapes(obs_dim, act_dim, hidden))
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            a = policy.act(weights, np.asarray(obs, np.float32).reshape(-1), low, high)
            obs, reward, terminated, truncated, _ = env.step(a.reshape(env.action_space.shape))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return returns


def may_sample(cfg: AppConfig, size: int, inserted: int, sampled: int, rows: int) -> bool:
    """Whether a learner whose replay holds ``size`` rows (``inserted`` ever) and that has sampled ``sampled`` may
    sample ``rows`` more: once ``min_replay`` is met, and, with a rate limiter, while sampled rows stay within
    ``samples_per_insert`` per inserted row."""
    if size < cfg.min_replay:
        return False
    return cfg.samples_per_insert <= 0 or sampled + rows <= cfg.samples_per_insert * inserted


def default_actors(local_size: int) -> int:
    """Actors per learner rank when none is set: the node's cores less its learner ranks, shared, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - local_size) // max(1, local_size))


class _App:
    """What ``hvrep.train.loop.run_loop`` drives: ``train(n)`` runs n learner steps, ``evaluate`` plays episodes."""

    def __init__(self, cfg: AppConfig, repl: Any, agent: Any, replay: Any, board: Any, pool: Any, metrics: Any,
                 step: int, out: Path) -> None:
        self.cfg, self.repl, self.agent, self.replay, self.board, self.pool = cfg, repl, agent, replay, board, pool
        self.metrics, self.step, self.out = metrics, step, out
        self.rng = np.random.default_rng(cfg.seed + 7919 * repl.rank)
        self.sampled = 0
        self.rows_per_step = cfg.per_replica_batch * agent.local_replicas
        self.restarts = 0
        self._pid_file = out / "actors" / f"rank{repl.rank}.pids"
        self._write_pids()

    def _write_pids(self) -> None:
        from examples.d4pg import shm

        shm.record_owner(Path(self.replay.folder), self.pool.pids())
        self._pid_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.pool.pids()))
        os.replace(tmp, self._pid_file)

    def _check_actors(self) -> None:
        stalled = self.pool.restart_stalled(np.array(self.replay.counters[:, 0]), self.cfg.actor_timeout_s)
        for event in [*self.pool.check(), *stalled]:
            self.restarts += 1
            why = (f"inserted nothing for {event['stalled_s']:.0f} s (actor_timeout_s={self.cfg.actor_timeout_s:g}: "
                   "stopped or stuck); ended it and" if "stalled_s" in event else
                   f"exited with code {event['exit_code']};")
            print(f"d4pg: rank {self.repl.rank}: actor {event['actor']} (pid {event['old_pid']}) {why} restarted as "
                  f"pid {event['new_pid']}. Its log: {event['log']}", file=sys.stderr, flush=True)
            self._write_pids()

    def _wait_for_data(self) -> float:
        """Waits until this rank's replay may be sampled (min_replay, the rate limiter); returns the seconds."""
        waited = 0.0
        while True:
            if may_sample(self.cfg, self.replay.size(), self.replay.inserted(), self.sampled, self.rows_per_step):
                return waited
            self._check_actors()  # an actor that died while the learner waits for it is restarted
            time.sleep(0.01)
            waited += 0.01

    def train(self, steps: int) -> dict[str, float]:
        self._check_actors()
        t0, env0 = time.perf_counter(), self.replay.env_steps()
        outs, ages, waited = [], [], 0.0
        for _ in range(steps):
            waited += self._wait_for_data()
            rows = self.replay.sample(self.rows_per_step, self.rng)
            self.sampled += self.rows_per_step
            ages.append(float(np.mean(self.step - rows[:, -1])))
            self.step += 1
            outs.append(self.agent.train_step(rows[:, :-1], self.step))
            if self.step % self.cfg.publish_every == 0:
                self.board.publish(self.agent.policy_weights(), self.step)
        losses = self.repl.reduce(outs, "mean")  # reading waits for the last step
        seconds = max(time.perf_counter() - t0, 1e-9)
        # One reduce (sums over the ranks) for this rank's figures and its own slots.
        n, r = self.repl.num_processes, self.repl.rank
        mine = np.zeros(3 + 3 * n)
        mine[:3] = [(self.replay.env_steps() - env0) / seconds, self.replay.size(), self.restarts]
        mine[3 + r], mine[3 + n + r], mine[3 + 2 * n + r] = np.mean(ages), waited / seconds, steps / seconds
        total = np.asarray(self.repl.reduce(mine, "sum"), np.float64)
        return {"critic_loss": float(sum(o["critic_loss"] for o in losses) / steps),
                "policy_loss": float(sum(o["policy_loss"] for o in losses) / steps),
                "q": float(sum(o["q"] for o in losses) / steps),
                "learner_steps_per_sec": steps / seconds,
                "actor_env_steps_per_sec": float(total[0]),
                "replay_size": int(total[1]),
                "actor_restarts": int(total[2]),
                "sample_age": float(np.mean(total[3:3 + n])),
                "sample_age_by_rank": [round(float(a), 2) for a in total[3:3 + n]],
                "wait_fraction_by_rank": [round(float(w), 4) for w in total[3 + n:3 + 2 * n]],
                "steps_per_sec_by_rank": [round(float(s), 3) for s in total[3 + 2 * n:]]}

    def evaluate(self, step: int) -> dict[str, Any]:
        """The chief plays ``eval_episodes`` fixed-seed episodes with the deterministic policy."""
        if not self.repl.is_chief:
            return {}
        returns = evaluate_policy(self.cfg.env, self.agent.policy_weights(), self.cfg.agent.hidden,
                                  self.cfg.eval_episodes)
        return {"return": float(np.mean(returns)), "returns": [round(x, 2) for x in returns],
                "env_steps": int(self.replay.env_steps())}


def run(cfg: AppConfig, resume: bool = False) -> dict[str, Any]:
    """Trains on every rank; returns the summary (the chief's has the last evaluation)."""
    from hvrep import _env
    from hvrep.replica import cores
    from hvrep.train import rundir

    rundir.check_output_dir(cfg.output_dir, resume, overwrite=False)
    obs_dim, act_dim, low, high = env_spec(cfg.env)
    _env.quiet_tensorflow_logs()
    import tensorflow as tf

    import hvrep

    if cfg.threads:
        cores.set_pools(cfg.threads, f"threads={cfg.threads}")

    from examples.d4pg import policy, shm
    from examples.d4pg.actor import ActorSpec
    from examples.d4pg.actors import ActorPool
    from examples.d4pg.agent import D4PG
    from examples.d4pg.replay import Board, Replay
    from hvrep.train import resume as resuming
    from hvrep.train.checkpoint import CheckpointManager
    from hvrep.train.loop import LoopConfig, run_loop
    from hvrep.train.metrics import MetricsWriter

    repl = hvrep.Replicator("auto")
    n, chief, out = repl.num_replicas, repl.is_chief, Path(cfg.output_dir)
    metrics = MetricsWriter(out, chief)
    agent = D4PG(repl, cfg.agent, obs_dim, act_dim, low, high)
    with repl.scope():
        step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    ckpt = CheckpointManager(out / "checkpoints", is_chief=chief, keep=2, step=step, **agent.checkpoint_items())
    point = resuming.restore(repl, ckpt) if resume else None
    resumed = point.folder if point else None
    actors = cfg.actors_per_rank or default_actors(repl.local_size)
    for line in shm.remove_dead():  # a run that ended by SIGKILL or os._exit left its replay in memory
        print(f"d4pg: rank {repl.rank}: removed a dead run's replay {line}", file=sys.stderr, flush=True)
    folder = shm.make_folder(f"{shm.PREFIX}rank{repl.rank}-")
    replay = Replay(folder, actors, cfg.replay_size, obs_dim, act_dim, create=True)
    board = Board(folder, policy.num_weights(obs_dim, act_dim, cfg.agent.hidden), create=True)
    board.publish(agent.policy_weights(), int(step.numpy()))  # before any actor starts: they never wait for it
    specs = [ActorSpec(folder=str(folder), index=i, num_actors=actors, capacity=cfg.replay_size, env=cfg.env,
                       seed=cfg.seed + 1000 * repl.rank + i + 1_000_000 * int(step.numpy()), hidden=cfg.agent.hidden,
                       sigma=cfg.sigma, n_step=cfg.n_step, gamma=cfg.agent.gamma,
                       max_steps_per_sec=cfg.actor_steps_per_sec) for i in range(actors)]
    pool = ActorPool(specs, out / "actors", f"rank{repl.rank}")
    pool.start()
    try:
        budget = repl.cpu_budget.why if repl.cpu_budget else f"threads={cfg.threads}"
        metrics.write("config", config=dataclasses.asdict(cfg), replicas=n, backend=repl.backend,
                      actors_per_rank=actors, resumed_from=str(resumed) if resumed else None, cpu_budget=budget,
                      replay="starts empty" + (" (a resumed run does not keep the replay)" if resumed else ""))
        metrics.say(f"d4pg: {cfg.env}, {n} learner replica(s) ({repl.backend}), {actors} actor(s) per rank, batch "
                    f"{cfg.per_replica_batch} per replica ({cfg.per_replica_batch * n} global), {cfg.steps} learner "
                    "steps"
                    + (f", resumed from {resumed} at step {int(step.numpy())}" if resumed else ""))
        app = _App(cfg, repl, agent, replay, board, pool, metrics, int(step.numpy()), out)
        restarts_seen = 0

        class _Logged:
            """The app, and an ``actor_restart`` line whenever a rank restarted an actor during a loop."""

            def train(self, steps: int) -> dict[str, Any]:
                nonlocal restarts_seen
                figures = app.train(steps)
                if figures["actor_restarts"] > restarts_seen:
                    metrics.write("actor_restart", app.step, restarts=figures["actor_restarts"] - restarts_seen,
                                  total=figures["actor_restarts"], logs=str(out / "actors"))
                    restarts_seen = figures["actor_restarts"]
                return figures

            def evaluate(self, s: int) -> dict[str, Any]:
                return app.evaluate(s)

        loop = LoopConfig(max_steps=cfg.steps, steps_per_loop=cfg.steps_per_loop, eval_every=cfg.eval_every,
                          checkpoint_every=cfg.checkpoint_every)
        result = run_loop(_Logged(), loop, repl=repl, step=step, checkpoints=ckpt, metrics=metrics,
                          metadata=lambda: {"world_size": n, "per_replica_batch": cfg.per_replica_batch,
                                            "global_batch": cfg.per_replica_batch * n, "env": cfg.env})
    finally:
        pool.close()
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    summary = {"stopped": result["stopped"], "step": result["step"], "wall_sec": result["wall_sec"],
               "replicas": n, "output_dir": str(out), "actor_restarts": restarts_seen,
               **{k: result["eval"][k] for k in ("return",) if k in result["eval"]}}
    metrics.write("final", result["step"], **{k: v for k, v in summary.items() if k != "step"})
    metrics.close()
    metrics.say(f"d4pg: {summary['stopped']} at step {summary['step']} in {summary['wall_sec']:.0f} s"
                + (f": return {summary['return']:.1f}" if "return" in summary else ""))
    repl.close()
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return app_main("d4pg", config, run, argv)


if __name__ == "__main__":
    sys.exit(main())
