"""Time to accuracy over slow links: synchronous SGD, fp16, PowerSGD and local SGD on namespace hosts (root only).

    nice -n 5 .venv/bin/python benchmarks/slow_links.py --out results/slow_links.jsonl
    nice -n 5 .venv/bin/python benchmarks/slow_links.py --quick --out /tmp/slow_links_quick.jsonl
    hvrep report results/slow_links.jsonl --out results/slow-links-report

A bed of 2 network-namespace hosts (``hvrep.cluster.netbed``), one rank per host (one per core of a 2-core
machine), launched across them with ``horovodrun --gloo``. For each seed, for each link rate, one launch trains
the workload once per scheme (``_slow_links_worker.SCHEMES``: sync fp32, sync fp16, PowerSGD r = 1 and 4, local
SGD H = 4 and 16 without and with a Nesterov outer step) from the same initial weights on the same batches, and
evaluates the validation accuracy every ``--eval-every`` steps against the training time. Seeds are the outer
loop and the scheme order rotates with the seed, so the schemes of one seed run minutes apart under the same load
and a slow spell of the shared machine does not fall on one scheme.

The workload: a wide MLP (128 -> W -> W -> 10, W = 1024: 1.19 M parameters, 4.77 MB of fp32 gradients) on a
synthetic 10-class Gaussian-mixture task (``_slow_links_worker.make_task``). It has many parameters for its
FLOPs, like the fully connected layers of VGG or AlexNet or an embedding-heavy model: a step computes in about
6 ms per rank and all-reduces 4.77 MB, so the synchronous step is mostly communication at 1 Gbit/s (measured:
the ``comm_share`` of the ``sync_fp32`` run lines). The target accuracy is fixed before the runs (``--target``).

Every run stops after ``--steps`` steps or at the first evaluation past ``--max-train-s`` seconds of training.
Lines (``"benchmark": "slow_links"``) are appended to ``--out`` after each launch: ``nosync`` (compute time and
Horovod's own bytes per second, from a phase with no collective before each scheme), ``curve`` (step, wall_s,
val_acc, step-time breakdown) and ``run`` (final accuracy, step-time breakdown, bytes on the links against the
cost model), plus one ``setup`` line per launch. ``hvrep report`` plots accuracy against wall time per scheme and
tabulates the time to the target (``hvrep.perf.slowlinks``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import append_jsonl, comma_floats, comma_ints, comma_words
from _common import run_id as new_run_id
from _slow_links_worker import OUTER, SCHEMES

from hvrep.cluster import launch, netbed

WORKER = Path(__file__).resolve().with_name("_slow_links_worker.py")
HOSTS = 2  # one rank per host, one host per core of the 2-core machine
# --quick: every scheme and record at both rates, on a small model, in about two minutes.
QUICK = {"seeds": [0], "steps": 32, "eval_every": 16, "width": 256, "train_examples": 8192, "val_examples": 1000,
         "nosync_steps": 16, "max_train_s": 30.0}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments, checked (``--quick`` replaces the sizes with ``QUICK``'s)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-gbit", type=comma_floats, default=[0.1, 1.0], help="link rates, Gbit/s, comma-separated")
    p.add_argument("--seeds", type=comma_ints, default=[0, 1, 2], help="seeds (initial weights and batch order)")
    p.add_argument("--schemes", type=comma_words, default=list(SCHEMES), help=f"of {', '.join(SCHEMES)}")
    p.add_argument("--steps", type=int, default=384, help="steps per run (a multiple of --eval-every)")
    p.add_argument("--eval-every", type=int, default=32,
                   help="steps between evaluations (a multiple of every scheme's H, so local SGD is evaluated "
                        "right after a synchronisation)")
    p.add_argument("--max-train-s", type=float, default=150.0,
                   help="a run stops at the first evaluation past this many seconds of training")
    p.add_argument("--target", type=float, default=0.91,
                   help="target validation accuracy, fixed before the runs (sync fp32 plateaus at about 0.925)")
    p.add_argument("--batch", type=int, default=64, help="per-rank batch")
    p.add_argument("--width", type=int, default=1024, help="the MLP's hidden width")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--outer-lr", type=float, default=OUTER["outer_lr"],
                   help="outer_lr of the *_nesterov schemes (see _slow_links_worker.OUTER for the default's reason)")
    p.add_argument("--outer-momentum", type=float, default=OUTER["outer_momentum"],
                   help="outer_momentum of the *_nesterov schemes")
    p.add_argument("--train-examples", type=int, default=60000)
    p.add_argument("--val-examples", type=int, default=8000)
    p.add_argument("--nosync-steps", type=int, default=32,
                   help="steps of the phase with no collective, before each scheme")
    p.add_argument("--data-seed", type=int, default=1234, help="seed of the synthetic task (one task for all runs)")
    p.add_argument("--launch-timeout", type=float, default=1800, help="seconds per launch (one seed, one rate)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: seed 0, 32 steps, width 256, 1,000 validation examples (numbers not comparable)")
    p.add_argument("--out", type=Path, default=Path("results/slow_links.jsonl"))
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown or not args.schemes:
        p.error(f"--schemes: unknown {unknown or 'none given'}; choose from {', '.join(SCHEMES)}.")
    if len(set(args.schemes)) != len(args.schemes):
        p.error(f"--schemes names a scheme twice: {args.schemes}.")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error(f"--seeds must be distinct integers >= 0, got {args.seeds}.")
    if not args.link_gbit:
        p.error("--link-gbit needs at least one rate.")
    for rate in args.link_gbit:
        if not 0.001 <= rate <= 100:
            p.error(f"--link-gbit {rate} must be in [0.001, 100] Gbit/s.")
    for name in ("steps", "eval_every", "batch", "width", "nosync_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    local = [SCHEMES[s]["local_steps"] for s in args.schemes if "local_steps" in SCHEMES[s]]
    for h in local:
        if args.eval_every % h:
            p.error(f"--eval-every {args.eval_every} must be a multiple of every local SGD H ({h}): local SGD is "
                    "evaluated right after a synchronisation, when the replicas hold one model.")
    if args.steps % args.eval_every:
        p.error(f"--steps {args.steps} must be a multiple of --eval-every {args.eval_every} (a run ends on an "
                "evaluation).")
    if not 0 < args.target < 1:
        p.error(f"--target must be an accuracy in (0, 1), got {args.target}.")
    if args.outer_lr <= 0 or not 0 <= args.outer_momentum < 1:
        p.error(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {args.outer_lr} and "
                f"{args.outer_momentum}.")
    if args.max_train_s <= 0:
        p.error(f"--max-train-s must be > 0, got {args.max_train_s}.")
    if args.val_examples < HOSTS or args.train_examples < args.batch * HOSTS:
        p.error("--val-examples must be >= 2 and --train-examples >= one global batch.")
    return args


def rotated(schemes: Sequence[str], i: int) -> list[str]:
    """``schemes`` started at position i (mod its length): each seed runs them in another order."""
    k = i % len(schemes)
    return [*schemes[k:], *schemes[:k]]


def _launch(bed: netbed.NetBed, args: argparse.Namespace, seed: int, order: list[str], out: Path) -> tuple[int, str]:
    cmd = (sys.executable, str(WORKER), "--seed", str(seed), "--schemes", ",".join(order),
           "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--max-train-s", str(args.max_train_s),
           "--batch", str(args.batch), "--width", str(args.width), "--lr", str(args.lr),
           "--train-examples", str(args.train_examples), "--val-examples", str(args.val_examples),
           "--nosync-steps", str(args.nosync_steps), "--data-seed", str(args.data_seed),
           "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum), "--out", str(out))
    env = bed.env()
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # One TensorFlow thread per rank: one rank per core.
    env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    spec = launch.LaunchSpec(np=HOSTS, command=cmd, hosts=tuple(f"{h}:1" for h in bed.hosts),
                             launcher="horovodrun", allow_run_as_root=os.geteuid() == 0,
                             extra=("--network-interface", netbed.IFACE))
    argv = launch.build_argv(spec, env)
    argv[0] = launch.find_launcher(argv[0], env)
    try:
        proc = bed.run_on("h1", argv, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    except Exception as e:  # a timeout: keep the lines written so far, say so, go on
        return -1, f"{type(e).__name__}: {e}"
    return proc.returncode, (proc.stdout + proc.stderr)[-4000:]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reason = netbed.unavailable_reason()
    if reason is not None:
        print(f"benchmarks/slow_links.py: cannot build the bed: {reason}.", file=sys.stderr)
        return 2
    run_id = new_run_id()
    common = {"benchmark": "slow_links", "run_id": run_id, "hosts": HOSTS, "launcher": "horovodrun --gloo",
              "target": args.target, "quick": args.quick}
    machine = {"commit": _commit(), "cpu_count": os.cpu_count(), "platform": platform.platform()}
    started = time.perf_counter()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="hvrep-slowlinks-") as tmp, \
            netbed.NetBed(hosts=HOSTS, link_gbit=None) as bed:
        print(f"slow_links: bed {bed.prefix}; seeds {args.seeds}, rates {args.link_gbit} Gbit/s, "
              f"{len(args.schemes)} schemes; appending to {args.out}", flush=True)
        launches = 0
        for i, seed in enumerate(args.seeds):
            order = rotated(args.schemes, i)
            for rate in args.link_gbit:
                bed.set_rate(rate)
                out = Path(tmp) / f"launch{launches}.jsonl"
                launches += 1
                t0, before = time.perf_counter(), bed.counters()
                code, tail = _launch(bed, args, seed, order, out)
                after = bed.counters()
                lines = [json.loads(s) for s in out.read_text().splitlines()] if out.is_file() else []
                setup = {"kind": "setup", "link_gbit": rate, "seed": seed, "order": order, "exit_code": code,
                         "ok": code == 0, "launch_s": time.perf_counter() - t0,
                         "config": {k: getattr(args, k) for k in ("steps", "eval_every", "max_train_s", "batch",
                                                                  "width", "lr", "train_examples", "val_examples",
                                                                  "nosync_steps", "data_seed", "outer_lr",
                                                                  "outer_momentum")},
                         "tbf_burst_bytes": netbed.tbf_burst_bytes(rate),
                         "bed_link_bytes": {h: {"tx_bytes": (after[h] - before[h]).tx_bytes,
                                                "rx_bytes": (after[h] - before[h]).rx_bytes} for h in after},
                         "machine": machine, "loadavg": list(os.getloadavg())}
                if code != 0:
                    failures += 1
                    setup["error"] = tail
                append_jsonl(args.out, [{**common, **setup}] + [{**common, **r, "link_gbit": rate} for r in lines])
                _print(lines, rate, seed, args.target, code, tail)
    print(f"slow_links: {launches} launch(es), {failures} failed, {time.perf_counter() - started:.0f} s; "
          f"hvrep report {args.out}", flush=True)
    return 1 if failures else 0


def _commit() -> str | None:
    """The checkout's commit (with "-dirty" when it has changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _print(lines: list[dict[str, Any]], rate: float, seed: int, target: float, code: int, tail: str) -> None:
    for r in lines:
        if r["kind"] == "nosync":
            print(f"  {rate:g} Gbit/s seed {seed} before {r['before']}: compute {1e3 * r['compute_s']:.1f} ms/step, "
                  f"Horovod's own {r['horovod_bytes_per_s'] / 1e3:.0f} kB/s", flush=True)
        elif r["kind"] == "run":
            print(f"  {rate:g} Gbit/s seed {seed} {r['scheme']:<19} {r['steps']:>4} steps {r['wall_s']:>7.1f} s "
                  f"step {1e3 * r['step_s']:>6.1f} ms (comm {100 * r['comm_share']:>3.0f}%) final "
                  f"{r['final_val_acc']:.4f}  bytes measured/model {r['measured_over_predicted']:.3f}", flush=True)
    if code != 0:
        print(f"  launch failed (exit {code}):\n{tail}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
