"""How often a 2-node Horovod start crashes in MPI_Init under srun --mpi=pmix, per way of starting MPI.

    sudo .venv/bin/python benchmarks/slurm_mpi_init.py --seconds 1200 --out results/slurm_mpi_init.jsonl \
        horovod mpi4py horovod:OMPI_MCA_mpi_yield_when_idle=1 mpi4py:OMPI_MCA_mpi_yield_when_idle=1

One Slurm cluster on eight namespace hosts (tests/slurm/slurm_cluster.py, BedSlurm; 1 Gbit/s links),
four partitions of two hosts. One thread per partition runs ``srun --nodes=2 --ntasks-per-node=1
--mpi=pmix`` steps of benchmarks/_slurm_mpi_init_rank.py back to back until ``--seconds`` have passed,
taking the variants in turn (each thread starting at a different one), so that every variant runs under
the same load. A variant is the rank's argument, optionally with ``:NAME=VALUE`` variables for the step.
One JSON line per step: variant, partition, srun's exit code, ``crash`` (a segmentation fault or ob1's
``mca_pml_ob1_recv_frag_callback_match`` in the output), seconds, and the output's tail when it failed.
Needs root, Slurm (tests/slurm/slurm_cluster.ensure_slurm installs it) and the netbed's tools.
Docs: docs/slurm-multi-node.md, "MPI_Init crash under srun".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm.slurm_cluster import BedSlurm, ensure_slurm  # noqa: E402

PARTITIONS = {"p1": ["h1", "h2"], "p2": ["h3", "h4"], "p3": ["h5", "h6"], "p4": ["h7", "h8"]}


def _step(cluster: BedSlurm, part: str, spec: str, root: Path) -> dict:
    variant, *assignments = spec.split(":")
    env = dict(cluster.env, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    for kv in assignments:
        name, value = kv.split("=", 1)
        env[name] = value
    argv = cluster.bed.argv_on("h1", ["srun", f"--partition={part}", "--nodes=2", "--ntasks-per-node=1",
                                      "--cpus-per-task=1", "--mpi=pmix", sys.executable,
                                      str(REPO / "benchmarks" / "_slurm_mpi_init_rank.py"), variant])
    t0 = time.time()
    try:
        res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240, cwd=root)
        rc, text = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout}{e.stderr}"
    rec = {"variant": spec, "part": part, "rc": rc,
           "crash": "recv_frag_callback_match" in text or "Segmentation fault" in text,
           "ok": text.count("ok rank="), "s": round(time.time() - t0, 1)}
    if rc != 0:
        rec["tail"] = text[-1500:]
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1200)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    ensure_slurm()
    root = Path(tempfile.mkdtemp(prefix="slurm-mpi-init-"))
    cluster = BedSlurm(root, hosts=8, link_gbit=1.0, partitions=PARTITIONS)
    cluster.start()
    end, lock = time.time() + args.seconds, threading.Lock()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def worker(i: int, part: str) -> None:
        j = 0
        while time.time() < end:
            rec = _step(cluster, part, args.variants[(i + j) % len(args.variants)], root)
            j += 1
            with lock, args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    try:
        threads = [threading.Thread(target=worker, args=(i, p), daemon=True) for i, p in enumerate(PARTITIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        cluster.stop()
    counts: dict[str, list[int]] = {}
    for line in args.out.read_text().splitlines():
        rec = json.loads(line)
        c = counts.setdefault(rec["variant"], [0, 0])
        c[0] += 1
        c[1] += rec["crash"]
    for variant, (n, crashed) in counts.items():
        print(f"{variant}: {crashed} crashed of {n}")


if __name__ == "__main__":
    main()
