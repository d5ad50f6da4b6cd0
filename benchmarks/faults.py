"""The fault campaign (issue 49): inject each kind of fault at named points chosen by a seed, and check that
nothing is lost.

Every module of ``benchmarks/_faults`` exposes ``KINDS`` (see ``benchmarks/_faults/__init__.py``); this runs
``--per-kind`` injections of each (``--checkpoint-injections`` of the kinds named ``ckpt_*``, the faults inside
a checkpoint save), cycling through each kind's points and ``--launchers``, and appends one JSON line per
injection to ``--out``: the Injection's and the Outcome's fields, ``ok`` (recovered, nothing lost, the exit code
the docs give) and the run's ``run_id``, date and load. ``hvrep report results/faults.jsonl`` renders the table
(hvrep.perf.faults).

    python benchmarks/faults.py                                    # every kind (hours on a small machine)
    python benchmarks/faults.py --kinds disk_full --per-kind 2     # one kind, quickly
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import os
import pkgutil
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _faults
from benchmarks._common import append_jsonl, run_id
from benchmarks._faults import Injection, Outcome

BENCHMARK = "faults"  # the lines' "benchmark" (hvrep.perf.faults.FAULTS)


def discover() -> list[Any]:
    """Every kind of every module in benchmarks/_faults, in module order."""
    kinds = []
    for info in sorted(pkgutil.iter_modules(_faults.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"benchmarks._faults.{info.name}")
        kinds.extend(getattr(module, "KINDS", []))
    return kinds


def injections(kind: Any, count: int, launchers: list[str], seed: int) -> list[Injection]:
    """``count`` injections of ``kind``: points in turn from ``kind.points``, launchers in turn, seeds from ``seed``."""
    rng = random.Random(f"{kind.name}/{seed}")
    points = kind.points(rng)
    # A kind that says which launchers it runs under (a kind without ranks: ("none",)) gets those of the asked.
    own = getattr(kind, "launchers", None)
    launchers = [x for x in launchers if own is None or x in own] or list(own or launchers)[:1]
    out = []
    for i in range(count):
        rng.shuffle(points) if i % len(points) == 0 else None
        out.append(Injection(kind.name, points[i % len(points)], rng.randrange(2**31), launchers[i % len(launchers)]))
    return out


def is_ok(outcome: Outcome) -> bool:
    return outcome.recovered and not outcome.lost and outcome.exit_code == outcome.expected_exit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", default="", help="comma-separated kind names (default: every kind found)")
    p.add_argument("--per-kind", type=int, default=10, help="injections of each kind (default 10)")
    p.add_argument("--checkpoint-injections", type=int, default=50,
                   help="injections of each kind inside a checkpoint save, ckpt_* (default 50)")
    p.add_argument("--launchers", default="mpirun,gloo", help="launchers for kinds with ranks (mpirun,gloo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/faults.jsonl"))
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new one in /tmp, removed)")
    args = p.parse_args(argv)
    kinds = discover()
    wanted = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(wanted) - {k.name for k in kinds})
    if unknown:
        p.error(f"--kinds names {unknown}; the kinds found are {[k.name for k in kinds]}")
    kinds = [k for k in kinds if not wanted or k.name in wanted]
    launchers = [x for x in args.launchers.split(",") if x]
    scratch = args.workdir or Path(tempfile.mkdtemp(prefix="hvrep-faults-"))
    rid = run_id()
    common = {"benchmark": BENCHMARK, "run_id": rid, "host": os.uname().nodename, "cpus": os.cpu_count(),
              "command": " ".join(["python", "benchmarks/faults.py", *(argv if argv is not None else sys.argv[1:])])}
    total = bad = 0
    # Kinds take turns (one injection of each, then the next round), so a campaign cut short still covers each.
    planned = {k.name: injections(k, args.checkpoint_injections if k.name.startswith("ckpt_") else args.per_kind,
                                  launchers, args.seed) for k in kinds}
    turns = [(kind, i, plan[i]) for i in range(max(map(len, planned.values()), default=0))
             for kind in kinds if i < len(plan := planned[kind.name])]
    try:
        for kind, i, inj in turns:
            count = len(planned[kind.name])
            load = os.getloadavg()[0]
            t0 = time.monotonic()
            try:
                outcome = kind.run(inj, scratch / f"{kind.name}-{i}")
            except Exception as e:  # an injection that breaks the harness is reported, not fatal
                outcome = Outcome(False, 0, 0.0, [f"the injection failed: {type(e).__name__}: {e}"], None, None)
            record = {**common, **dataclasses.asdict(inj), **dataclasses.asdict(outcome), "ok": is_ok(outcome),
                      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      "load_1min": round(load, 2), "seconds": round(time.monotonic() - t0, 1)}
            append_jsonl(args.out, [record])
            total += 1
            bad += not record["ok"]
            print(f"{kind.name} {i + 1}/{count} {inj.point} {inj.launcher}: "
                  f"{'ok' if record['ok'] else 'NOT OK'} {outcome.detail} {outcome.lost or ''}", flush=True)
            shutil.rmtree(scratch / f"{kind.name}-{i}", ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"faults: {total} injection(s), {bad} not ok; lines in {args.out} (run {rid}); "
          f"table: hvrep report {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
