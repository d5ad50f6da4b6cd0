"""The D4PG app (examples/d4pg/train.py), one short in-process run (2 in-graph learner replicas, 2 actors):
a killed actor is restarted and logged while training goes on; with every actor stopped (SIGSTOP) the learner
keeps stepping and its sample age rises; a resumed run continues the learner's steps.

Every trigger is a learner step read from metrics.jsonl, not a time: no timing claim is tested here
(benchmarks/d4pg.py --stall measures the steps/s).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from examples.d4pg import train
from hvrep.errors import ConfigError

KILL_AT, STOP_AT, CONT_AT, STEPS = 50, 150, 250, 300


def _lines(out: Path, event: str) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [d for d in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if d["event"] == event]


def _saboteur(out: Path, seen: dict) -> None:
    """Kills actor 0 after step KILL_AT, stops every actor from step STOP_AT to CONT_AT (by metrics.jsonl)."""
    pids = out / "actors" / "rank0.pids"
    stopped: list[int] = []
    end = time.monotonic() + 300
    while time.monotonic() < end:
        trains = _lines(out, "train")
        step = trains[-1]["step"] if trains else 0
        if step >= KILL_AT and "killed" not in seen:
            seen["killed"], seen["other"] = json.loads(pids.read_text())
            os.kill(seen["killed"], signal.SIGKILL)
        if step >= STOP_AT and "age_before" not in seen:
            stopped = json.loads(pids.read_text())
            seen["age_before"], seen["stopped"] = trains[-1]["sample_age"], stopped
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
        if step >= CONT_AT and "age_during" not in seen:
            seen["age_during"] = trains[-1]["sample_age"]
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            return
        time.sleep(0.02)


def _config(out: Path, steps: int) -> train.AppConfig:
    return train.config([f"output_dir={out}", f"steps={steps}", "per_replica_batch=32", "agent.hidden=32,32",
                         "actors_per_rank=2", "actor_steps_per_sec=400", "replay_size=300", "min_replay=150",
                         "steps_per_loop=25", "eval_every=0", "eval_episodes=1", "checkpoint_every=0",
                         "publish_every=10"])


def test_a_killed_actor_is_restarted_stopped_actors_stop_nothing_and_resume_continues(tmp_path: Path) -> None:
    out = tmp_path / "run"
    seen: dict = {}
    saboteur = threading.Thread(target=_saboteur, args=(out, seen), daemon=True)
    saboteur.start()
    summary = train.run(_config(out, STEPS))
    saboteur.join(timeout=5)

    assert summary["stopped"] == "completed" and summary["step"] == STEPS, summary
    restarts = _lines(out, "actor_restart")
    assert len(restarts) == 1 and restarts[0]["total"] == 1, restarts
    assert restarts[0]["step"] <= STOP_AT  # found at the next loop, while training went on
    new_pids = seen["stopped"]
    assert seen["killed"] not in new_pids and seen["other"] in new_pids  # only the dead actor was replaced
    steps = [d["step"] for d in _lines(out, "train")]
    assert steps == list(range(25, STEPS + 1, 25)), steps  # no loop lost, before, during or after the stall
    # Stopped actors write nothing: every sample is one step older per learner step (~100 here). Running, they
    # turn the small replay (2 x 150 rows) over in well under 100 learner steps, so its age stays level.
    assert seen["age_during"] - seen["age_before"] >= 60, seen
    final = _lines(out, "final")[-1]
    assert final["actor_restarts"] == 1 and "return" in final

    resumed = train.run(_config(out, STEPS + 50), resume=True)
    assert resumed["step"] == STEPS + 50 and _lines(out, "train")[-1]["step"] == STEPS + 50
    assert _lines(out, "config")[-1]["resumed_from"], "the second run did not resume"


def test_the_learner_waits_for_min_replay_and_for_the_rate_limiter_only() -> None:
    free = train.config(["min_replay=100"])
    assert not train.may_sample(free, 99, 99, 0, 32) and train.may_sample(free, 100, 100, 0, 32)
    assert train.may_sample(free, 100, 100, 10**9, 32)  # no limiter: never waits once min_replay is met
    limited = train.config(["min_replay=100", "samples_per_insert=2"])
    assert train.may_sample(limited, 100, 100, 168, 32) and not train.may_sample(limited, 100, 100, 169, 32)
    assert train.may_sample(limited, 120, 120, 169, 32)  # 20 more inserted: 40 more may be sampled


def test_the_batch_setting_is_named_per_replica_and_its_old_name_still_works_with_a_warning() -> None:
    assert train.config(["per_replica_batch=48"]).per_replica_batch == 48
    with pytest.warns(DeprecationWarning, match=r"the setting batch= is deprecated: it counts transitions per "
                                                r"replica; write per_replica_batch=48"):
        cfg = train.config(["batch=48"])
    assert cfg.per_replica_batch == 48
    with pytest.warns(DeprecationWarning, match=r"AppConfig\.batch is deprecated.*per_replica_batch"):
        assert cfg.batch == 48
    with pytest.raises(ConfigError, match=r"'batch=48' and per_replica_batch= are the same setting"), \
            pytest.warns(DeprecationWarning):
        train.config(["batch=48", "per_replica_batch=32"])


def test_settings_are_checked_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'batchsize=3'.*agent\.<key>"):
        train.config(["batchsize=3"])
    with pytest.raises(ConfigError, match="min_replay must be in"):
        train.config(["min_replay=0"])
    with pytest.raises(ConfigError, match=r"Discrete action space.*env=Pendulum-v1"):
        train.env_spec("CartPole-v1")
