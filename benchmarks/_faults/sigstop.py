"""SIGSTOP of one rank of a 2-rank `hvrep train` (demo), with a short watchdog timeout (comm.timeout_s=15).

Points: ``custom:rank=R:step=S`` (hvrep's loop: rank R is stopped once the chief has logged step S),
``fit:rank=R:epoch=E`` (train.loop=fit, which logs once an epoch: stopped once epoch E is logged, inside the
next epoch's model.fit), ``elastic:rank=1:step=S`` (horovodrun's elastic driver, 1 to 2 workers).

Expected: the hang is detected and every rank ends, the stopped one included (its launcher kills it: a
stopped rank cannot end itself), with exit 75 (docs/troubleshooting.md; `horovodrun` exits 1 whenever a rank
fails); every checkpoint from before the stop is readable and none is half written; ``--resume`` ends the run
with the same weights as an uninterrupted 2-rank run of the same launcher (bit for bit in the custom loop) and
the metrics lines from before are all kept. Elastic: rank 0's watchdog ends the stopped worker alone, the
other goes on, and the job ends 0 at its last step.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from benchmarks._faults import Injection, Outcome, _kit
from hvrep.errors import EXIT_HANG
from hvrep.train.config import CheckpointConfig

TIMEOUT_S = 15
STEPS = 10  # custom loop: checkpoints every 2 steps
FIT_EPOCHS = 3  # fit: 22 steps an epoch, a checkpoint at each epoch's end
EVERY = 2


def _data() -> Path:
    from hvrep import _env
    from hvrep.data import write_demo

    cache = _env.cache_dir() / "demo-data"
    write_demo(cache)
    return cache / "tfrecord"  # only read: the shared copy


def _args(loop: str, out: Path) -> list[str]:
    common = ["--config", "demo", f"data.data_dir={_data()}", f"output_dir={out}", f"comm.timeout_s={TIMEOUT_S}",
              "train.threads=1", "train.steps_per_loop=1"]
    if loop == "fit":
        return [*common, "train.loop=fit", f"train.epochs={FIT_EPOCHS}", "train.eval_every=100"]
    return [*common, f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "train.log_every=1"]


def _rank_processes(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    found = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "hvrep.cli" not in " ".join(p.cmdline()):
                continue
            env = p.environ()
            rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("HOROVOD_RANK")
        except psutil.Error:
            continue
        if rank is not None:
            found[int(rank)] = p
    return found


def _reference(workdir: Path, loop: str, launcher: str) -> Path:
    ref = workdir.parent / f"_reference-{loop}-{launcher}"
    last = _final_step(loop)
    done = _kit.checkpoints(ref / "run").get(last)
    if done is not None:
        return done
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    code = _kit.run(_kit.train_argv(launcher, _args(loop, ref / "run")), ref / "run.log", _kit.new_tag(), timeout=600)
    done = _kit.checkpoints(ref / "run").get(last)
    if code != 0 or done is None:
        raise RuntimeError(f"the reference run failed ({code}): {_kit.tail(ref / 'run.log')}")
    return done


def _final_step(loop: str) -> int:
    return FIT_EPOCHS * 22 if loop == "fit" else STEPS


def _expected(launcher: str) -> int:
    return 1 if _kit.horovodrun(launcher) else EXIT_HANG.code


class SigStop:
    name = "sigstop"
    launchers = ("mpirun", "gloo")  # elastic points run under horovodrun's elastic driver whatever is asked

    def points(self, rng: random.Random) -> list[str]:
        return ([f"custom:rank={rng.randrange(2)}:step={rng.randrange(3, STEPS - 1)}" for _ in range(4)]
                + [f"fit:rank={rng.randrange(2)}:epoch={rng.randrange(1, FIT_EPOCHS)}" for _ in range(2)]
                + [f"elastic:rank=1:step={rng.randrange(3, 12)}" for _ in range(2)])

    def run(self, inj: Injection, workdir: Path) -> Outcome:
        loop = inj.point.split(":")[0]
        fields = dict(part.split("=") for part in inj.point.split(":")[1:])
        if loop == "elastic":
            return _elastic(inj, workdir, int(fields["step"]))
        rank = int(fields["rank"])
        ref = _reference(workdir, loop, inj.launcher)
        out, log, tag = workdir / "run", workdir / "run.log", _kit.new_tag()
        lost: list[str] = []
        if loop == "fit":
            epoch = int(fields["epoch"])
            ready = lambda: sum(e["event"] == "epoch" for e in _kit.events(out)) >= epoch  # noqa: E731
        else:
            step = int(fields["step"])
            ready = lambda: _kit.train_steps(out) >= step  # noqa: E731
        with _kit.launched(_kit.train_argv(inj.launcher, _args(loop, out)), log, tag) as proc:
            if not _kit.wait_for(lambda: ready() and len(_rank_processes(proc)) == 2, 300, proc):
                return Outcome(False, 0, 0.0, [f"never reached {inj.point} ({proc.poll()}): {_kit.tail(log)}"],
                               proc.poll(), _expected(inj.launcher))
            victim = _rank_processes(proc)[rank]
            victim.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            stopped_step = _kit.train_steps(out)
            saved = _kit.checkpoints(out)  # complete before the stop
            try:
                code = proc.wait(timeout=TIMEOUT_S + 90)
            except subprocess.TimeoutExpired:
                code = None
                lost.append(f"the job still ran {TIMEOUT_S + 90} s after the stop: a hang")
            detected_s = time.monotonic() - stopped_at
            time.sleep(1)
            if _kit.outlived(victim):
                lost.append(f"the stopped rank {rank} (pid {victim.pid}) outlived its job")
        lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        text = _kit.tail(log, 400_000)
        if "has not completed within comm.timeout_s" not in text:
            lost.append("no watchdog report in the job's output")
        events = _kit.events(out)
        final = events[-1] if events else {}
        if rank != 0 and (final.get("event"), final.get("stopped")) != ("final", "timeout"):
            lost.append(f"the last event is not a final stopped=timeout: {str(final)[:200]}")
        now = _kit.checkpoints(out)
        # The chief's save of the step it had logged may complete after the stop and rotate out the oldest.
        lost += _kit.unreadable(_kit.not_rotated(saved, now, CheckpointConfig().keep))
        newest = max(now, default=0)
        before = _kit.lines(out)
        trained = sum(e["event"] in ("train", "epoch") for e in events)
        t0 = time.monotonic()
        cmd = _kit.train_argv(inj.launcher, [*_args(loop, out), "--resume"])
        with _kit.launched(cmd, workdir / "resume.log", tag) as proc:
            _kit.wait_for(lambda: sum(e["event"] in ("train", "epoch") for e in _kit.events(out)) > trained, 400,
                          proc)
            recover_s = time.monotonic() - t0
            try:
                rcode = proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                rcode = None
        lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
        final_ckpt = _kit.checkpoints(out).get(_final_step(loop))
        if rcode != 0 or final_ckpt is None:
            lost.append(f"the resumed run exited {rcode}: {_kit.tail(workdir / 'resume.log', 1500)}")
        else:
            lost += _kit.differs_from_uninterrupted(final_ckpt, ref)
        gone = _kit.lines_gone(before, _kit.lines(out))
        if gone:
            lost.append(f"{len(gone)} metrics line(s) from before the stop are gone, e.g. {gone[0]}")
        # A chief stopped inside a save leaves its temporary folder; the resumed run's first save removes it.
        if list((out / "checkpoints").glob(".tmp-*")):
            lost.append("a half-written checkpoint folder is left after the resumed run")
        expected = _expected(inj.launcher)
        last_step = stopped_step if loop == "custom" else max(saved, default=0)
        return Outcome(recovered=code == expected and rcode == 0 and not lost,
                       steps_lost=max(0, last_step - newest), recover_s=round(detected_s + recover_s, 1),
                       lost=lost, exit_code=code, expected_exit=expected,
                       detail=f"rank {rank} stopped at step {stopped_step}; ended {detected_s:.0f} s later; "
                              f"resumed from step {newest}")


def _elastic(inj: Injection, workdir: Path, step: int) -> Outcome:
    from tests.multirank import elastic_checks

    out, log, tag = workdir / "run", workdir / "run.log", _kit.new_tag()
    workdir.mkdir(parents=True, exist_ok=True)
    hosts = workdir / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    steps = 40
    cmd = [str(_kit.harness.BIN / "hvrep"), "launch", "--np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(elastic_checks.discovery_script(workdir, hosts)), "--launcher-args",
           "--network-interface lo", "--", _kit.sys.executable, "-m", "hvrep.cli", "train", "--config", "demo",
           f"data.data_dir={_data()}", f"output_dir={out}", "elastic.min_np=1", "elastic.max_np=2",
           "elastic.commit_every_steps=4", "train.log_every=1", f"train.max_steps={steps}", "train.threads=1",
           f"comm.timeout_s={TIMEOUT_S}", f"checkpoint.every_steps={EVERY * 5}", "checkpoint.keep=10"]
    lost: list[str] = []
    with _kit.launched(cmd, log, tag) as proc:
        victim, at = elastic_checks.signal_rank_1(proc, lambda: _kit.train_steps(out) >= step, signal.SIGSTOP,
                                                  time.monotonic() + 300)
        if victim is None:
            return Outcome(False, 0, 0.0, [f"never reached {inj.point}: {_kit.tail(log)}"], proc.poll(), 0)
        stopped_step = _kit.train_steps(out)
        saved = _kit.checkpoints(out)
        try:
            code = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            code = None
            lost.append("the elastic job did not end within 400 s")
        if _kit.outlived(victim):
            lost.append(f"the stopped worker (pid {victim.pid}) outlived the job")
    lost += [f"left behind: {p}" for p in _kit.gone_within(tag, 10)]
    events = _kit.events(out)
    resets = [e for e in events if e["event"] == "reset"]
    final = events[-1] if events else {}
    if (final.get("event"), final.get("step"), final.get("replicas")) != ("final", steps, 1):
        lost.append(f"the job did not end at step {steps} on 1 worker: {str(final)[:200]}")
    if [(r.get("old_world"), r.get("new_world")) for r in resets] != [(2, 1)]:
        lost.append(f"resets {[(r.get('why'), r.get('old_world'), r.get('new_world')) for r in resets]}, not one 2->1")
    lost += _kit.unreadable({s: f for s, f in saved.items() if s in _kit.kept(saved, 3)})
    if code == 0 and final.get("checkpoint"):
        lost += _kit.unreadable({steps: Path(final["checkpoint"])})
    rolled = resets[0].get("steps_rolled_back", 0) if resets else 0
    recover_s = resets[0]["time"] - at if resets else 0.0
    return Outcome(recovered=code == 0 and not lost, steps_lost=int(rolled), recover_s=round(recover_s, 1),
                   lost=lost, exit_code=code, expected_exit=0,
                   detail=f"rank 1 stopped at step {stopped_step}; {len(resets)} reset(s)")


KINDS = [SigStop()]
