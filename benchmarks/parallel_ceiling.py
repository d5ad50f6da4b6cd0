"""The most N ranks can get from N cores here: N independent copies of one job at once vs one alone.

    python benchmarks/parallel_ceiling.py --copies 2 --rounds 3 --out results/parallel_ceiling.jsonl

Scaling efficiency assumes that N ranks get N times the hardware. On a VM the
N vCPUs may share physical cores, caches and memory bandwidth with each other
(and with other guests), so N copies of a job that share *nothing* -- no
communication, no files -- can already run slower each than one copy alone.
Their ratio is the ceiling of any N-rank scaling efficiency on the machine:

    ceiling = mean rate of a copy among N at once / rate of one copy alone

Two workloads, each timed both ways, alternating (alone, together, together,
alone, ...) so drift in the machine's speed hits both:

* ``step``: ``hvrep bench throughput`` (the demo's small ResNet, 32 images per
  step, one TF thread: what each rank of ``make demo`` computes, without input
  or communication), one process per copy, its median step;
* ``spin``: a pure-Python loop (no memory traffic): how much of a core each
  vCPU gives when the other is busy.

One JSON line per round and workload, and a summary line per workload, go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl
from _common import environment as common_environment
from _common import run_id as new_run_id

_SPIN = "import time\nt=time.perf_counter()\nn=0\nwhile n < {n}: n += 1\nprint({n}/(time.perf_counter()-t))"


def _step_cmd(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "hvrep.perf.bench", "throughput", "--model", "small_resnet",
            "--per-replica-batch", "32", "--image-size", "32", "--steps", str(steps), "--warmup", "3",
            "--threads-per-rank", "1", "--out", str(out)]


def _run_copies(workload: str, copies: int, scratch: Path, steps: int, spin: int) -> list[float]:
    """Starts ``copies`` copies at once; each one's rate (images/s for step, iterations/s for spin)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "HOROVOD_", "SLURM_"))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    procs, outs = [], []
    for i in range(copies):
        if workload == "step":
            out = scratch / f"{time.monotonic_ns()}-{i}.jsonl"
            outs.append(out)
            cmd = _step_cmd(out, steps)
        else:
            cmd = [sys.executable, "-c", _SPIN.format(n=spin)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rates = []
    for i, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"copy {i} of {workload} failed ({p.returncode}):\n{stderr[-2000:]}")
        if workload == "step":
            record = json.loads(outs[i].read_text().splitlines()[0])
            rates.append(float(record["summary"]["images_per_sec"]))
        else:
            rates.append(float(stdout.split()[-1]))
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=2, help="copies run at once (default 2: the demo's ranks)")
    p.add_argument("--rounds", type=int, default=3, help="alternations per workload (default 3)")
    p.add_argument("--steps", type=int, default=60, help="timed steps of each step copy (default 60)")
    p.add_argument("--spin", type=int, default=30_000_000, help="iterations of each spin copy")
    p.add_argument("--workloads", default="step,spin", help="comma-separated: step, spin")
    p.add_argument("--out", type=Path, default=Path("results/parallel_ceiling.jsonl"))
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if args.copies < 2 or args.rounds < 1 or not workloads or set(workloads) - {"step", "spin"}:
        p.error(f"need --copies >= 2, --rounds >= 1 and --workloads from step,spin; got {args.copies}, "
                f"{args.rounds}, {args.workloads!r}.")
    rid, rows = new_run_id(), []
    with tempfile.TemporaryDirectory(prefix="hvrep-ceiling-") as tmp:
        for w in workloads:
            for r in range(args.rounds):
                order = ["alone", "together"] if r % 2 == 0 else ["together", "alone"]
                got = {how: _run_copies(w, 1 if how == "alone" else args.copies, Path(tmp), args.steps, args.spin)
                       for how in order}
                ceiling = statistics.fmean(got["together"]) / got["alone"][0]
                rows.append({"benchmark": "parallel_ceiling", "record": "round", "run_id": rid, "workload": w,
                             "round": r, "order": order, "copies": args.copies, "alone": got["alone"][0],
                             "together": got["together"], "ceiling": ceiling})
                print(f"{w} round {r + 1} ({' then '.join(order)}): alone {got['alone'][0]:,.1f}/s, "
                      f"{args.copies} at once {', '.join(f'{x:,.1f}' for x in got['together'])}/s -> "
                      f"ceiling {ceiling:.2f}", flush=True)
    summaries = []
    for w in workloads:
        ceilings = [row["ceiling"] for row in rows if row["workload"] == w]
        summaries.append({"benchmark": "parallel_ceiling", "record": "summary", "run_id": rid, "workload": w,
                          "copies": args.copies, "ceiling_median": statistics.median(ceilings),
                          "ceiling_min": min(ceilings), "ceiling_max": max(ceilings), "env": common_environment()})
        print(f"{w}: ceiling of {args.copies}-rank efficiency {statistics.median(ceilings):.2f} "
              f"[{min(ceilings):.2f}, {max(ceilings):.2f}] over {len(ceilings)} rounds")
    append_jsonl(args.out, [*rows, *summaries])
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
