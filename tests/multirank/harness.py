"""Launches runner.py under a real launcher and collects every rank's results."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = Path(sys.executable).parent
NP = 2
LAUNCHERS = ("mpirun", "horovodrun")
# mpirun's options for the tests' 2-rank launches on this machine. `python -m mpi4py` starts MPI before hvrep can
# export its default `mpi_yield_when_idle` (CommConfig), so Open MPI would busy-poll in a waiting rank, as it does
# not under a user's `mpirun python train.py`; ask for what hvrep sets. (The 2-rank demo under `python -m mpi4py`
# beside two busy processes: 545-657 images/s with it, 381-648 without, 3 rounds alternating.)
MPIRUN_FLAGS = ("--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1")


# The case files of the communication schemes and apps, launched apart from the rest (test_multirank_apps.py): one
# launch of every case file ran past its time limit, and two files run on two of make test's workers at once.
APP_CASES = ("cases_d4pg.py", "cases_localsgd.py", "cases_powersgd.py", "cases_sngan.py")


# The support table's combination test (issue 46): a launch of its own, on another of make test's workers.
COMBINATION_CASES = ("cases_combinations.py",)


def case_modules(group: str | None = None) -> list[Path]:
    """The case files every launcher runs: tests/multirank/cases_*.py; ``group`` "apps" (``APP_CASES``),
    "combinations" (``COMBINATION_CASES``), "core" (the rest) or None (all)."""
    paths = sorted(HERE.glob("cases_*.py"))
    if group is None:
        return paths
    groups = {"apps": APP_CASES, "combinations": COMBINATION_CASES}
    if group in groups:
        return [p for p in paths if p.name in groups[group]]
    return [p for p in paths if not any(p.name in names for names in groups.values())]


def case_names(path: Path) -> list[str]:
    """The ``case_*`` functions of a case file, in order, without importing it."""
    tree = ast.parse(path.read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("case_")]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Two ranks on a 2-core machine: keep TensorFlow from oversubscribing it.
    env.setdefault("TF_NUM_INTEROP_THREADS", "1")
    env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    # Open MPI refuses root unless told; CI runs as root.
    if os.geteuid() == 0:
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def clean_env() -> dict[str, str]:
    """``_env()`` less a parent launcher's (or the user's) Open MPI, PMI, Slurm and Horovod variables, for a
    launch of its own: each launcher then sets what its ranks read."""
    env = {k: v for k, v in _env().items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int | None:
    """Runs ``cmd`` (in ``env``, default ``clean_env()``, from the checkout) in a process group of its own, its
    output to ``log``; returns its exit code, or None if it ran past ``timeout``. Everything it started is killed
    either way (:func:`launched`), so no rank outlives the test."""
    with launched(cmd, log, env) as proc:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def command(launcher: str, out: Path, modules: list[Path], np: int = NP, only: str = "") -> list[str]:
    runner = [str(HERE / "runner.py"), "--out", str(out), *(["--only", only] if only else []),
              *map(str, modules)]
    if launcher == "mpirun":
        # `python -m mpi4py` turns an uncaught exception on one rank into an
        # MPI_Abort of the whole job instead of leaving the others hanging.
        return [str(BIN / "mpirun"), "-np", str(np), *MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", *runner]
    if launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
                sys.executable, *runner]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


@dataclass
class LaunchResult:
    launcher: str
    returncode: int | None  # None: timed out
    output: str
    # (module, case) -> {rank: record}
    cases: dict[tuple[str, str], dict[int, dict]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    started: dict[int, int] = field(default_factory=dict)  # rank -> size it saw

    def explain(self, module: str, case: str, np: int = NP) -> str | None:
        """None if the case passed on every rank, else why not."""
        recs = self.cases.get((module, case), {})
        problems = []
        for rank in range(np):
            rec = recs.get(rank)
            if rec is None:
                problems.append(f"rank {rank}: no result")
            elif rec.get("event") == "begin":
                problems.append(f"rank {rank}: started and never finished (hung or crashed)")
            elif rec["status"] != "ok":
                problems.append(f"rank {rank} failed:\n{rec['error']}")
        if not problems:
            return None
        status = "timed out" if self.returncode is None else f"exit code {self.returncode}"
        tail = "\n".join(self.output.splitlines()[-40:])
        return f"{self.launcher} ({status}) {module}::{case}\n" + "\n".join(problems) + f"\n--- output tail ---\n{tail}"


def two_ranks(launcher: str, python_args: list[str]) -> list[str]:
    """``python python_args`` on 2 ranks of this machine under ``launcher`` ("mpirun" or "horovodrun").

    mpirun runs it under ``python -m mpi4py`` (one rank raising aborts all) without binding, so a test's
    ranks and its SIGSTOPs do not depend on which cores Open MPI picked.
    """
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "-np", "2", *MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", *python_args]
    return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, *python_args]


def train_command(launcher: str, args: list[str]) -> list[str]:
    """``hvrep train args`` on 2 ranks of this machine under ``launcher`` (:func:`two_ranks`)."""
    return two_ranks(launcher, ["-m", "hvrep.cli", "train", *args])


@contextlib.contextmanager
def launched(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """``cmd`` in ``env`` (default ``clean_env()``) in a process group of its own, its output in ``log``; on the
    way out every process it started is continued (a test may have stopped one) and killed."""
    import psutil

    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=clean_env() if env is None else env,
                                cwd=ROOT, start_new_session=True)
        try:
            yield proc
        finally:
            family = []
            with contextlib.suppress(psutil.Error):
                family = psutil.Process(proc.pid).children(recursive=True)
            for p in family:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for p in family:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            proc.wait(timeout=30)


def launch(launcher: str, out: Path, modules: list[Path], np: int = NP, timeout: float = 540,
           only: str = "") -> LaunchResult:
    """Runs the case modules under ``launcher`` with ``np`` ranks, once."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(command(launcher, out, modules, np, only), cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=timeout)
        rc: int | None = proc.returncode
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    result = LaunchResult(launcher, rc, output)
    for path in sorted(out.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rank = rec["rank"]
            if rec["event"] in ("begin", "end"):
                result.cases.setdefault((rec["module"], rec["case"]), {})[rank] = rec
            elif rec["event"] == "done":
                result.done.add(rank)
            elif rec["event"] == "start":
                result.started[rank] = rec["size"]
    return result


def side_by_side(jobs: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """Runs each job at the same time (a thread each: most of a launch is waiting on its processes); {name: its
    result}, or {name: {"error": the traceback}} for a job that raised, for the test reading it to report."""
    import threading
    import traceback

    results: dict[str, dict] = {}

    def run(name: str, job: Callable[[], dict]) -> None:
        try:
            results[name] = job()
        except Exception:
            results[name] = {"error": traceback.format_exc()}

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def side_by_side_runs(cmd: list[str], variants: dict[str, dict[str, str]], logs: Path, tag: str,
                      timeout: float = 180) -> dict[str, list[dict]]:
    """Runs ``cmd`` once per variant (extra environment variables) at the same time, so that every variant sees
    the same load; {variant: the JSON objects of its output lines that start with ``tag``, every rank's}."""
    import json

    with contextlib.ExitStack() as stack:
        procs = {name: stack.enter_context(launched(cmd, logs / f"{name}.log", {**clean_env(), **extra}))
                 for name, extra in variants.items()}
        for proc in procs.values():
            proc.wait(timeout=timeout)
    found: dict[str, list[dict]] = {}
    for name, proc in procs.items():
        text = (logs / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{text[-4000:]}"
        found[name] = [json.loads(line.split(f"{tag} ", 1)[1]) for line in text.splitlines() if f"{tag} " in line]
    return found
