"""The D4PG example's actors (examples/d4pg): processes without TensorFlow that a dead one's restart replaces.

No TensorFlow in this file either: the pool, the replay and the actors are NumPy and gymnasium only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from examples.d4pg import policy
from examples.d4pg.actor import ActorSpec
from examples.d4pg.actors import ROOT, ActorPool
from examples.d4pg.replay import Board, Replay

OBS, ACT, HIDDEN = 3, 1, (8,)


def _setup(tmp_path: Path, actors: int = 1) -> tuple[Replay, Board, list[ActorSpec]]:
    replay = Replay(tmp_path, actors, 4096, OBS, ACT, create=True)
    board = Board(tmp_path, policy.num_weights(OBS, ACT, HIDDEN), create=True)
    board.publish(np.random.default_rng(0).normal(size=board.weights.shape).astype(np.float32) * 0.1, step=7)
    specs = [ActorSpec(folder=str(tmp_path), index=i, num_actors=actors, capacity=4096, env="Pendulum-v1", seed=i,
                       hidden=HIDDEN, sigma=0.3, n_step=3, gamma=0.99, max_steps_per_sec=2000)
             for i in range(actors)]
    return replay, board, specs


def _wait(cond, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_an_actor_imports_no_tensorflow_and_writes_n_step_rows(tmp_path: Path) -> None:
    replay, _, specs = _setup(tmp_path)
    spec = specs[0].__dict__ | {"hidden": list(HIDDEN)}
    code = ("import json, sys\nfrom examples.d4pg import actor\n"
            f"steps = actor.run(actor.ActorSpec(**{spec!r} | {{'hidden': (8,)}}), max_env_steps=250)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'horovod'))\n"
            "print(json.dumps({'steps': steps, 'heavy': heavy}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"steps": 250, "heavy": []}, result
    rows = replay.sample(64, np.random.default_rng(0))
    assert replay.inserted() == 248 and replay.env_steps() == 250
    assert np.all(rows[:, -1] == 7)  # the policy's learner step travels with each row
    discount = rows[:, OBS + ACT + 1]
    # Pendulum never terminates (200-step truncation): each row bootstraps with gamma^k, k <= n.
    nearest = np.min(np.abs(discount[:, None] - 0.99 ** np.arange(1, 4)), axis=1)
    assert nearest.max() < 1e-6, sorted(set(discount.tolist()))


def test_a_killed_actor_is_restarted_and_its_ring_fills_on(tmp_path: Path) -> None:
    replay, _, specs = _setup(tmp_path, actors=2)
    pool = ActorPool(specs, tmp_path / "logs", "rank0")
    try:
        pool.start()
        assert _wait(lambda: replay.counters[0, 0] > 100 and replay.counters[1, 0] > 100)
        assert pool.check() == []
        victim, other = pool.procs[0].pid, pool.procs[1].pid
        os.kill(victim, signal.SIGKILL)
        assert _wait(lambda: pool.procs[0].poll() is not None)
        before = int(replay.counters[0, 0])
        events = pool.check()
        assert [(e["actor"], e["old_pid"], e["exit_code"]) for e in events] == [(0, victim, -signal.SIGKILL)]
        assert pool.procs[0].pid != victim and pool.procs[1].pid == other and pool.procs[1].poll() is None
        assert _wait(lambda: replay.counters[0, 0] > before + 100)  # the new actor writes on in the same ring
    finally:
        pool.close()
    assert all(p.poll() is not None for p in pool.procs)


def test_a_stopped_actor_is_ended_and_restarted_after_actor_timeout_s_and_the_other_is_left_alone(
        tmp_path: Path) -> None:
    # Every actor stopped with a rate limiter (or on one rank) left the learner waiting for ever (issue 49).
    replay, _, specs = _setup(tmp_path, actors=2)
    pool = ActorPool(specs, tmp_path / "logs", "rank0")
    try:
        pool.start()
        early: list[dict] = []
        # The learner polls from the start: actors that take longer than actor_timeout_s to start (an interpreter,
        # NumPy, gymnasium) are not restarted before their first row.
        assert _wait(lambda: bool(early.extend(pool.restart_stalled(np.array(replay.counters[:, 0]), 1.0)))
                     or (replay.counters[0, 0] > 100 and replay.counters[1, 0] > 100))
        assert early == []
        victim, other = pool.procs[0].pid, pool.procs[1].pid
        old = pool.procs[0]
        os.kill(victim, signal.SIGSTOP)
        events: list[dict] = []
        stopped_at = time.monotonic()
        # The learner's checks, as it polls while it waits for data; actor 1 keeps inserting.
        assert _wait(lambda: bool(events.extend(pool.restart_stalled(np.array(replay.counters[:, 0]), 1.0))
                                  or events), timeout=30)
        assert time.monotonic() - stopped_at >= 1.0
        assert [(e["actor"], e["old_pid"], e["exit_code"]) for e in events] == [(0, victim, -signal.SIGKILL)]
        assert events[0]["stalled_s"] >= 1.0 and old.poll() is not None  # the stopped one is gone, not left stopped
        assert pool.procs[0].pid != victim and pool.procs[1].pid == other and pool.procs[1].poll() is None
        before = int(replay.counters[0, 0])
        assert _wait(lambda: replay.counters[0, 0] > before + 100)  # the new actor writes on in the same ring
        assert pool.restart_stalled(np.array(replay.counters[:, 0]), 0.0) == []  # 0: never
    finally:
        pool.close()
    assert all(p.poll() is not None for p in pool.procs)


def test_actors_start_without_the_launchers_job_variables(tmp_path: Path, monkeypatch) -> None:
    from hvrep import _env

    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.setenv("PMIX_RANK", "1")
    env = _env.job_free_environ({"X": "1"})
    assert env["X"] == "1" and not [k for k in env if k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))]
