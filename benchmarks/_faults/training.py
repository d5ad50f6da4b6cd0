"""Faults of the training app (`hvrep train`, the demo preset made tiny): a run takes seconds.

Each injection starts a fresh run with ``HVREP_FAULT`` (hvrep.train.faultpoint) set, lets the fault end it,
damages a file where the kind says so, then resumes the run to its end and checks "nothing lost" (issue 49):

- every checkpoint completed before the fault reads back whole (``checkpoint.damage``), the newest of them
  included, except the one the kind damaged on purpose;
- the resumed run ends with the same weights as an uninterrupted run of the same launcher (bit-identical is
  reported in ``detail``; a difference above 1e-6 is a loss): it trained each sample of the epoch once;
- every ``metrics.jsonl`` line written before the fault is still there, in order;
- no process of the run is left (each run's processes carry a tag in their environment);
- the faulted run's exit code is the one docs/troubleshooting.md gives (``expected_exit``).

The run: 1,437 demo images, global batch 64, 22 steps, a checkpoint every ``INTERVAL`` steps (saves 1-4 at
steps 5, 10, 15, 20; save 5 at the epoch's end), a metrics line every step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._faults import Injection, Outcome

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
INTERVAL = 5  # checkpoint.every_steps
STEPS = 22  # one epoch of the demo set at global batch 64
SAVES = (5, 10, 15, 20)  # the steps of saves 1-4 (save 5 is the epoch's end, 22)
MPIRUN_FLAGS = ("--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1")
TAG = "HVREP_FAULT_CAMPAIGN_TAG"  # in every process of a run, to find any left behind (hvrep does not read it)
KILLED = 128 + signal.SIGKILL  # what a shell, and mpirun, report for a process killed by SIGKILL
TIMEOUT_S = 300.0

# The exit codes docs/troubleshooting.md's "Exit codes" section gives.
EXIT_NO_SPACE = 74


def _args(data: Path, out: Path) -> list[str]:
    return ["--config", "demo", f"data.data_dir={data}", f"output_dir={out}", "model.width=4", "train.epochs=1",
            f"checkpoint.every_steps={INTERVAL}", "checkpoint.keep=3", "train.log_every=1", "train.steps_per_loop=1",
            "optim.warmup_epochs=0", "train.threads=1"]


def _command(launcher: str, args: list[str]) -> list[str]:
    """``hvrep train args``: one process ("none"), or 2 ranks under mpirun or horovodrun --gloo."""
    train = [sys.executable, "-m", "hvrep.cli", "train", *args]
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "-np", "2", *MPIRUN_FLAGS, *train]
    if launcher == "gloo":
        return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *train]
    return train


def _env(fault: str | None, tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1", **{TAG: tag})
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("HVREP_FAULT", None)
    if fault:
        env["HVREP_FAULT"] = fault
    return env


def _tagged(tag: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TAG) == tag:
                found.append(p.pid)
    return found


def launch(launcher: str, args: list[str], log: Path, fault: str | None = None) -> tuple[int | None, float, list[int]]:
    """Runs ``hvrep train args`` to its end. Returns (exit code as a shell reports it, None past the timeout;
    seconds; pids of its processes still alive 3 s after it ended, which are then killed)."""
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(launcher, args), stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=_env(fault, tag), start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - t0
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL) if code is None else None
    proc.wait()
    left: list[int] = []
    for _ in range(6):  # a launcher may return while its ranks are still on their way out
        left = _tagged(tag)
        if not left:
            break
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if code is not None and code < 0:
        code = 128 - code
    return code, seconds, left


def demo_data(cache: Path) -> Path:
    """The demo data set, written once under ``cache``."""
    root = cache / "demo-data"
    if not (root / "done").is_file():
        from hvrep.data import write_demo

        shutil.rmtree(root, ignore_errors=True)
        write_demo(root)
        (root / "done").write_text("")
    return root / "tfrecord"


def _weights(run: Path) -> dict[str, Any]:
    """The variables of a run's newest checkpoint."""
    import tensorflow as tf

    from hvrep.train.checkpoint import CheckpointManager

    folder = CheckpointManager(run / "checkpoints", is_chief=False, keep=3, x=tf.Variable(0)).latest()
    if folder is None:
        return {}
    reader = tf.train.load_checkpoint(str(folder / "ckpt"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith("model/") and "OPTIMIZER_SLOT" not in name}


def reference(cache: Path, launcher: str) -> dict[str, Any]:
    """The final weights of an uninterrupted run under ``launcher`` (run once per cache and launcher)."""
    run = cache / f"reference-{launcher}"
    if not (run / "done").is_file():
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        code, _, _ = launch(launcher, _args(demo_data(cache), run / "out"), run / "log.txt")
        if code != 0:
            raise RuntimeError(f"the reference run under {launcher} failed ({code}): see {run / 'log.txt'}")
        (run / "done").write_text("")
    return _weights(run / "out")


@contextlib.contextmanager
def tmpfs(folder: Path, size: str = "48m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``folder`` (made if missing) while the block runs: a small output file system
    to fill up (root only). Unmounted lazily afterwards, even if the block failed."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _lines(path: Path) -> list[str]:
    """The complete lines of a metrics.jsonl (a torn last line is not one)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    return [line for line in text.split("\n")[:-1] if line.strip()]


def _kept_in_order(before: list[str], after: list[str]) -> list[str]:
    """Lines of ``before`` missing from ``after`` (in order)."""
    it = iter(after)
    return [line for line in before if not any(line == other for other in it)]


def _checkpoints(run: Path) -> dict[int, str | None]:
    """Every complete checkpoint of a run by step: None when it reads back whole, else why not."""
    from hvrep.train.checkpoint import damage

    found = {}
    for folder in sorted((run / "checkpoints").glob("ckpt-*")):
        if (folder / "checkpoint.json").is_file():
            found[int(folder.name.split("-")[1])] = damage(folder)
    return found


def _last_step(lines: list[str], event: str = "train") -> int:
    steps = [0]
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == event and isinstance(record.get("step"), int):
                steps.append(record["step"])
    return steps[-1]


def _first_step(lines: list[str]) -> int:
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "train" and isinstance(record.get("step"), int):
                return record["step"]
    return 1


class _TrainingKind:
    """A fault that ends a run of ``hvrep train``; subclasses say where, and what is damaged afterwards."""

    name = ""
    launchers: tuple[str, ...] = ("none",)

    def points(self, rng: random.Random) -> list[str]:
        raise NotImplementedError

    def fault(self, inj: Injection, rng: random.Random) -> str:
        """The HVREP_FAULT of this injection."""
        raise NotImplementedError

    def expected_exit(self, inj: Injection) -> int:
        return KILLED if self._launcher(inj) != "gloo" else 1

    def newest_before(self, inj: Injection, rng: random.Random) -> int:
        """The step of the newest checkpoint the fault must leave complete."""
        raise NotImplementedError

    def damage(self, inj: Injection, rng: random.Random, run: Path) -> tuple[int | None, str]:
        """Damages the run's files after the fault; returns (the step of a checkpoint damaged on purpose, what)."""
        return None, ""

    def mount(self, folder: Path) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def make_space(self, run: Path) -> None:
        """Undoes the fault before the resume (a full disk: delete the filler)."""

    def _launcher(self, inj: Injection) -> str:
        return inj.launcher if inj.launcher in self.launchers else self.launchers[0]

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        rng = random.Random(f"{inj.kind}/{inj.point}/{inj.seed}")
        launcher = self._launcher(inj)
        cache = workdir.parent / "_training-cache"
        cache.mkdir(parents=True, exist_ok=True)
        want = reference(cache, launcher)
        data = demo_data(cache)
        fault = self.fault(inj, rng)
        lost: list[str] = []
        workdir.mkdir(parents=True, exist_ok=True)
        with self.mount(workdir / "mnt"):
            run = workdir / "mnt" / "run"
            code, _, left = launch(launcher, _args(data, run), workdir / "fault.log", fault)
            lost += [f"process {pid} of the faulted run left behind" for pid in left]
            before = _lines(run / "metrics.jsonl")
            fault_step = _last_step(before)
            kept = _checkpoints(run)
            newest = self.newest_before(inj, rng)
            if newest and newest not in kept:
                lost.append(f"checkpoint step {newest}, completed before the fault, is missing")
            lost += [f"checkpoint step {s} unreadable after the fault: {why}" for s, why in kept.items() if why]
            _, what = self.damage(inj, rng, run)
            self.make_space(run)
            t0 = time.monotonic()
            rcode, _, left = launch(launcher, [*_args(data, run), "--resume"], workdir / "resume.log")
            recover_s = time.monotonic() - t0
            lost += [f"process {pid} of the resumed run left behind" for pid in left]
            after = _lines(run / "metrics.jsonl")
            gone = _kept_in_order(before, after)
            if gone:
                lost.append(f"{len(gone)} metrics line(s) written before the fault are gone, e.g. {gone[0][:80]}")
            # The resumed run's first train line is the step after the checkpoint it resumed from.
            resumed_at = max(0, _first_step(after[len(before):]) - 1)
            final = [line for line in after[len(before):] if '"event": "final"' in line]
            recovered = rcode == 0 and bool(final) and '"stopped": "completed"' in final[-1]
            got = _weights(run) if recovered else {}
        diff = max((float(abs(got[k].astype("float64") - v.astype("float64")).max()) for k, v in want.items()
                    if k in got), default=float("inf"))
        if recovered and (set(got) != set(want) or diff > 1e-6):
            lost.append(f"the resumed run's weights differ from an uninterrupted run's (max |diff| {diff:.3g})")
        identical = recovered and set(got) == set(want) and diff == 0.0
        detail = (f"fault {fault} under {launcher}; {what + '; ' if what else ''}resumed at step {resumed_at} "
                  f"(exit {rcode}); weights {'bit-identical' if identical else f'max |diff| {diff:.3g}'}")
        return Outcome(recovered=recovered and not lost, steps_lost=max(0, fault_step - resumed_at),
                       recover_s=round(recover_s, 2), lost=lost, exit_code=code,
                       expected_exit=self.expected_exit(inj), detail=detail)


class CheckpointSaveKill(_TrainingKind):
    """SIGKILL inside a checkpoint save, at one of its named points (hvrep.train.faultpoint)."""

    name = "ckpt_save_kill"
    POINTS = ("ckpt.before_data", "ckpt.data", "ckpt.before_metadata", "ckpt.before_rename")

    def points(self, rng: random.Random) -> list[str]:
        return list(self.POINTS)

    def _save(self, rng: random.Random) -> int:
        return rng.randint(2, len(SAVES))  # the n-th save (a save before it completed)

    def fault(self, inj: Injection, rng: random.Random) -> str:
        n = self._save(rng)
        return f"kill:{inj.point}@{n}+{rng.randint(0, 4000)}"

    def newest_before(self, inj: Injection, rng: random.Random) -> int:
        return SAVES[self._save(random.Random(f"{inj.kind}/{inj.point}/{inj.seed}")) - 2]


class RankKill(_TrainingKind):
    """SIGKILL of one rank (rank 1, or rank 0, the chief) or of every rank, between steps or at a collective."""

    launchers = ("mpirun", "gloo")

    def __init__(self, name: str, whole_job: bool) -> None:
        self.name, self.whole_job = name, whole_job

    def points(self, rng: random.Random) -> list[str]:
        return ["step.between", "step.collective"]

    def _step(self, rng: random.Random) -> int:
        return rng.randint(3, STEPS - 2)

    def fault(self, inj: Injection, rng: random.Random) -> str:
        step = self._step(rng)
        rank = "" if self.whole_job else f"/{rng.randint(0, 1)}"
        return f"kill:{inj.point}@{step}{rank}"

    def newest_before(self, inj: Injection, rng: random.Random) -> int:
        step = self._step(random.Random(f"{inj.kind}/{inj.point}/{inj.seed}"))
        # step.between comes after the step's save; step.collective before it.
        done = step if inj.point == "step.between" else step - 1
        return done // INTERVAL * INTERVAL


class DiskFull(_TrainingKind):
    """The output file system (a small tmpfs) fills up inside a checkpoint save or before a metrics line."""

    name = "disk_full"

    def points(self, rng: random.Random) -> list[str]:
        return ["ckpt.before_data", "ckpt.data", "ckpt.before_metadata", "metrics.write"]

    def _n(self, inj: Injection, rng: random.Random) -> int:
        return rng.randint(2, len(SAVES)) if inj.point.startswith("ckpt.") else rng.randint(4, STEPS - 2)

    def fault(self, inj: Injection, rng: random.Random) -> str:
        return f"fill:{inj.point}@{self._n(inj, rng)}+{rng.randint(0, 4000)}"

    def expected_exit(self, inj: Injection) -> int:
        return EXIT_NO_SPACE

    def newest_before(self, inj: Injection, rng: random.Random) -> int:
        n = self._n(inj, random.Random(f"{inj.kind}/{inj.point}/{inj.seed}"))
        # After a metrics line fills the disk, the run goes on until a write needs a new page: a later save
        # may fail, so only the saves before the fill are sure to be complete. The n-th metrics line is step
        # n - 1's (the first is the run's `config`), written before that step's save: the fill before it can
        # stop that save (`fill:metrics.write@6` stopped step 5's: the campaign of 2026-11-27 wrongly counted it).
        return SAVES[n - 2] if inj.point.startswith("ckpt.") else (n - 2) // INTERVAL * INTERVAL

    def mount(self, folder: Path) -> contextlib.AbstractContextManager[Path]:
        return tmpfs(folder)

    def make_space(self, run: Path) -> None:
        from hvrep.train.faultpoint import FILL_NAME

        for filler in run.rglob(FILL_NAME):
            filler.unlink()


class _KillThenDamage(_TrainingKind):
    """A run killed between steps (after a save), whose files are then damaged as a disk fault would."""

    def _step(self, rng: random.Random) -> int:
        # Killed after a step from a save on, before the run's last step: after step 22 (the end) no step is left
        # to kill before, so such a fault never fires (the campaign of 2026-11-27 drew steps 23 and 24 four
        # times); after the last save (20) only steps 20 and 21 remain.
        save = rng.choice([s for s in SAVES if s > INTERVAL])
        return save + rng.randint(0, min(INTERVAL - 1, STEPS - 1 - save))

    def fault(self, inj: Injection, rng: random.Random) -> str:
        return f"kill:step.between@{self._step(rng)}"

    def newest_before(self, inj: Injection, rng: random.Random) -> int:
        return self._step(random.Random(f"{inj.kind}/{inj.point}/{inj.seed}")) // INTERVAL * INTERVAL

    @staticmethod
    def _cut_newest(rng: random.Random, run: Path, file_name: str, what: str) -> tuple[int, str]:
        """Cuts ``file_name`` of the newest checkpoint to a random k bytes; (its step, what was done)."""
        folder = sorted((run / "checkpoints").glob("ckpt-*"))[-1]
        file = folder / file_name
        k = rng.randint(0, file.stat().st_size - 1)
        os.truncate(file, k)
        return int(folder.name.split("-")[1]), f"{folder.name}{what} cut to {k} bytes"


class TornMetrics(_KillThenDamage):
    """A torn last line in metrics.jsonl: the first k bytes of a line, no newline (a crash mid-write)."""

    name = "torn_metrics"

    def points(self, rng: random.Random) -> list[str]:
        return ["metrics.write"]

    def damage(self, inj: Injection, rng: random.Random, run: Path) -> tuple[int | None, str]:
        line = json.dumps({"event": "train", "time": time.time(), "step": 99, "loss": 2.0})
        k = rng.randint(1, len(line) - 1)
        with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(line[:k])
        return None, f"metrics.jsonl's last line torn after {k} bytes"


class TornCheckpointJson(_KillThenDamage):
    """The newest checkpoint's checkpoint.json cut to k bytes (a disk fault after it was published)."""

    name = "torn_checkpoint_json"

    def points(self, rng: random.Random) -> list[str]:
        return ["checkpoint.json"]

    def damage(self, inj: Injection, rng: random.Random, run: Path) -> tuple[int | None, str]:
        return self._cut_newest(rng, run, "checkpoint.json", "/checkpoint.json")


class TruncatedCheckpoint(_KillThenDamage):
    """The newest checkpoint's data file cut to k bytes (a copy cut short, a disk fault)."""

    name = "truncated_checkpoint"

    def points(self, rng: random.Random) -> list[str]:
        return ["ckpt.data"]

    def damage(self, inj: Injection, rng: random.Random, run: Path) -> tuple[int | None, str]:
        return self._cut_newest(rng, run, "ckpt.data-00000-of-00001", "'s data file")


KINDS: list = [CheckpointSaveKill(), RankKill("kill_one_rank", whole_job=False), RankKill("kill_job", whole_job=True),
               DiskFull(), TornMetrics(), TornCheckpointJson(), TruncatedCheckpoint()]


def _main() -> None:  # one injection by hand: python -m benchmarks._faults.training KIND POINT SEED LAUNCHER
    kind = next(k for k in KINDS if k.name == sys.argv[1])
    inj = Injection(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    print(kind.run(inj, Path(tempfile.mkdtemp(prefix="hvrep-fault-")) / "one"))


if __name__ == "__main__":
    _main()
