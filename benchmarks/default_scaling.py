"""The 2-rank demo with default settings against 1 rank: does `hvrep train` scale without flags?

Contenders, one run each per round, in turn (round-robin, so a round's runs share the machine's load):
  1rank-default   hvrep train, 1 process, defaults (TensorFlow's pools on every core), global batch 32
  1rank-1core     the same with train.threads=1 (one thread per pool: the weak-scaling baseline the targets are
                  set against; not pinned, so its input pipeline and its epoch's end may use the other core)
  1rank-1core-pinned  1rank-1core pinned to one core (taskset): a rank that has one core and nothing else, as
                  each rank of the 2-rank runs has
  2rank-horovodrun  horovodrun -np 2 --gloo hvrep train, defaults, global batch 64 (32 per rank)
  2rank-mpirun      mpirun -np 2 hvrep train (Open MPI's own binding), defaults, global batch 64
  2rank-horovodrun-gloo  2rank-horovodrun with HVREP_LOCAL_TRANSPORT=horovod: the step's reductions through
                    Horovod's Gloo (TCP over loopback) instead of hvrep's shared-memory all-reduce
  2rank-mpirun-openmpi   2rank-mpirun likewise: through Horovod's MPI (Open MPI's shared memory)
  2x1core-apart     two 1rank-1core runs at once, each pinned to a core of its own, no communication: the
                    machine's own ceiling for 2 ranks (shared caches, memory and the host's scheduling); its
                    images/s is the two runs' sum

Each run's throughput is the median images/s of its epochs after the first (``hvrep.perf.summary``).
Weak scaling = 2-rank images/s / (2 x a 1-rank run's), per round, against each baseline; and each 2-rank run
against 2x1core-apart (the share of the machine's ceiling that communication leaves).

    python benchmarks/default_scaling.py --rounds 3 --epochs 4        # appends to benchmarks/results/...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, run_id

from hvrep.perf.summary import read_metrics, throughput

BIN = Path(sys.executable).parent
HVREP = str(BIN / "hvrep")


def _contenders() -> dict[str, tuple[list[str], list[str]]]:
    """name -> (launcher prefix, extra overrides)."""
    return {
        "1rank-default": ([HVREP, "train"], ["train.global_batch=32"]),
        "1rank-1core": ([HVREP, "train"], ["train.global_batch=32", "train.threads=1"]),
        PINNED: (["taskset", "-c", str(min(os.sched_getaffinity(0))), HVREP, "train"],
                 ["train.global_batch=32", "train.threads=1"]),
        "2rank-horovodrun": ([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", HVREP, "train"],
                             ["train.global_batch=64"]),
        "2rank-mpirun": ([str(BIN / "mpirun"), "-np", "2", HVREP, "train"], ["train.global_batch=64"]),
        # The same horovodrun run with the step's reductions through Horovod's Gloo (TCP over loopback) instead of
        # hvrep's shared-memory all-reduce: what the demo gave before it, and what a job across hosts pays.
        HOROVOD_GLOO: (["env", "HVREP_LOCAL_TRANSPORT=horovod", str(BIN / "horovodrun"), "-np", "2", "-H",
                        "localhost:2", "--gloo", HVREP, "train"], ["train.global_batch=64"]),
        # And the mpirun run through Horovod's MPI (Open MPI's own shared memory between the two ranks).
        HOROVOD_MPI: (["env", "HVREP_LOCAL_TRANSPORT=horovod", str(BIN / "mpirun"), "-np", "2", HVREP, "train"],
                      ["train.global_batch=64"]),
        APART: ([HVREP, "train"], ["train.global_batch=32", "train.threads=1"]),
    }


APART = "2x1core-apart"
PINNED = "1rank-1core-pinned"
HOROVOD_GLOO = "2rank-horovodrun-gloo"
HOROVOD_MPI = "2rank-mpirun-openmpi"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _command(prefix: list[str], overrides: list[str], out: Path, epochs: int) -> list[str]:
    return [*prefix, "--config", "demo", f"output_dir={out}", f"train.epochs={epochs}", "train.eval_every=1000",
            "optim.warmup_epochs=1", *overrides]


def _run_apart(prefix: list[str], overrides: list[str], out: Path, epochs: int) -> tuple[float, float | None]:
    """Two runs at once, each on one core of its own; the sum of their images/s."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    procs = []
    for i, core in enumerate(cores):
        cmd = ["taskset", "-c", str(core), *_command(prefix, overrides, out / str(i), epochs)]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                            env=_env())))
    for cmd, proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    runs = [read_metrics(out / str(i)) for i in range(len(cores))]
    waits = [w for w in (_input_wait(events) for events in runs) if w is not None]
    return sum(float(throughput(events)) for events in runs), (max(waits) if waits else None)


def _run(prefix: list[str], overrides: list[str], out: Path, epochs: int) -> tuple[float, float | None]:
    cmd = _command(prefix, overrides, out, epochs)
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    events = read_metrics(out)
    return float(throughput(events)), _input_wait(events)


def _input_wait(events: list[dict]) -> float | None:
    """Median seconds an epoch after the first waited for its first batch (in its images/s; hvrep's
    ``input_wait_sec``: the next epoch's pipeline starting after this one's last step)."""
    waits = [e["input_wait_sec"] for e in events if e["event"] == "epoch" and "input_wait_sec" in e][1:]
    return float(np.median(waits)) if waits else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4, help="epochs per run (the first is not counted)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "default_scaling.jsonl"))
    args = p.parse_args(argv)
    rid, contenders = run_id(), _contenders()
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))  # alternate who goes first
            for name in order:
                prefix, overrides = contenders[name]
                t0 = time.time()
                run = _run_apart if name == APART else _run
                ips, wait = run(prefix, overrides, Path(scratch) / f"{name}-{r}", args.epochs)
                rates[name].append(ips)
                record = {"run_id": rid, "benchmark": "default_scaling", "round": r, "contender": name,
                          "images_per_sec": ips, "wall_s": time.time() - t0, "epochs": args.epochs,
                          "cpu_count": os.cpu_count(), "input_wait_s": wait}
                append_jsonl(Path(args.out), [record])
                waited = f"  (an epoch waited {1e3 * wait:.0f} ms for its first batch)" if wait is not None else ""
                print(f"round {r} {name:18s} {ips:8,.0f} images/s{waited}", flush=True)
    summary = {"run_id": rid, "benchmark": "default_scaling", "summary": True}
    for two in ("2rank-horovodrun", "2rank-mpirun", HOROVOD_GLOO, HOROVOD_MPI):
        for one in ("1rank-default", "1rank-1core", PINNED):
            per_round = np.asarray(rates[two]) / (2 * np.asarray(rates[one]))
            key = f"{two}/2x{one}"
            summary[key] = {"median": float(np.median(per_round)), "min": float(per_round.min()),
                            "max": float(per_round.max())}
            print(f"weak scaling {key:34s} median {np.median(per_round):.0%} "
                  f"[{per_round.min():.0%}-{per_round.max():.0%}]")
        per_round = np.asarray(rates[two]) / np.asarray(rates[APART])
        key = f"{two}/{APART}"
        summary[key] = {"median": float(np.median(per_round)), "min": float(per_round.min()),
                        "max": float(per_round.max())}
        print(f"against the ceiling {key:27s} median {np.median(per_round):.0%} "
              f"[{per_round.min():.0%}-{per_round.max():.0%}]")
    for one in ("1rank-1core", PINNED):
        ceiling = np.asarray(rates[APART]) / (2 * np.asarray(rates[one]))
        summary[f"{APART}/2x{one}"] = {"median": float(np.median(ceiling)), "min": float(ceiling.min()),
                                       "max": float(ceiling.max())}
        print(f"the machine's ceiling {APART}/2x{one} median {np.median(ceiling):.0%} "
              f"[{ceiling.min():.0%}-{ceiling.max():.0%}]")
    for name, values in rates.items():
        summary[name] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}
    append_jsonl(Path(args.out), [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
