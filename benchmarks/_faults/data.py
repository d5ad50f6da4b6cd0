"""Bad data met mid-epoch by `hvrep train` (demo data set, a private copy per injection).

``corrupt_jpeg`` (folder format): the k-th sample of the epoch (in training order, so met at step k // 64 + 1)
is cut to 200 bytes before the run. Point ``raise:sample=K``: the run stops with exit 2 (`horovodrun`: 1) and
one ``hvrep train: error:`` line naming the file; every checkpoint from before is readable; the file is put
back and ``--resume`` ends at the same step with the same weights, bit for bit, as an uninterrupted run on the
good data, having trained as many samples, and keeps every metrics line. Point ``skip:sample=K`` (data.on_error=
skip): the run goes on to its end (exit 0) and its ``skipped`` event counts and names exactly that file.

``truncated_tfrecord`` (TFRecord format): a first run trains to step S and stops (train.max_steps, as a
preemption would); shard J is then cut at the start of its record R, and ``--resume`` meets it in the middle of
the epoch. Under both ``data.on_error`` settings (``raise:shard=J:record=R:at=S``, ``skip:...``) the run stops
with exit 2 naming the shard (the shard no longer matches its index; ``on_error`` is about images, and a shard
cut short has lost records the epoch's plan counts on); once the shard is put back, ``--resume`` ends with the
weights of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks._faults import Injection, Outcome, _kit

STEPS = 8  # per run: the error comes at step 3..7, after a checkpoint (every 2 steps)
EVERY = 2
BATCH = 64


def _args(data: Path, fmt: str, out: Path, on_error: str = "raise", steps: int = STEPS) -> list[str]:
    return ["--config", "demo", f"data.data_dir={data}", f"data.format={fmt}", f"data.on_error={on_error}",
            f"output_dir={out}", f"train.max_steps={steps}", f"checkpoint.every_steps={EVERY}",
            "train.log_every=1", "train.steps_per_loop=1", "train.threads=1"]


def _expected_error_exit(launcher: str) -> int:
    return 1 if _kit.horovodrun(launcher) else 2  # horovodrun exits 1 when a rank fails (troubleshooting.md)


def _ranks(launcher: str) -> int:
    return 1 if _kit.one_process(launcher) else 2


def _reference(workdir: Path, fmt: str, launcher: str) -> Path:
    """The checkpoint of step STEPS of an uninterrupted run on the good data (made once per campaign folder)."""
    ref = workdir.parent / f"_reference-{fmt}-{launcher}"
    done = _kit.checkpoints(ref / "run").get(STEPS)
    if done is not None:
        return done
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    data = _kit.demo_data(ref)
    code = _kit.run(_kit.train_argv(launcher, _args(data / fmt, fmt, ref / "run")), ref / "run.log", _kit.new_tag())
    done = _kit.checkpoints(ref / "run").get(STEPS)
    if code != 0 or done is None:
        raise RuntimeError(f"the reference run failed ({code}): {_kit.tail(ref / 'run.log')}")
    return done


def _training_order(data: Path, fmt: str, ranks: int) -> list[int]:
    from hvrep.data import Segment, epoch_plan
    from hvrep.train import config as configs

    cfg = configs.build("demo", [f"data.data_dir={data}", f"data.format={fmt}"])
    plan = epoch_plan(dataclasses.replace(cfg.data, seed=cfg.data.seed + cfg.train.seed * 1000))
    return [int(i) for i in plan.trained([Segment(ranks, BATCH, STEPS)])]


def _resume_and_compare(inj: Injection, data: Path, fmt: str, out: Path, log: Path, tag: str,
                        before: list[str], ref: Path) -> tuple[list[str], float, int | None]:
    """``--resume`` to STEPS; (what was lost, seconds to the first resumed step, its exit code)."""
    lost = []
    t0 = time.monotonic()
    cmd = _kit.train_argv(inj.launcher, [*_args(data, fmt, out), "--resume"])
    first: list[float] = []
    with _kit.launched(cmd, log, tag) as proc:
        trained = sum(e["event"] == "train" for e in _kit.events(out))
        _kit.wait_for(lambda: sum(e["event"] == "train" for e in _kit.events(out)) > trained, 240, proc)
        first.append(time.monotonic() - t0)
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:  # a hang is an outcome here
            code = None
    if code != 0:
        lost.append(f"the resumed run exited {code}: {_kit.tail(log, 1500)}")
        return lost, first[0], code
    final = _kit.checkpoints(out).get(STEPS)
    if final is None:
        lost.append(f"the resumed run left no checkpoint of step {STEPS}")
        return lost, first[0], code
    lost += _kit.differs_from_uninterrupted(final, ref)
    gone = _kit.lines_gone(before, _kit.lines(out))
    if gone:
        lost.append(f"{len(gone)} metrics line(s) written before the fault are gone, e.g. {gone[0]}")
    return lost, first[0], code


class CorruptJpeg:
    name = "corrupt_jpeg"
    launchers = ("none", "mpirun", "gloo")  # one process, or 2 ranks

    def points(self, rng: random.Random) -> list[str]:
        return [f"{mode}:sample={rng.randrange(2 * BATCH, (STEPS - 1) * BATCH)}"
                for mode in ("raise", "skip") for _ in range(4)]

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        mode, k = inj.point.split(":sample=")
        k = int(k)
        ranks = _ranks(inj.launcher)
        ref = _reference(workdir, "folder", inj.launcher) if mode == "raise" else None
        data = _kit.demo_data(workdir) / "folder"
        from hvrep.data.files import list_folder
        bad = Path(list_folder(data, "train").files[_training_order(data, "folder", ranks)[k]])
        good = bad.read_bytes()
        bad.write_bytes(good[:200])  # no end-of-image marker: what a truncated copy looks like
        at = k // BATCH + 1
        out, tag = workdir / "run", _kit.new_tag()
        code = _kit.run(_kit.train_argv(inj.launcher, _args(data, "folder", out, mode)), workdir / "run.log", tag)
        text = _kit.tail(workdir / "run.log", 200_000)
        lost = [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        saved = _kit.checkpoints(out)
        lost += _kit.unreadable(saved)
        if mode == "skip":
            skipped = [(e["split"], e["count"], e["files"]) for e in _kit.events(out) if e["event"] == "skipped"]
            if skipped != [("train", 1, [str(bad)])]:
                lost.append(f"skipped events {skipped}, not one naming {bad}")
            if STEPS not in saved:
                lost.append(f"no checkpoint of step {STEPS}")
            return Outcome(recovered=code == 0 and not lost, steps_lost=0, recover_s=0.0, lost=lost, exit_code=code,
                           expected_exit=0, detail=f"{bad.name} (sample {k}, step {at}) skipped")
        expected = _expected_error_exit(inj.launcher)
        errors = [line for line in text.splitlines() if line.startswith("hvrep train: error:")]
        if not errors or str(bad) not in errors[0]:
            lost.append(f"no 'hvrep train: error:' line naming {bad}")
        ended = max(saved, default=0)
        if ended >= at:
            lost.append(f"a checkpoint of step {ended} exists, at or past the bad sample's step {at}")
        bad.write_bytes(good)  # the user replaces the file
        more, recover_s, rcode = _resume_and_compare(inj, data, "folder", out, workdir / "resume.log", tag,
                                                     _kit.lines(out), ref)
        lost += more + [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        return Outcome(recovered=code == expected and rcode == 0 and not lost, steps_lost=at - 1 - ended,
                       recover_s=recover_s, lost=lost, exit_code=code, expected_exit=expected,
                       detail=f"{bad.name} (sample {k}) stopped step {at}; resumed from step {ended}")


class TruncatedShard:
    name = "truncated_tfrecord"
    launchers = ("none", "mpirun", "gloo")

    def points(self, rng: random.Random) -> list[str]:
        return [f"{mode}:shard={rng.randrange(4)}:record={rng.randrange(1, 300)}:at={rng.randrange(1, STEPS - 1)}"
                for mode in ("raise", "skip") for _ in range(4)]

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        fields = dict(part.split("=") for part in inj.point.split(":")[1:])
        mode, j, r, at = inj.point.split(":")[0], int(fields["shard"]), int(fields["record"]), int(fields["at"])
        ref = _reference(workdir, "tfrecord", inj.launcher)
        data = _kit.demo_data(workdir) / "tfrecord"
        out, tag = workdir / "run", _kit.new_tag()
        code = _kit.run(_kit.train_argv(inj.launcher, _args(data, "tfrecord", out, mode, steps=at)),
                        workdir / "first.log", tag)
        lost = [] if code == 0 else [f"the first segment exited {code}: {_kit.tail(workdir / 'first.log', 1500)}"]
        shard = sorted(data.glob("train-*"))[j]
        offsets = (data / "idx" / f"{shard.name}.idx").read_text().split()[0::2]
        whole = shard.read_bytes()
        shard.write_bytes(whole[:int(offsets[min(r, len(offsets) - 1)])])
        before = _kit.lines(out)
        saved = _kit.checkpoints(out)
        code = _kit.run(_kit.train_argv(inj.launcher, [*_args(data, "tfrecord", out, mode), "--resume"]),
                        workdir / "run.log", tag)
        text = _kit.tail(workdir / "run.log", 200_000)
        expected = _expected_error_exit(inj.launcher)
        errors = [line for line in text.splitlines() if line.startswith("hvrep train: error:")]
        if not errors or str(shard) not in errors[0]:
            lost.append(f"no 'hvrep train: error:' line naming {shard}")
        lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        lost += _kit.unreadable(saved)
        if _kit.checkpoints(out).keys() - saved.keys():
            lost.append("a checkpoint was saved from data that could not be read")
        shard.write_bytes(whole)  # put back (the user reruns `hvrep data prepare`)
        more, recover_s, rcode = _resume_and_compare(inj, data, "tfrecord", out, workdir / "resume.log", tag,
                                                     _kit.lines(out), ref)
        lost += more + [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        gone = _kit.lines_gone(before, _kit.lines(out))
        if gone:
            lost.append(f"{len(gone)} metrics line(s) of the first segment are gone")
        ended = max(saved, default=0)
        return Outcome(recovered=code == expected and rcode == 0 and not lost, steps_lost=at - ended,
                       recover_s=recover_s, lost=lost, exit_code=code, expected_exit=expected,
                       detail=f"{shard.name} cut at record {r} after step {at}; resumed from step {ended}")


KINDS = [CorruptJpeg(), TruncatedShard()]
