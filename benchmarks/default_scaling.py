"""The 2-rank demo with default settings against 1 rank: does `hvrep train` scale without flags?

Contenders, one run each per round, in turn (round-robin, so a round's runs share the machine's load):
  1rank-default   hvrep train, 1 process, defaults (TensorFlow's pools on every core), global batch 32
  1rank-1core     the same with train.threads=1 (one core: the weak-scaling baseline of a rank's share)
  2rank-horovodrun  horovodrun -np 2 --gloo hvrep train, defaults, global batch 64 (32 per rank)
  2rank-mpirun      mpirun -np 2 hvrep train (Open MPI's own binding), defaults, global batch 64

Each run's throughput is the median images/s of its epochs after the first (``hvrep.perf.summary``).
Weak scaling = 2-rank images/s / (2 x a 1-rank run's), per round, against each baseline.

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
        "2rank-horovodrun": ([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", HVREP, "train"],
                             ["train.global_batch=64"]),
        "2rank-mpirun": ([str(BIN / "mpirun"), "-np", "2", HVREP, "train"], ["train.global_batch=64"]),
    }


def _run(prefix: list[str], overrides: list[str], out: Path, epochs: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [*prefix, "--config", "demo", f"output_dir={out}", f"train.epochs={epochs}", "train.eval_every=1000",
           "optim.warmup_epochs=1", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return float(throughput(read_metrics(out)))


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
                ips = _run(prefix, overrides, Path(scratch) / f"{name}-{r}", args.epochs)
                rates[name].append(ips)
                record = {"run_id": rid, "benchmark": "default_scaling", "round": r, "contender": name,
                          "images_per_sec": ips, "wall_s": time.time() - t0, "epochs": args.epochs,
                          "cpu_count": os.cpu_count()}
                append_jsonl(Path(args.out), [record])
                print(f"round {r} {name:18s} {ips:8,.0f} images/s", flush=True)
    summary = {"run_id": rid, "benchmark": "default_scaling", "summary": True}
    for two in ("2rank-horovodrun", "2rank-mpirun"):
        for one in ("1rank-default", "1rank-1core"):
            per_round = np.asarray(rates[two]) / (2 * np.asarray(rates[one]))
            key = f"{two}/2x{one}"
            summary[key] = {"median": float(np.median(per_round)), "min": float(per_round.min()),
                            "max": float(per_round.max())}
            print(f"weak scaling {key:34s} median {np.median(per_round):.0%} "
                  f"[{per_round.min():.0%}-{per_round.max():.0%}]")
    for name, values in rates.items():
        summary[name] = {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}
    append_jsonl(Path(args.out), [summary])
    return 0


if __name__ == "__main__":
    sys.exit(main())
