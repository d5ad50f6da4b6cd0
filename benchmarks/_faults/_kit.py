"""What the data, SIGSTOP and D4PG kinds share: launching a run, reading what it left, and the checks of
"nothing lost" (docs/reliability.md): checkpoints readable, the same weights as an uninterrupted run, no
metrics line gone, no process or shared memory left behind.

Every launch carries ``HVREP_FAULT_TAG=<a fresh id>`` in its environment (inherited by every rank and every
D4PG actor), so a process left behind is found by its tag, whatever its parent became.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil

from tests.multirank import harness

KINDS: list = []  # helpers only: the kinds are in data.py, sigstop.py, d4pg.py

TAG = "HVREP_FAULT_TAG"
SHM = Path("/dev/shm")


def new_tag() -> str:
    return uuid.uuid4().hex


def env(tag: str, **extra: str) -> dict[str, str]:
    return {**harness.clean_env(), TAG: tag, **extra}


# Launcher names: benchmarks/faults.py's ("none" for a kind without ranks, "mpirun", "gloo") and this folder's
# _try.py's ("local", "mpirun", "horovodrun").
ONE_PROCESS = ("none", "local")


def one_process(launcher: str) -> bool:
    return launcher in ONE_PROCESS


def horovodrun(launcher: str) -> bool:
    """``horovodrun --gloo``, which exits 1 whenever a rank fails (docs/troubleshooting.md, "Exit codes")."""
    return launcher in ("gloo", "horovodrun")


def python_argv(launcher: str, args: list[str]) -> list[str]:
    """``python args``: one process, or 2 ranks under mpirun or horovodrun --gloo."""
    if one_process(launcher):
        return [sys.executable, *args]
    return harness.two_ranks("horovodrun" if horovodrun(launcher) else "mpirun", args)


def train_argv(launcher: str, args: list[str]) -> list[str]:
    """``hvrep train args`` (:func:`python_argv`)."""
    return python_argv(launcher, ["-m", "hvrep.cli", "train", *args])


@contextlib.contextmanager
def launched(cmd: list[str], log: Path, tag: str, **extra: str) -> Iterator[subprocess.Popen]:
    """``cmd`` in a process group of its own (continued and killed on the way out), tagged ``tag``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with harness.launched(cmd, log, env(tag, **extra)) as proc:
        yield proc


def run(cmd: list[str], log: Path, tag: str, timeout: float = 300, **extra: str) -> int | None:
    """Runs ``cmd`` to its end; its exit code, or None when it ran past ``timeout`` (then killed)."""
    with launched(cmd, log, tag, **extra) as proc:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def lines(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def events(out: Path) -> list[dict]:
    """The JSON events of ``out/metrics.jsonl`` (a torn or foreign line skipped)."""
    found = []
    for line in lines(out):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "event" in record:
                found.append(record)
    return found


def wait_for(what, timeout: float, proc: subprocess.Popen | None = None, every: float = 0.2) -> bool:
    """Polls ``what()`` until true (True), ``timeout`` passes or ``proc`` ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(what())
        time.sleep(every)
    return False


def train_steps(out: Path) -> int:
    steps = [e["step"] for e in events(out) if e["event"] == "train"]
    return max(steps, default=0)


def checkpoints(out: Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints in ``out/checkpoints`` (those with a checkpoint.json)."""
    folder = out / "checkpoints"
    found = {}
    for f in sorted(folder.glob("ckpt-*")) if folder.is_dir() else []:
        if (f / "checkpoint.json").is_file():
            found[int(f.name.split("-")[1])] = f
    return found


def unreadable(folders: dict[int, Path]) -> list[str]:
    """One line per checkpoint of ``folders`` that is gone or cannot be read back whole."""
    from hvrep.train.checkpoint import damage

    lost = []
    for step, folder in sorted(folders.items()):
        if not folder.is_dir():
            lost.append(f"checkpoint of step {step} ({folder}) is gone")
        elif (why := damage(folder)) is not None:
            lost.append(f"checkpoint of step {step} ({folder}) is damaged: {why}")
    return lost


def not_rotated(saved: dict[int, Path], now: dict[int, Path], keep: int) -> dict[int, Path]:
    """Those of ``saved`` that checkpoint.keep = ``keep`` must still hold: the newest ``keep`` of every checkpoint
    complete before or after (``now``). A save in progress when a fault struck may complete afterwards and rightly
    delete the oldest; a checkpoint gone with fewer than ``keep`` newer ones is lost."""
    newest = sorted({*saved, *now})[-keep:]
    return {s: f for s, f in saved.items() if s in newest}


def kept(folders: dict[int, Path], keep: int) -> dict[int, Path]:
    """The newest ``keep`` of ``folders``: those a later save may not delete (checkpoint.keep)."""
    return dict(sorted(folders.items())[-keep:])


def weights(folder: Path) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(folder / "ckpt"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith("_CHECKPOINTABLE") and "save_counter" not in name}


def weight_diff(a: Path, b: Path, atol: float = 0.0) -> list[str]:
    """The values of checkpoint ``a`` that differ from ``b``'s (bit for bit where ``atol`` is 0)."""
    wa, wb = weights(a), weights(b)
    diff = sorted(set(wa) ^ set(wb))
    for name in sorted(set(wa) & set(wb)):
        x, y = wa[name], wb[name]
        if x.shape != y.shape:
            diff.append(name)
        elif atol == 0.0:
            if x.tobytes() != y.tobytes():
                diff.append(name)
        elif not np.allclose(x.astype(np.float64), y.astype(np.float64), rtol=0.0, atol=atol):
            diff.append(name)
    return diff


def differs_from_uninterrupted(final: Path, ref: Path) -> list[str]:
    """What a resumed run's final checkpoint ``final`` lost against the uninterrupted run's ``ref``: any value
    not equal bit for bit, and ``trained_samples``; empty when nothing."""
    lost = []
    diff = weight_diff(final, ref)
    if diff:
        lost.append(f"{len(diff)} value(s) differ from the uninterrupted run's, e.g. {diff[:3]}")
    got = json.loads((final / "checkpoint.json").read_text()).get("trained_samples")
    want = json.loads((ref / "checkpoint.json").read_text()).get("trained_samples")
    if got != want:
        lost.append(f"trained_samples {got} != the uninterrupted run's {want}")
    return lost

def outlived(victim: psutil.Process) -> bool:
    """Whether a process the fault stopped is still there (a zombie, or gone, is not)."""
    try:
        return victim.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

def lines_gone(before: list[str], after: list[str]) -> list[str]:
    """The complete lines of ``before`` that ``after`` no longer has (``after`` must start with them)."""
    whole = [line for line in before if line.endswith("}")]
    return [line[:120] for line, then in zip(whole, after + [""] * len(whole), strict=False) if line != then]


def leftovers(tag: str) -> list[str]:
    """Processes still alive with ``tag`` in their environment (each then continued and killed)."""
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "name"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(TAG) != tag or p.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(f"pid {p.pid} ({' '.join(p.cmdline())[:100]}, {p.status()})")
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.Error:
            continue
    return found


def gone_within(tag: str, timeout: float) -> list[str]:
    """``leftovers(tag)`` once the tagged processes had ``timeout`` seconds to end by themselves."""
    def alive() -> bool:
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(TAG) == tag and p.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False

    wait_for(lambda: not alive(), timeout)
    return leftovers(tag)


def shm_now() -> set[str]:
    return {p.name for p in SHM.glob("hvrep-d4pg-*")} if SHM.is_dir() else set()


def demo_data(workdir: Path) -> Path:
    """A private copy of the demo data set (folder and TFRecord formats), to damage: ``workdir/data``."""
    from hvrep import _env
    from hvrep.data import write_demo

    cache = _env.cache_dir() / "demo-data"
    write_demo(cache)  # once per machine; a no-op afterwards
    dst = workdir / "data"
    if not dst.is_dir():
        shutil.copytree(cache / "folder", dst / "folder")
        shutil.copytree(cache / "tfrecord", dst / "tfrecord")
    return dst


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""
