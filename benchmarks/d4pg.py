"""D4PG with asynchronous actors (examples/d4pg): return against wall time and learner steps, 1 and 2 learner ranks
with the same total actors; learner steps/s scaling; and ``--stall``: one rank's actors stopped for 10 s.

    python benchmarks/d4pg.py --ranks 1 2 --actors 2 --steps 6000 --out results/d4pg.jsonl --plot docs/img/d4pg.png
    python benchmarks/d4pg.py --stall --out results/d4pg.jsonl          # 2 ranks; SIGSTOP rank 0's actors 10 s
    python benchmarks/d4pg.py --learner-only --rounds 3 --out results/d4pg.jsonl   # learners alone, 1 vs 2 ranks
    python benchmarks/d4pg.py --learner-only --env HOROVOD_CYCLE_TIME=0.1        # the same, Horovod's cycle 0.1 ms
    python benchmarks/d4pg.py --learner-only --interleave 1 --cycles 20          # the same, contenders 1 s in turn

Each run is ``examples.d4pg.train`` (1 rank: one process; 2: ``horovodrun --gloo``) in a fresh folder, one run at a
time. JSON lines: ``curve`` (one per evaluation: ranks, learner step, seconds since the run's start, the mean
return of 10 fixed-seed episodes), ``run`` (learner steps/s, median and spread over its ``train`` lines after the
first; actor environment steps/s; the first evaluation >= -200 and when), ``scaling`` (2 ranks' steps/s and
transitions/s over 1 rank's), ``stall`` (rank 0's learner steps/s and sample age in the 10 s before and during the
stop, their ratio). A shared machine's load moves every figure: the ``load`` field is the 1-minute load average
at the start and end of each run.

``--learner-only``: the learner alone, each rank on a core of its own (it pins itself to its local rank's core
before TensorFlow starts): a replay filled once with random transitions of the environment's shape (the learner's
cost does not depend on their values), no actors; ``--learner-steps`` timed steps after 20 untimed ones. Contenders,
one launch each per round, in turn: 1 rank (one process), 2 ranks under ``mpirun``, 2 ranks under
``horovodrun --gloo``, and ``2 x 1 rank apart``: two 1-rank learners at once, each on a core of its own, timed from
a common start, with no communication at all — the machine's own ceiling for 2 ranks (shared caches and memory,
the host's scheduling of both cores), which a 2-rank learner can at best reach. ``learner`` lines (steps/s and
transitions/s of the slowest rank; per learner step, the most CPU time and voluntary context switches of a rank:
on a loaded machine, the work a step does and how often it waits, which the load moves less than the rates; for
the 2-rank learners, from hvrep's shared-memory all-reduce's counters (``hvrep.replica.shm.stats``), the step's
all-reduce in ms per step on the rank that waited longest in it: ``allreduce_ms_per_step`` from submission to
end, of which ``allreduce_wait_ms_per_step`` waiting for the other rank and ``allreduce_work_ms_per_step`` the
rest, the copies, the sum and the hand-over to the transport's thread; ``allreduce_wait_ms_per_step_least``, the
other rank's wait; ``rank0_thread_cpu_ms_per_step``: rank 0's CPU ms per step by thread, from /proc: "main" (Python
and the ops TensorFlow runs on the caller's thread), "tf_Compute" (its pool), "hvrep-shm" (the all-reduce's
thread), "python" (the rest: Horovod's and Gloo's threads)) and
``learner_scaling`` lines (2 ranks' transitions/s over the same round's 1 rank; for the 2-rank launchers also
``of_ceiling``, over the same round's ``2 x 1 rank apart``). ``--env KEY=VALUE`` sets a variable in every launch
(e.g. ``HOROVOD_CYCLE_TIME=0.1``; the launcher's own variables are otherwise dropped).

``--learner-only --interleave SECONDS``: the same four contenders, each launched once and kept warm, run in turn
SECONDS at a time (``--cycles`` cycles, the order rotating) while the others' processes are stopped (SIGSTOP): all
four are measured within seconds of each other, many times over, where whole launches in ``--rounds`` are minutes
apart on a machine whose speed moves by 10-25% over that time. ``learner_interleaved`` lines (per contender: steps/s
and transitions/s over all its windows, the slower process's for two; the per-window 10th-90th percentiles; the
typical step's time and its slow tail; ``steps_while_stopped``, which is 0 when the stops held) and
``learner_interleaved_scaling`` lines (2 processes over 1 rank, and over ``2 x 1 rank apart``: the whole run's ratio
and the median and 10th-90th percentiles of each cycle's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SOLVED = -200.0  # Pendulum-v1: the bar for the mean of 10 fixed-seed episodes


def _command(ranks: int, overrides: list[str]) -> list[str]:
    app = [sys.executable, "-m", "examples.d4pg.train", *overrides]
    if ranks == 1:
        return app
    return [str(BIN / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", *app]


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="2")
    return {k: v for k, v in env.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}


def _learner_env(extra_env: dict[str, str] | None) -> dict[str, str]:
    """The learner-only launches' environment: one TensorFlow thread per pool (a rank has one core), Open MPI
    allowed to run as root, then ``extra_env``."""
    return {**_env(), "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(extra_env or {})}


def _within(ends, lo: float, hi: float):
    """The step-end times in ``ends`` (a numpy array) that fall in the window (lo, hi]."""
    return ends[(ends > lo) & (ends <= hi)]


def one_run(ranks: int, actors: int, steps: int, extra: list[str], timeout: float, keep: Path | None,
            stall: bool = False) -> dict[str, Any]:
    """One training run: its metrics lines, exit code, load; with ``stall``, rank 0's actors stopped 10 s."""
    tmp = tempfile.mkdtemp(prefix="d4pg-bench-")
    out = (keep or Path(tmp)) / f"ranks{ranks}"
    overrides = [f"output_dir={out}", f"steps={steps}", f"actors_per_rank={max(1, actors // ranks)}", *extra]
    load0 = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(_command(ranks, overrides), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    stall_times: tuple[float, float] | None = None
    if stall:
        stall_times = _stall(out, proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    lines = _lines(out / "metrics.jsonl")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"ranks": ranks, "actors_per_rank": max(1, actors // ranks), "steps": steps, "rc": proc.returncode,
            "start": t0, "lines": lines, "stall": stall_times, "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "tail": output[-2000:] if proc.returncode else ""}


def _stall(out: Path, proc: subprocess.Popen) -> tuple[float, float] | None:
    """After 20 s of training, SIGSTOPs rank 0's actors for 10 s; returns (stop time, continue time)."""
    pids_file = out / "actors" / "rank0.pids"
    first = None
    while proc.poll() is None:
        trains = [d for d in _lines(out / "metrics.jsonl") if d["event"] == "train"]
        if trains and first is None:
            first = time.time()
        if first is not None and time.time() - first >= 20:
            pids = json.loads(pids_file.read_text())
            t_stop = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(10)
            t_cont = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            return t_stop, t_cont
        time.sleep(0.1)
    return None


def _rate(trains: list[dict[str, Any]], lo: float, hi: float) -> tuple[float, float] | None:
    """(learner steps/s, mean of rank 0's sample age) over the train lines that ended in [lo, hi]."""
    inside = [d for d in trains if lo <= d["time"] <= hi]
    if len(inside) < 2:
        return None
    rate = (inside[-1]["step"] - inside[0]["step"]) / (inside[-1]["time"] - inside[0]["time"])
    return rate, statistics.mean(d["sample_age_by_rank"][0] for d in inside[1:])


def summarize(run: dict[str, Any]) -> list[dict[str, Any]]:
    lines, t0 = run["lines"], run["start"]
    trains = [d for d in lines if d["event"] == "train"]
    evals = [d for d in lines if d["event"] == "eval"]
    base = {"ranks": run["ranks"], "actors_per_rank": run["actors_per_rank"], "load": run["load"]}
    if run["stall"]:  # a stall run's one-episode evaluations are no curve
        evals = []
    out = [{"kind": "curve", **base, "step": e["step"], "wall_sec": round(e["time"] - t0, 1),
            "return": round(e["return"], 1)} for e in evals]
    rates = [d["steps_per_sec"] for d in trains[1:]]
    solved = next((e for e in evals if e["return"] >= SOLVED), None)
    record = {"kind": "run", **base, "rc": run["rc"], "steps": trains[-1]["step"] if trains else 0,
              "wall_sec": round((lines[-1]["time"] - t0) if lines else 0.0, 1),
              "learner_steps_per_sec": round(statistics.median(rates), 2) if rates else None,
              "learner_steps_per_sec_p10_p90": [round(float(x), 2) for x in _p10_p90(rates)] if rates else None,
              "actor_env_steps_per_sec": round(statistics.median(d["actor_env_steps_per_sec"] for d in trains[1:]), 1)
              if len(trains) > 1 else None,
              "final_return": round(evals[-1]["return"], 1) if evals else None,
              "solved_at": {"step": solved["step"], "wall_sec": round(solved["time"] - t0, 1)} if solved else None}
    if run["tail"]:
        record["tail"] = run["tail"]
    out.append(record)
    if run["stall"]:
        t_stop, t_cont = run["stall"]
        before, during = _rate(trains, t_stop - 10, t_stop), _rate(trains, t_stop, t_cont)
        out.append({"kind": "stall", **base, "stopped_sec": round(t_cont - t_stop, 1),
                    "steps_per_sec_before": before and round(before[0], 2),
                    "steps_per_sec_during": during and round(during[0], 2),
                    "ratio": round(during[0] / before[0], 3) if before and during else None,
                    "rank0_sample_age_before": before and round(before[1], 1),
                    "rank0_sample_age_during": during and round(during[1], 1)})
    return out


def _p10_p90(values: list[float]) -> tuple[float, float]:
    import numpy as np

    return float(np.percentile(values, 10)), float(np.percentile(values, 90))


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ranks in sorted({r["ranks"] for r in records if r["kind"] == "curve"}):
        pts = [r for r in records if r["kind"] == "curve" and r["ranks"] == ranks]
        label = f"{ranks} learner rank(s), {pts[0]['actors_per_rank']} actor(s) each"
        axes[0].plot([p["wall_sec"] / 60 for p in pts], [p["return"] for p in pts], "o-", label=label)
        axes[1].plot([p["step"] for p in pts], [p["return"] for p in pts], "o-", label=label)
    for ax, xlabel in zip(axes, ("wall time (min)", "learner steps"), strict=True):
        ax.axhline(SOLVED, color="gray", ls="--", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("Pendulum-v1 return (10 fixed-seed episodes)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


LEARNER_PREFIX = "D4PG_LEARNER "
APART = "2 x 1 rank apart"
LEARNER_CONTENDERS = ("1 rank", "2 ranks mpirun", "2 ranks horovodrun", APART)
# For APART's two processes: the core each takes, and a folder where each marks its start (a file barrier).
CORE_VAR, BARRIER_VAR = "D4PG_LEARNER_CORE", "D4PG_LEARNER_BARRIER"
# --interleave: the folder where a worker marks itself ready and leaves its steps' end times, and its contender's tag.
STAMPS_VAR, TAG_VAR = "D4PG_LEARNER_STAMPS", "D4PG_LEARNER_TAG"
TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of a thread's CPU time


def _learner_worker(steps: int, settings: list[str]) -> int:
    """One learner rank: a replay filled once, no actors; prints steps/s of ``steps`` learner steps (rank 0), and
    the core rank 0 ran on."""
    local = int(os.environ.get(CORE_VAR) or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
                or os.environ.get("HOROVOD_LOCAL_RANK") or 0)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local % len(cores)]
    os.sched_setaffinity(0, {core})
    import numpy as np

    import hvrep
    from examples.d4pg.agent import D4PG
    from examples.d4pg.replay import row_width
    from examples.d4pg.train import config, env_spec
    from hvrep.replica import shm

    cfg = config(settings)
    obs_dim, act_dim, low, high = env_spec(cfg.env)
    repl = hvrep.Replicator("auto")
    agent = D4PG(repl, cfg.agent, obs_dim, act_dim, low, high)
    rng = np.random.default_rng(cfg.seed + 7919 * repl.rank)
    rows = rng.standard_normal((cfg.min_replay * 10, row_width(obs_dim, act_dim) - 1)).astype(np.float32)
    rows[:, obs_dim + act_dim + 1] = cfg.agent.gamma ** cfg.n_step  # the discount column
    per_step = cfg.per_replica_batch * agent.local_replicas

    def run(n: int, first: int) -> tuple[np.ndarray, dict[str, float]]:
        """(steps/s, CPU ms per step, voluntary context switches per step) of this process, and its CPU ms per step
        by thread."""
        repl.reduce(np.zeros(()), "sum")  # a barrier
        t0, r0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
        outs = [agent.train_step(rows[rng.integers(0, len(rows), per_step)], first + i) for i in range(n)]
        repl.reduce(outs[-1], "mean")  # waits for the last step
        seconds, r1, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
        threads: dict[str, float] = {}
        for tid, (name, ticks) in c1.items():
            threads[name] = threads.get(name, 0.0) + (ticks - c0.get(tid, (name, 0))[1]) * 1e3 / TICKS / n
        cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        return np.asarray([n / seconds, 1e3 * cpu / n, (r1.ru_nvcsw - r0.ru_nvcsw) / n]), threads

    run(20, 1)
    if os.environ.get(STAMPS_VAR):  # --interleave: steps until told to stop, each one's end time kept
        return _stamped_steps(Path(os.environ[STAMPS_VAR]), f"{os.environ[TAG_VAR]}.{local}", cfg.per_replica_batch,
                              lambda i: agent.train_step(rows[rng.integers(0, len(rows), per_step)], 21 + i))
    if os.environ.get(BARRIER_VAR):  # APART: both processes start timing together
        _file_barrier(Path(os.environ[BARRIER_VAR]), local, 2)
    before = shm.stats()
    mine, threads = run(steps, 21)
    parts = _allreduce_parts(before, shm.stats(), steps)
    # The slowest rank's steps/s; the most CPU and context switches per step of a rank; the step's all-reduce
    # on the rank that waited longest in it.
    worst = np.asarray(repl.reduce(np.concatenate([mine * np.asarray([-1.0, 1.0, 1.0]), [parts[1], -parts[1]]]),
                                   "max"), np.float64)
    waited_most = np.asarray(repl.reduce(parts * float(parts[1] == worst[3]), "max"), np.float64)
    slowest = -float(worst[0])
    if repl.rank == 0:
        print(LEARNER_PREFIX + json.dumps({"ranks": repl.num_processes, "backend": repl.backend,
                                           "steps_per_sec": round(slowest, 2), "per_replica_batch":
                                           cfg.per_replica_batch,
                                           "transitions_per_sec": round(slowest * cfg.per_replica_batch
                                                                        * repl.num_replicas, 1),
                                           "core": core,
                                           "cpu_ms_per_step": round(float(worst[1]), 3),
                                           "voluntary_switches_per_step": round(float(worst[2]), 2),
                                           "rank0_thread_cpu_ms_per_step": {k: round(v, 3) for k, v in sorted(
                                               threads.items(), key=lambda kv: -kv[1]) if v >= 0.0005},
                                           **({} if before is None else {
                                               "allreduce_ms_per_step": round(float(waited_most[0]), 3),
                                               "allreduce_wait_ms_per_step": round(float(waited_most[1]), 3),
                                               "allreduce_wait_ms_per_step_least": round(-float(worst[4]), 3),
                                               "allreduce_work_ms_per_step": round(float(waited_most[2]), 3)})}),
              flush=True)
    repl.close()
    return 0


def _stamped_steps(folder: Path, tag: str, batch: int, step: Any) -> int:
    """``--interleave``'s worker after its warm-up: marks itself ready (``folder/ready.<tag>``: its pid, for the
    controller's SIGSTOP and SIGCONT, and its per-replica batch), then runs ``step(i)`` for i = 0, 1, ... and keeps
    each step's end (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of the host). A thread
    waits for ``folder/stop``, writes the times to ``folder/<tag>.npy`` and ends the process without finishing the
    step it is in (a rank may be stopped inside its collective's wait); it waits half a second first, so that a
    launcher that ends the other ranks once one has gone does not end one before it has written its times."""
    import threading

    import numpy as np

    ends = np.zeros(4_000_000)
    done = [0]

    def watch() -> None:
        while not (folder / "stop").exists():
            time.sleep(0.02)
        tmp = folder / f"{tag}.tmp.npy"
        np.save(tmp, ends[:done[0]])
        tmp.rename(folder / f"{tag}.npy")
        time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="stamps").start()
    (folder / f"ready.{tag}.tmp").write_text(json.dumps({"pid": os.getpid(), "per_replica_batch": batch}))
    (folder / f"ready.{tag}.tmp").rename(folder / f"ready.{tag}")
    for i in range(len(ends)):
        step(i)
        ends[i] = time.perf_counter()
        done[0] = i + 1
    raise SystemExit(f"d4pg learner {tag}: {len(ends)} steps and no stop from the controller")


def _thread_cpu() -> dict[str, tuple[str, int]]:
    """This process's threads: tid -> (what it is, CPU ticks so far). The main thread is "main"; TensorFlow's pool
    threads, hvrep's all-reduce thread ("hvrep-shm") and the rest by their names (Horovod's, Gloo's and other
    unnamed threads show as "python")."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "main" if int(tid) == os.getpid() else f.read().strip()
        except OSError:  # the thread ended
            continue
        out[tid] = (name, int(fields[11]) + int(fields[12]))  # utime + stime
    return out


def _allreduce_parts(before: dict[str, int] | None, after: dict[str, int] | None, steps: int) -> Any:
    """Per learner step, in ms, from hvrep's shared-memory all-reduce counters (hvrep.replica.shm.stats) over the
    timed steps: the all-reduce as the step waits for it (submission to end), the part of it spent waiting for
    the other rank, and the rest (the copies and the sum, handing the op over). Zeros where it is not open."""
    import numpy as np

    if before is None or after is None:
        return np.zeros(3)
    d = {k: after[k] - before[k] for k in after}
    latency, wait = d["latency_ns"] / 1e6 / steps, d["wait_ns"] / 1e6 / steps
    return np.asarray([latency, wait, latency - wait])


def _learner_lines(output: str) -> list[dict[str, Any]]:
    """The ``LEARNER_PREFIX`` records a learner launch printed."""
    return [json.loads(x.split(LEARNER_PREFIX, 1)[1]) for x in output.splitlines() if LEARNER_PREFIX in x]


def _file_barrier(folder: Path, me: int, count: int, timeout: float = 300.0) -> None:
    """Marks ``me`` arrived in ``folder`` and waits until ``count`` processes have."""
    (folder / f"arrived.{me}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("arrived.*"))) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"d4pg learner {me}: the other process of {APART!r} did not start within {timeout:g} s")
        time.sleep(0.001)


def _learner_apart(steps: int, settings: list[str], env: dict[str, str], timeout: float) -> tuple[int, dict, str]:
    """Two 1-rank learners at once, one per core, timed from a common start: (rc, the pair's record, output)."""
    with tempfile.TemporaryDirectory() as barrier:
        procs = [subprocess.Popen(_learner_command("1 rank", steps, settings), cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env={**env, CORE_VAR: str(i), BARRIER_VAR: barrier}) for i in range(2)]
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    rc = max(p.returncode for p in procs)
    found = [rec for o in outs for rec in _learner_lines(o)]
    if rc != 0 or len(found) != 2:
        return rc or 1, {}, "".join(outs)
    slowest = min(f["steps_per_sec"] for f in found)
    batch = found[0]["per_replica_batch"]
    return 0, {"ranks": 2, "backend": "local (2 processes, no communication)", "steps_per_sec": slowest,
               "per_replica_batch": batch, "transitions_per_sec": round(slowest * batch * 2, 1),
               "cores": sorted(f["core"] for f in found),
               "cpu_ms_per_step": max(f["cpu_ms_per_step"] for f in found),
               "voluntary_switches_per_step": max(f["voluntary_switches_per_step"] for f in found)}, ""


def _learner_command(contender: str, steps: int, settings: list[str]) -> list[str]:
    me = [sys.executable, __file__, "--learner-worker", "--learner-steps", str(steps), *settings]
    if contender == "1 rank":
        return me
    if contender == "2 ranks mpirun":
        return [str(BIN / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca",
                "mpi_yield_when_idle", "1", me[0], "-m", "mpi4py", *me[1:]]
    return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *me]


def learner_only(rounds: int, steps: int, settings: list[str], timeout: float,
                 extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``rounds`` rounds of the three contenders in turn; a ``learner`` line per launch, ``learner_scaling``
    per round and 2-rank launcher. ``extra_env``: variables set in every launch."""
    env = _learner_env(extra_env)
    records: list[dict[str, Any]] = []
    for r in range(rounds):
        got: dict[str, dict[str, Any]] = {}
        for contender in LEARNER_CONTENDERS:
            load0 = os.getloadavg()[0]
            if contender == APART:
                rc, result, output = _learner_apart(steps, settings, env, timeout)
            else:
                proc = subprocess.run(_learner_command(contender, steps, settings), cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=timeout)
                found = _learner_lines(proc.stdout)
                rc, result, output = proc.returncode, (found[0] if found else {}), proc.stdout + proc.stderr
            rec = {"kind": "learner", "round": r, "contender": contender, "rc": rc,
                   "learner_steps": steps, "env": extra_env or {},
                   "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
                   **(result or {"tail": output[-2000:]})}
            records.append(rec)
            got[contender] = rec
        one = got["1 rank"].get("transitions_per_sec")
        ceiling = got[APART].get("transitions_per_sec")
        for contender in LEARNER_CONTENDERS[1:]:
            two = got[contender].get("transitions_per_sec")
            line = {"kind": "learner_scaling", "round": r, "contender": contender, "env": extra_env or {},
                    "transitions_per_sec_2_over_1": round(two / one, 3) if one and two else None}
            if contender != APART:
                line["of_ceiling"] = round(two / ceiling, 3) if ceiling and two else None
            records.append(line)
    return records


def _tag(contender: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in contender)


def learner_interleaved(window: float, cycles: int, settings: list[str], timeout: float,
                        extra_env: dict[str, str] | None = None, settle: float = 0.1) -> list[dict[str, Any]]:
    """The four contenders launched once each and kept warm, then run in turn ``window`` seconds at a time for
    ``cycles`` cycles (the order rotating by one each cycle), every other contender's processes stopped
    (SIGSTOP) meanwhile: each cycle measures all four within ``4 x window`` seconds, so a change in the shared
    machine's speed (it moves by 10-25% over seconds to minutes) reaches every contender of a cycle alike.

    A contender's steps/s in a window are the steps that ended in it after its first ``settle`` seconds, over
    that time; for two processes the slower's. ``learner_interleaved`` lines: per contender, the whole run's
    steps/s and transitions/s and the per-window spread; ``learner_interleaved_scaling``: per 2-process
    contender, the median over cycles of the cycle's ratio to 1 rank (and to ``2 x 1 rank apart``), with the
    10th-90th percentiles, and the ratio of the whole run's rates."""
    import numpy as np

    env = _learner_env(extra_env)
    with tempfile.TemporaryDirectory(prefix="d4pg-interleave-") as tmp:
        folder = Path(tmp)
        procs: list[subprocess.Popen] = []
        pids: dict[str, list[int]] = {}
        load0 = os.getloadavg()[0]
        try:
            for contender in LEARNER_CONTENDERS:  # launched and warmed one at a time, then stopped
                tag = _tag(contender)
                mine = {**env, STAMPS_VAR: str(folder), TAG_VAR: tag}
                count = 2 if contender != "1 rank" else 1
                logs = [folder / f"{tag}.{i}.log" for i in range(count if contender == APART else 1)]
                started = []
                for i, log in enumerate(logs):
                    with open(log, "w") as f:
                        started.append(subprocess.Popen(
                            _learner_command("1 rank" if contender == APART else contender, 0, settings), cwd=ROOT,
                            env={**mine, CORE_VAR: str(i)} if contender == APART else mine, stdout=f,
                            stderr=subprocess.STDOUT))
                procs += started
                deadline = time.monotonic() + timeout
                while len(ready := sorted(folder.glob(f"ready.{tag}.[0-9]"))) < count:
                    if any(p.poll() is not None for p in started) or time.monotonic() > deadline:
                        tails = "\n".join(log.read_text()[-2000:] for log in logs)
                        raise RuntimeError(f"d4pg --interleave: {contender!r} did not start (exit codes "
                                           f"{[p.poll() for p in started]}, {len(ready)} of {count} ready):\n{tails}")
                    time.sleep(0.05)
                marks = [json.loads(f.read_text()) for f in ready]
                pids[contender] = [m["pid"] for m in marks]
                batch = marks[0]["per_replica_batch"]
                for pid in pids[contender]:
                    os.kill(pid, signal.SIGSTOP)
            windows: dict[str, list[tuple[float, float]]] = {c: [] for c in LEARNER_CONTENDERS}  # one per cycle
            for k in range(cycles):
                for j in range(len(LEARNER_CONTENDERS)):
                    contender = LEARNER_CONTENDERS[(j + k) % len(LEARNER_CONTENDERS)]
                    for pid in pids[contender]:
                        os.kill(pid, signal.SIGCONT)
                    t0 = time.perf_counter()
                    time.sleep(window)
                    t1 = time.perf_counter()
                    for pid in pids[contender]:
                        os.kill(pid, signal.SIGSTOP)
                    windows[contender].append((t0 + settle, t1))
            load1 = os.getloadavg()[0]
        finally:
            (folder / "stop").touch()
            for pid in (pid for ps in pids.values() for pid in ps):
                os.kill(pid, signal.SIGCONT)
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        ends = {}
        for c in LEARNER_CONTENDERS:
            files = [folder / f"{_tag(c)}.{i}.npy" for i in range(2 if c != "1 rank" else 1)]
            if not all(f.exists() for f in files):
                tails = "\n".join(log.read_text()[-2000:] for log in sorted(folder.glob(f"{_tag(c)}.*.log")))
                raise RuntimeError(f"d4pg --interleave: {c!r} ended without writing its steps' times "
                                   f"({[f.name for f in files if not f.exists()]} missing):\n{tails}")
            ends[c] = [np.load(f) for f in files]
    records: list[dict[str, Any]] = []
    per_cycle: dict[str, np.ndarray] = {}
    for contender in LEARNER_CONTENDERS:
        counts = np.asarray([[len(_within(e, lo, hi)) for e in ends[contender]]
                             for lo, hi in windows[contender]], np.float64)  # windows x processes
        seconds = np.asarray([hi - lo for lo, hi in windows[contender]])
        rates = (counts / seconds[:, None]).min(axis=1)
        per_cycle[contender] = rates
        procs_n = counts.shape[1]
        # Steps that ended while another contender ran (after its window's first 20 ms): 0 if SIGSTOP held them.
        others = [(lo - settle + 0.02, hi) for c in LEARNER_CONTENDERS if c != contender for lo, hi in windows[c]]
        stray = sum(len(_within(e, lo, hi)) for e in ends[contender] for lo, hi in others)
        # Each step's time (consecutive ends inside one window), every process's pooled: the typical step, and the
        # slow tail that a rank waiting for the slower one once a step pays for, where two 1-rank learners do not.
        steps_ms = 1e3 * np.concatenate([np.diff(_within(e, lo, hi)) for e in ends[contender]
                                         for lo, hi in windows[contender]])
        whole = float((counts.sum(axis=0) / seconds.sum()).min())
        lockstep = {}
        if contender == APART:
            # The two learners' own steps, paired in order within each window, as if each waited for the other
            # once a step through an all-reduce that costs nothing: the rate a 2-rank learner would reach with
            # this machine's step-to-step variation and no communication at all.
            paired = [np.diff(_within(e, lo, hi)) for lo, hi in windows[contender] for e in ends[contender]]
            n = [min(len(a), len(b)) for a, b in zip(paired[::2], paired[1::2], strict=True)]
            waited = sum(float(np.maximum(a[:k], b[:k]).sum()) for a, b, k in zip(paired[::2], paired[1::2], n,
                                                                                  strict=True))
            lockstep = {"lockstep_steps_per_sec": round(sum(n) / waited, 2),
                        "lockstep_transitions_per_sec": round(sum(n) / waited * batch * 2, 1)}
        records.append({"kind": "learner_interleaved", "contender": contender, "window_sec": window,
                        "settle_sec": settle, "cycles": cycles, "env": extra_env or {},
                        "load": [round(load0, 2), round(load1, 2)], "per_replica_batch": batch,
                        "steps_per_sec": round(whole, 2),
                        "transitions_per_sec": round(whole * batch * procs_n, 1),
                        "steps_per_sec_p10_p90": [round(float(np.percentile(rates, q)), 2) for q in (10, 90)],
                        "steps_counted": int(counts.sum(axis=0).min()),
                        "seconds_counted": round(float(seconds.sum()), 4), "steps_while_stopped": stray,
                        "step_ms_median": round(float(np.median(steps_ms)), 3),
                        "step_ms_mean": round(float(np.mean(steps_ms)), 3),
                        "step_ms_p90_p99": [round(float(np.percentile(steps_ms, q)), 3) for q in (90, 99)],
                        **lockstep})
    whole = {r["contender"]: r["transitions_per_sec"] for r in records}
    lockstep_ceiling = records[LEARNER_CONTENDERS.index(APART)]["lockstep_transitions_per_sec"]
    for contender in LEARNER_CONTENDERS[1:]:
        ratio = 2 * per_cycle[contender] / per_cycle["1 rank"]
        line = {"kind": "learner_interleaved_scaling", "contender": contender, "env": extra_env or {},
                "transitions_per_sec_2_over_1": round(whole[contender] / whole["1 rank"], 3),
                "cycle_median_2_over_1": round(float(np.median(ratio)), 3),
                "cycle_p10_p90_2_over_1": [round(float(np.percentile(ratio, q)), 3) for q in (10, 90)]}
        if contender != APART:
            of = per_cycle[contender] / per_cycle[APART]
            line.update({"of_ceiling": round(whole[contender] / whole[APART], 3),
                         "cycle_median_of_ceiling": round(float(np.median(of)), 3),
                         "cycle_p10_p90_of_ceiling": [round(float(np.percentile(of, q)), 3) for q in (10, 90)],
                         "of_lockstep_ceiling": round(whole[contender] / lockstep_ceiling, 3)})
        else:
            line["lockstep_2_over_1"] = round(lockstep_ceiling / whole["1 rank"], 3)
        records.append(line)
    return records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="learner ranks, one run each")
    p.add_argument("--actors", type=int, default=2, help="actors in all, shared among the ranks (default 2)")
    p.add_argument("--steps", type=int, default=6000, help="learner steps per run (default 6000)")
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--stall", action="store_true", help="2 ranks; stop rank 0's actors for 10 s after 20 s")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's output folder under this one")
    p.add_argument("--out", type=Path, default=Path("results/d4pg.jsonl"))
    p.add_argument("--plot", type=Path, default=None, help="a PNG of return against wall time and learner steps")
    p.add_argument("--learner-only", action="store_true",
                   help="the learner alone (a replay filled once, no actors): 1 rank vs 2 ranks, both launchers, "
                        "and two 1-rank learners apart (the machine's ceiling)")
    p.add_argument("--rounds", type=int, default=3, help="with --learner-only: rounds of the contenders (default 3)")
    p.add_argument("--learner-steps", type=int, default=300,
                   help="with --learner-only: timed learner steps per launch (default 300)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="with --learner-only: a variable for every launch (repeatable), e.g. HOROVOD_CYCLE_TIME=0.1")
    p.add_argument("--interleave", type=float, default=None, metavar="SECONDS",
                   help="with --learner-only: launch each contender once, keep it warm, and run them in turn SECONDS "
                        "at a time (the others stopped), --cycles times, instead of --rounds of whole launches")
    p.add_argument("--cycles", type=int, default=20, help="with --interleave: cycles of the four contenders (20)")
    p.add_argument("--learner-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("settings", nargs="*", help="extra key=value settings for examples.d4pg.train")
    args = p.parse_args()
    if args.learner_worker:
        return _learner_worker(args.learner_steps, args.settings)
    records: list[dict[str, Any]] = []
    if args.learner_only:
        bad = [e for e in args.env if not e.partition("=")[0] or "=" not in e]
        if bad:
            p.error(f"--env takes KEY=VALUE, got {bad[0]!r}; e.g. --env HOROVOD_CYCLE_TIME=0.1")
        extra_env = dict(e.split("=", 1) for e in args.env)
        if args.interleave is not None:
            if not 0.2 <= args.interleave <= 10 or args.cycles < 1:
                p.error(f"--interleave takes 0.2-10 seconds and --cycles at least 1, got {args.interleave:g} and "
                        f"{args.cycles}; e.g. --interleave 1 --cycles 20")
            records += learner_interleaved(args.interleave, args.cycles, args.settings, args.timeout, extra_env)
        else:
            records += learner_only(args.rounds, args.learner_steps, args.settings, args.timeout, extra_env)
    elif args.stall:
        # A replay of 4000 rows per rank (16 s of one actor's 250 steps/s): with its actors running, its samples'
        # age stays level, so the stall's rise shows (the default 200,000 rows grow older all run long).
        extra = ["steps_per_loop=25", "eval_every=0", "eval_episodes=1", "checkpoint_every=0", "replay_size=4000",
                 *args.settings]
        records += summarize(one_run(2, args.actors, args.steps, extra, args.timeout, args.keep, stall=True))
    else:
        extra = [f"eval_every={args.eval_every}", "checkpoint_every=0", *args.settings]
        for ranks in args.ranks:
            records += summarize(one_run(ranks, args.actors, args.steps, extra, args.timeout, args.keep))
        runs = {r["ranks"]: r for r in records if r["kind"] == "run"}
        if 1 in runs and 2 in runs and runs[1]["learner_steps_per_sec"] and runs[2]["learner_steps_per_sec"]:
            s = runs[2]["learner_steps_per_sec"] / runs[1]["learner_steps_per_sec"]
            records.append({"kind": "scaling", "steps_per_sec_2_over_1": round(s, 3),
                            "transitions_per_sec_2_over_1": round(2 * s, 3)})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
            print(json.dumps(r))
    if args.plot and not args.stall:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
