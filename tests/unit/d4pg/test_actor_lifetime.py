"""D4PG actors end with their learner, however it ends, and a new start removes a dead run's shared memory
only once its owner is proven gone.

The learner here is a stand-in process that starts real actors (``ActorPool``) and is then SIGKILLed, as the
OOM killer or the hang watchdog's ``os._exit`` would end it: no cleanup code of its own runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from examples.d4pg import shm
from examples.d4pg.actors import ROOT
from examples.d4pg.replay import Replay
from hvrep.replica.identity import ProcessIdentity

_LEARNER = """
import sys, time, numpy as np
from pathlib import Path
from examples.d4pg import policy
from examples.d4pg.actor import ActorSpec
from examples.d4pg.actors import ActorPool
from examples.d4pg.replay import Board, Replay
folder = Path(sys.argv[1])
Replay(folder, 2, 4096, 3, 1, create=True)
board = Board(folder, policy.num_weights(3, 1, (8,)), create=True)
board.publish(np.zeros(board.weights.shape, np.float32), step=1)
specs = [ActorSpec(folder=str(folder), index=i, num_actors=2, capacity=4096, env="Pendulum-v1", seed=i,
                   hidden=(8,), sigma=0.3, n_step=3, gamma=0.99, max_steps_per_sec=500) for i in range(2)]
pool = ActorPool(specs, folder / "logs", "rank0")
pool.start()
print(" ".join(map(str, pool.pids())), flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z...), or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()[0]


def _ended(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _state(pid) in (None, "Z"):  # a zombie has ended; reaping it is its new parent's business
            return True
        time.sleep(0.05)
    return False


def test_actors_end_with_a_sigkilled_learner_a_stopped_one_too(tmp_path):
    learner = subprocess.Popen([sys.executable, "-c", _LEARNER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    actors = [int(p) for p in learner.stdout.readline().split()]
    try:
        assert len(actors) == 2
        replay = Replay(tmp_path, 2, 4096, 3, 1, create=False)
        end = time.monotonic() + 60
        while (replay.counters[:, 0] == 0).any() and time.monotonic() < end:  # both started and stepping
            time.sleep(0.05)
        assert (replay.counters[:, 0] > 0).all()
        os.kill(actors[0], signal.SIGSTOP)
        learner.kill()
        learner.wait(timeout=30)
        still = [(pid, _state(pid)) for pid in actors if not _ended(pid, timeout=15)]
        assert still == [], f"actors left behind by the dead learner (pid, state): {still}"
    finally:
        learner.kill()
        for pid in actors:
            if _state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


def _owned_by(folder: Path, learner: dict, actors: list[dict]) -> Path:
    folder.mkdir()
    (folder / shm.OWNER).write_text(json.dumps({"learner": learner, "actors": actors}))
    (folder / "rows.bin").write_bytes(b"\0" * 4096)
    return folder


def test_a_new_start_removes_only_folders_whose_learner_is_proven_gone(tmp_path):
    prefix = f"{shm.PREFIX}test-{uuid.uuid4().hex[:8]}-"
    me = ProcessIdentity.mine()
    # A dead run: its learner ended (a process that exited), one of its actors is stopped and still there.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = dataclasses.replace(me, pid=int(dead.stdout), start=me.start + 1)
    actor = subprocess.Popen(["sleep", "300"])
    try:
        os.kill(actor.pid, signal.SIGSTOP)
        stopped_actor = ProcessIdentity.of(actor.pid)
        assert stopped_actor is not None
        dead_run = _owned_by(tmp_path / f"{prefix}dead", gone.to_json(), [stopped_actor.to_json()])
        # The pid of a living process, recorded with another start time: another process had that pid.
        reused = _owned_by(tmp_path / f"{prefix}reused", dataclasses.replace(me, start=me.start - 1).to_json(), [])
        alive = _owned_by(tmp_path / f"{prefix}alive", me.to_json(), [])  # this process: a learner that runs
        other_ns = _owned_by(tmp_path / f"{prefix}ns", dataclasses.replace(gone, pid_ns="pid:[1]").to_json(), [])
        other_boot = _owned_by(tmp_path / f"{prefix}boot", dataclasses.replace(gone, boot_id="x").to_json(), [])
        unowned = tmp_path / f"{prefix}unowned"
        unowned.mkdir()
        removed = shm.remove_dead(prefix, base=tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in (alive, other_ns, other_boot, unowned))
        assert len(removed) == 2 and str(dead_run) in removed[0] and str(actor.pid) in removed[0]
        assert str(reused) in removed[1]
        assert actor.wait(timeout=10) == -signal.SIGKILL  # the stopped actor was continued and ended
    finally:
        if actor.poll() is None:
            os.kill(actor.pid, signal.SIGCONT)
            actor.kill()
            actor.wait()


def test_the_folder_a_learner_makes_names_it_and_its_actors(tmp_path):
    actor = subprocess.Popen(["sleep", "300"])
    try:
        folder = shm.make_folder(f"{shm.PREFIX}test-{uuid.uuid4().hex[:8]}-")
        try:
            shm.record_owner(folder, [actor.pid])
            record = json.loads((folder / shm.OWNER).read_text())
            assert ProcessIdentity.from_json(record["learner"]) == ProcessIdentity.mine()
            assert [ProcessIdentity.from_json(a) for a in record["actors"]] == [ProcessIdentity.of(actor.pid)]
            assert shm.remove_dead(folder.name, base=folder.parent) == [] and folder.is_dir()  # its owner runs
        finally:
            for f in folder.iterdir():
                f.unlink()
            folder.rmdir()
    finally:
        actor.kill()
        actor.wait()
