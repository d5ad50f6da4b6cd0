"""One actor process: steps a gymnasium environment with the newest policy it has, writes n-step transitions.

    python -m examples.d4pg.actor '<ActorSpec as JSON>'

Started by ``actors.ActorPool`` (a fresh interpreter, never a fork). It imports NumPy and gymnasium only (no
TensorFlow: a few MB and milliseconds to start, and nothing of the learner's threads or Horovod). It never waits
for the learner: it looks at the board's sequence number every step and copies new weights when there are some
(the learner publishes every ``publish_every`` learner steps), and exits when its parent process is gone: the
kernel kills it then (a parent-death signal, :func:`die_with_parent`), also when it is stopped (SIGSTOP) or the
learner was SIGKILLed or left by ``os._exit`` (the hang watchdog), which no cleanup code of the learner survives.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from examples.d4pg import policy
from examples.d4pg.replay import Board, Replay


@dataclasses.dataclass(frozen=True)
class ActorSpec:
    """What an actor needs (JSON on its command line)."""

    folder: str  # the rank's replay and board files
    index: int  # this actor's ring
    num_actors: int
    capacity: int
    env: str
    seed: int
    hidden: tuple[int, ...]
    sigma: float  # exploration noise, a fraction of the action range's half-width
    n_step: int
    gamma: float
    max_steps_per_sec: float  # 0: as fast as it can
    chunk: int = 32  # rows per replay write (< replay.MARGIN)
    parent: int = 0  # the learner's pid: the actor ends when it is no longer its parent (0: whoever started it)


def run(spec: ActorSpec, max_env_steps: int = 0) -> int:
    """Acts until the parent is gone (or ``max_env_steps`` steps, when > 0); returns the steps taken."""
    import gymnasium as gym

    env = gym.make(spec.env)
    obs_dim, act_dim = int(np.prod(env.observation_space.shape)), int(np.prod(env.action_space.shape))
    low = np.asarray(env.action_space.low, np.float32).reshape(-1)
    high = np.asarray(env.action_space.high, np.float32).reshape(-1)
    folder = Path(spec.folder)
    replay = Replay(folder, spec.num_actors, spec.capacity, obs_dim, act_dim, create=False)
    shapes = policy.layer_shapes(obs_dim, act_dim, spec.hidden)
    board = Board(folder, policy.num_weights(obs_dim, act_dim, spec.hidden), create=False)
    rng = np.random.default_rng(spec.seed)
    parent = os.getppid()
    weights: list[np.ndarray] | None = None
    policy_step, seen = 0, 0
    obs, _ = env.reset(seed=spec.seed)
    window: collections.deque = collections.deque()  # (obs, action, reward, policy step) of the last n steps
    pending: list[np.ndarray] = []
    steps = episodes = 0
    # A restarted actor adds to its predecessor's counts.
    base_steps, base_episodes = int(replay.counters[spec.index, 1]), int(replay.counters[spec.index, 2])
    ret, last_return = 0.0, 0.0
    discounts = spec.gamma ** np.arange(spec.n_step + 1)
    t0 = time.monotonic()

    def emit(k: int, next_obs: np.ndarray, terminal: bool) -> None:
        o, a, _, born = window[0]
        rewards = np.array([w[2] for w in list(window)[:k]], np.float64)
        discount = 0.0 if terminal else discounts[k]
        pending.append(np.concatenate([o, a, [float(rewards @ discounts[:k]), discount], next_obs, [born]])
                       .astype(np.float32))

    while max_env_steps <= 0 or steps < max_env_steps:
        if board.sequence() != seen:
            got = board.read()
            if got is not None:
                flat, policy_step, seen = got
                weights = policy.unflatten(flat, shapes)
        if weights is None:  # the learner publishes before it starts any actor; a restart finds weights at once
            if os.getppid() != parent:
                break
            time.sleep(0.01)
            continue
        o = np.asarray(obs, np.float32).reshape(-1)
        a = policy.act(weights, o, low, high)
        a = np.clip(a + rng.normal(0.0, spec.sigma, act_dim) * (high - low) / 2, low, high).astype(np.float32)
        next_obs, reward, terminated, truncated, _ = env.step(a.reshape(env.action_space.shape))
        steps += 1
        ret += float(reward)
        window.append((o, a, float(reward), policy_step))
        n_obs = np.asarray(next_obs, np.float32).reshape(-1)
        if len(window) == spec.n_step:
            emit(spec.n_step, n_obs, bool(terminated))
            window.popleft()
        if terminated or truncated:
            while window:  # the episode's last transitions: shorter returns
                emit(len(window), n_obs, bool(terminated))
                window.popleft()
            episodes += 1
            last_return, ret = ret, 0.0
            obs, _ = env.reset()
        else:
            obs = next_obs
        if len(pending) >= spec.chunk or (pending and not window):
            replay.add(spec.index, np.stack(pending))
            pending.clear()
            replay.note(spec.index, base_steps + steps, base_episodes + episodes,
                        last_return if episodes else 0.0)
            if os.getppid() != parent:
                break
        if spec.max_steps_per_sec > 0:
            ahead = steps / spec.max_steps_per_sec - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    if pending:
        replay.add(spec.index, np.stack(pending))
    replay.note(spec.index, base_steps + steps, base_episodes + episodes, last_return if episodes else 0.0)
    return steps


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> bool:
    """Asks the kernel for SIGKILL when the thread that started this process ends (prctl PR_SET_PDEATHSIG);
    returns False when ``parent`` is already gone (this process was orphaned before it asked).

    SIGKILL, not SIGTERM: it ends a stopped process too. The learner starts its actors from its main thread
    (``ActorPool``), which lives as long as the learner: the signal is tied to the thread that forked, not the
    process, so an actor started from a thread that ends would be killed with it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return parent <= 0 or os.getppid() == parent


def main(argv: list[str]) -> int:
    raw = json.loads(argv[0])
    spec = ActorSpec(**{**raw, "hidden": tuple(raw["hidden"])})
    if not die_with_parent(spec.parent):
        return 0  # the learner ended before this actor could tie itself to it
    run(spec, max_env_steps=int(argv[1]) if len(argv) > 1 else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
