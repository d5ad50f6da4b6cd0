"""The D4PG app (examples/d4pg) under faults: a small Pendulum run (2 actors a rank capped at 150 environment
steps per second, a rate limiter of 2 samples per inserted row, so the learner waits for its actors), on one
rank ("none" or "local") or 2 ("mpirun", "gloo" or "horovodrun": horovodrun --gloo).

Points, each at a learner step S (the chief's ``train`` lines come every 25 steps):
- ``actor_killed:actor=I:step=S``: SIGKILL of rank 0's actor I. Expected: the learner restarts it (an
  ``actor_restart`` event), the run ends at its last step, exit 0.
- ``actors_stopped:step=S``: SIGSTOP of every actor of rank 0. Expected: after ``actor_timeout_s`` (5 s here)
  without a row the learner ends and restarts them, the run ends at its last step, exit 0 (before: the learner
  waited for ever).
- ``learner_killed:step=S:stopped_actor=I`` (I = -1: none): actor I is stopped, then rank 0's learner SIGKILLed.
  Expected: the launch ends (exit 137 from `mpirun` or one process, 1 from `horovodrun`); every actor ends with
  its learner (a stopped one too); the dead learner's replay stays in /dev/shm until the next start, which
  removes it; every checkpoint from before is readable; ``--resume`` ends at the last step and keeps every
  metrics line.
Always: no process of the run and no /dev/shm folder of its learners is left once it has ended.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil

from benchmarks._faults import Injection, Outcome, _kit

STEPS = 600  # the learner needs its actors after a stop at step <= 175: the rows they inserted before are used up
EVERY = 100  # checkpoint_every
LOOP = 25  # steps_per_loop


def _argv(launcher: str, out: Path, resume: bool = False) -> list[str]:
    args = ["-m", "examples.d4pg.train", f"output_dir={out}", f"steps={STEPS}", "per_replica_batch=32",
            "agent.hidden=32,32", "actors_per_rank=2", "actor_steps_per_sec=150", "replay_size=600",
            "min_replay=150", "samples_per_insert=2", f"steps_per_loop={LOOP}", "eval_every=0", "eval_episodes=1",
            f"checkpoint_every={EVERY}", "threads=1", "actor_timeout_s=5", *(["--resume"] if resume else [])]
    return _kit.python_argv(launcher, args)


def _learners(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """Rank -> the learner process (rank 0 alone when one process)."""
    found = {}
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        try:
            if "examples.d4pg.train" not in " ".join(p.cmdline()):
                continue
            env = p.environ()
        except psutil.Error:
            continue
        rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("HOROVOD_RANK") or "0"
        found[int(rank)] = p
    return found


def _ours(folders: set[str], pids: set[int]) -> list[str]:
    """The /dev/shm folders among ``folders`` whose learner is one of ``pids``."""
    mine = []
    for name in folders:
        try:
            owner = json.loads((_kit.SHM / name / "owner.json").read_text())
        except (OSError, ValueError):
            continue
        if int(owner.get("learner", {}).get("pid", -1)) in pids:
            mine.append(name)
    return sorted(mine)


def _expected_kill_exit(launcher: str) -> int:
    return 1 if _kit.horovodrun(launcher) else 128 + signal.SIGKILL


class D4pg:
    name = "d4pg"
    launchers = ("none", "mpirun", "gloo")

    def points(self, rng: random.Random) -> list[str]:
        step = lambda: rng.randrange(2, 8) * LOOP  # noqa: E731
        return ([f"actor_killed:actor={rng.randrange(2)}:step={step()}" for _ in range(3)]
                + [f"actors_stopped:step={step()}" for _ in range(3)]
                + [f"learner_killed:step={step()}:stopped_actor={rng.choice([-1, 0, 1])}" for _ in range(3)])

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        what = inj.point.split(":")[0]
        fields = {k: int(v) for k, v in (part.split("=") for part in inj.point.split(":")[1:])}
        out, log, tag = workdir / "run", workdir / "run.log", _kit.new_tag()
        lost: list[str] = []
        shm_before = _kit.shm_now()
        learner_pids: set[int] = set()
        expected = 0 if what != "learner_killed" else _expected_kill_exit(inj.launcher)
        with _kit.launched(_argv(inj.launcher, out), log, tag) as proc:
            pid_file = out / "actors" / "rank0.pids"
            ready = _kit.wait_for(lambda: _kit.train_steps(out) >= fields["step"] and pid_file.is_file()
                                  and len(_learners(proc)) == (1 if _kit.one_process(inj.launcher) else 2), 480, proc)
            if not ready:
                return Outcome(False, 0, 0.0, [f"never reached {inj.point} ({proc.poll()}): {_kit.tail(log)}"],
                               proc.poll(), expected)
            learners = _learners(proc)
            learner_pids = {p.pid for p in learners.values()}
            actors = json.loads(pid_file.read_text())
            at = _kit.train_steps(out)
            hit = time.time()
            if what == "actor_killed":
                victims = [psutil.Process(actors[fields["actor"]])]
                victims[0].kill()
            elif what == "actors_stopped":
                victims = [psutil.Process(pid) for pid in actors]
                for v in victims:
                    v.send_signal(signal.SIGSTOP)
            else:
                victims = [psutil.Process(pid) for pid in actors]
                if fields["stopped_actor"] >= 0:
                    victims[fields["stopped_actor"]].send_signal(signal.SIGSTOP)
                saved = _kit.checkpoints(out)
                learners[0].kill()
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                code = None
                lost.append("the run did not end within 300 s of the fault: a hang")
        if code is not None and code < 0:  # one process, killed: as a shell (and mpirun) reports it
            code = 128 - code
        # An actor ends by the kernel's SIGKILL when its learner dies: asynchronous, so given a little time.
        _kit.wait_for(lambda: not any(_alive(v) for v in victims), 15)
        ended = [v.pid for v in victims if _alive(v)]
        if ended:
            lost.append(f"actor(s) {ended} outlived the run")
        lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 20)]
        events = _kit.events(out)
        text = _kit.tail(log, 400_000)
        if what != "learner_killed":
            final = events[-1] if events else {}
            if (final.get("event"), final.get("stopped"), final.get("step")) != ("final", "completed", STEPS):
                lost.append(f"the run did not complete its {STEPS} steps: {str(final)[:200]}")
            restarts = [e for e in events if e["event"] == "actor_restart"]
            if not restarts:
                lost.append("no actor_restart event")
            if what == "actors_stopped" and "inserted nothing for" not in text:
                lost.append("no line saying the stopped actors were ended and restarted")
            recover_s = restarts[0]["time"] - hit if restarts else 0.0
            stale = _ours(_kit.shm_now() - shm_before, learner_pids)
            if stale:
                lost.append(f"/dev/shm folders left: {stale}")
            return Outcome(recovered=code == expected and not lost, steps_lost=0, recover_s=round(recover_s, 1),
                           lost=lost, exit_code=code, expected_exit=expected,
                           detail=f"{what} at step {at}: {len(restarts)} restart event(s)")
        # The learner killed: its replay stays until the next start proves it gone and removes it.
        dead = _ours(_kit.shm_now() - shm_before, {learners[0].pid})
        lost += _kit.unreadable(saved)
        before = _kit.lines(out)
        newest = max(_kit.checkpoints(out), default=0)
        t0 = time.monotonic()
        trained = sum(e["event"] == "train" for e in _kit.events(out))
        with _kit.launched(_argv(inj.launcher, out, resume=True), workdir / "resume.log", tag) as proc:
            _kit.wait_for(lambda: sum(e["event"] == "train" for e in _kit.events(out)) > trained, 400, proc)
            recover_s = time.monotonic() - t0  # to the resumed run's first train line
            try:
                rcode = proc.wait(timeout=400)
            except subprocess.TimeoutExpired:
                rcode = None
        rtext = _kit.tail(workdir / "resume.log", 400_000)
        lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 20)]
        # Any D4PG start on the machine removes a dead run's replay (another run's start may come first).
        removed_here = sum(name in rtext for name in dead)
        for name in dead:
            if (_kit.SHM / name).exists():
                lost.append(f"the dead learner's replay {name} is still in /dev/shm after the next start")
        stale = _ours(_kit.shm_now() - shm_before, learner_pids)
        if stale:
            lost.append(f"/dev/shm folders left: {stale}")
        final = (_kit.events(out) or [{}])[-1]
        if rcode != 0 or (final.get("event"), final.get("step")) != ("final", STEPS):
            lost.append(f"the resumed run exited {rcode}, last event {str(final)[:150]}")
        gone = _kit.lines_gone(before, _kit.lines(out))
        if gone:
            lost.append(f"{len(gone)} metrics line(s) from before the kill are gone, e.g. {gone[0]}")
        return Outcome(recovered=code == expected and rcode == 0 and not lost, steps_lost=max(0, at - newest),
                       recover_s=round(recover_s, 1), lost=lost, exit_code=code, expected_exit=expected,
                       detail=f"learner killed at step {at}; {len(dead)} replay folder(s) left, {removed_here} "
                              f"removed by the resume (the others by another start); resumed from step {newest}")


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


KINDS = [D4pg()]
