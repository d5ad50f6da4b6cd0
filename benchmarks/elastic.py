"""Elastic training's costs: an in-memory commit per training step, and the recovery from a killed worker.

    python benchmarks/elastic.py --out results/elastic.jsonl             # both parts
    python benchmarks/elastic.py --quick --no-recovery                   # the commit part only, in seconds
    python benchmarks/elastic.py --bed --recoveries 1                    # the recovery on 3 namespace hosts

* ``commit``: in one process, the demo's model and optimizer (``hvrep train --config demo``: the small ResNet,
  its LARS optimizer) and its compiled training step on one synthetic batch of the demo's global batch (64);
  round-robin, each round times one step and one ``hvrep.elastic.State.commit()`` (the copy into memory and
  the host-update check). ``cost_per_step`` = commit / (``elastic.commit_every_steps`` x step), the median of
  the per-round ratios with their spread: the share of training time the default interval costs (goal: at
  most 2%). On several ranks a commit also broadcasts a few bytes (the host-update check): not in this figure.
* ``recovery``: ``horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script`` with ``localhost`` and
  ``127.0.0.1`` as the two hosts runs ``hvrep train --config demo`` (``train.log_every=1``, so every step is a
  metrics line); rank 1 is SIGKILLed after step 30; the time from the kill to the first step the survivor
  completes on its own is the recovery. Each launch is one sample (``--recoveries``). ``--bed``: the same on
  3 network-namespace hosts (``hvrep.cluster.netbed``, root), ``-np 3 --min-np 2 --max-np 3``, global batch 48.

One JSON line per round or launch and a summary line per part go to ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


def commit_rounds(warmup: int, repeats: int, seed: int) -> tuple[list[float], list[float], int, int]:
    """Per round: a demo step's and a commit's milliseconds; the commit interval, and the bytes a commit copies."""
    import numpy as np
    import tensorflow as tf

    import hvrep
    from hvrep.train import config as configs
    from hvrep.train import main as train_main
    from hvrep.train import optim as optimizers
    from hvrep.train.steps import Runner

    cfg = configs.build("demo", [])
    repl = hvrep.Replicator("local")
    with repl.scope():
        model = train_main._model(cfg)
        optim = optimizers.build(cfg, 1437)
        optim.optimizer.build(model.trainable_variables)
    runner = Runner(repl, model, optim.optimizer, num_classes=cfg.model.num_classes, label_smoothing=0.0,
                    fp16=False, jit_compile=False)
    state = hvrep.elastic.State(repl, model, optim.optimizer, epoch=0, step=0)
    rng = np.random.default_rng(seed)
    size, gb = cfg.data.image_size, cfg.train.global_batch
    x = tf.constant(rng.normal(size=(gb, size, size, 3)).astype(np.float32))
    y = tf.constant(rng.integers(0, cfg.model.num_classes, gb).astype(np.int32))

    def step() -> None:
        runner.train(x, y)
        runner.totals()  # waits for the step

    steps, commits = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        state.commit()
        t2 = time.perf_counter()
        if i >= warmup:
            steps.append((t1 - t0) * 1e3)
            commits.append((t2 - t1) * 1e3)
    nbytes = sum(int(np.asarray(v.numpy()).nbytes) for v in state.variables)
    return steps, commits, cfg.elastic.commit_every_steps, nbytes


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def recovery(tmp: Path, bed: Any = None) -> dict[str, Any]:
    """One launch: seconds from the kill of rank 1 to the survivors' first step without it, and the reset line.

    Without ``bed``: two workers on ``localhost`` and ``127.0.0.1``. With an ``hvrep.cluster.netbed.NetBed`` of
    3 hosts: one worker on each, ``--min-np 2 --max-np 3``, global batch 48 (divisible by 2 and 3), horovodrun
    started on h1.
    """
    import psutil

    hosts, script, run = tmp / "hosts", tmp / "discover.sh", tmp / "run"
    names = list(bed.hosts) if bed is not None else ["localhost", "127.0.0.1"]
    hosts.write_text("".join(f"{h}:1\n" for h in names))
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    n, iface = len(names), ("hv0" if bed is not None else "lo")
    cmd = [sys.executable, str(BIN / "horovodrun"), "--gloo", "-np", str(n), "--min-np", str(n - 1), "--max-np", str(n),
           "--host-discovery-script", str(script), "--network-interface", iface, sys.executable, "-m", "hvrep.cli",
           "train", "--config", "demo", f"output_dir={run}", "train.epochs=3", "train.log_every=1",
           "train.threads=1", f"elastic.min_np={n - 1}", f"elastic.max_np={n}", "train.global_batch=48"]
    env = {**(bed.env() if bed is not None else os.environ),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if bed is not None:
        cmd = bed.argv_on("h1", cmd)
    with (tmp / "job.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        killed = None
        deadline = time.monotonic() + 400
        while killed is None and time.monotonic() < deadline and proc.poll() is None:
            if sum(e["event"] == "train" for e in _events(run)) >= 30:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if "hvrep.cli" in " ".join(p.cmdline()) and p.environ().get("HOROVOD_RANK") == "1":
                            p.send_signal(signal.SIGKILL)
                            killed = time.time()
            time.sleep(0.05)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    events = _events(run)
    reset = next((e for e in events if e["event"] == "reset"), None)
    if killed is None or reset is None:
        return {"error": f"no kill or no reset (exit {proc.returncode}); see {tmp / 'job.log'}"}
    first = next((e for e in events if e["event"] == "train" and e["time"] > reset["time"]), None)
    final = events[-1] if events and events[-1]["event"] == "final" else {}
    return {"hosts": n, "where": "netbed" if bed is not None else "local host names",
            "recovery_s": round(first["time"] - killed, 3) if first else None, "reset": reset,
            "exit_code": proc.returncode, "top1": final.get("top1")}


def main(argv: list[str] | None = None) -> int:
    p = _common.timing_parser(__doc__, "results/elastic.jsonl", "part", "batch", 1, 5)
    p.add_argument("--recoveries", type=int, default=3, help="launches timed for the recovery (default 3)")
    p.add_argument("--no-recovery", action="store_true", help="the commit part only")
    p.add_argument("--bed", action="store_true",
                   help="the recovery on 3 network-namespace hosts (hvrep.cluster.netbed; root), --min-np 2")
    args = _common.parse_timing_args(p, argv)
    run_id, env = _common.run_id(), _common.environment()
    records: list[dict[str, Any]] = []
    steps, commits, every, nbytes = commit_rounds(args.warmup, args.repeats, args.seed)
    per_round = [c / (every * s) for s, c in zip(steps, commits, strict=True)]
    records += [{"benchmark": "elastic", "part": "commit", "round": i, "step_ms": s, "commit_ms": c}
                for i, (s, c) in enumerate(zip(steps, commits, strict=True))]
    ordered = sorted(per_round)
    summary = {"benchmark": "elastic", "part": "commit", "summary": True, "commit_every_steps": every,
               "commit_bytes": nbytes, "step": _common.percentiles(steps), "commit": _common.percentiles(commits),
               "cost_per_step": ordered[len(ordered) // 2], "cost_per_step_p10": ordered[len(ordered) // 10],
               "cost_per_step_p90": ordered[(len(ordered) * 9) // 10], "goal": 0.02}
    records.append(summary)
    print(f"commit every {every} steps: a commit {summary['commit']['median_ms']:.1f} ms ({nbytes / 1e6:.1f} MB), a "
          f"step {summary['step']['median_ms']:.1f} ms: {100 * summary['cost_per_step']:.2f}% per step "
          f"[{100 * summary['cost_per_step_p10']:.2f}-{100 * summary['cost_per_step_p90']:.2f}] (goal <= 2%)")
    if not args.no_recovery:
        samples = []
        for i in range(args.recoveries):
            with tempfile.TemporaryDirectory(prefix="hvrep-elastic-") as tmp, contextlib.ExitStack() as stack:
                bed = None
                if args.bed:
                    from hvrep.cluster import netbed

                    bed = stack.enter_context(netbed.NetBed(hosts=3, link_gbit=None))
                got = recovery(Path(tmp), bed)
            records.append({"benchmark": "elastic", "part": "recovery", "launch": i, **got})
            print(f"recovery {i}: {got}")
            if got.get("recovery_s") is not None:
                samples.append(got["recovery_s"] * 1e3)
        if samples:
            records.append({"benchmark": "elastic", "part": "recovery", "summary": True,
                            "recovery": _common.percentiles(samples), "launches": len(samples)})
    _common.append_jsonl(args.out, [{**r, "run_id": run_id, "env": env} for r in records])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
