"""Runs one kind of this folder N times, a point drawn from ``kind.points`` by each seed, one JSON line per
injection on stdout (the campaign's own runner is benchmarks/faults.py; this is for trying one kind):

    python -m benchmarks._faults._try MODULE KIND LAUNCHER N FIRST_SEED [POINT_PREFIX] [--dir DIR]
    python -m benchmarks._faults._try d4pg d4pg local 10 100 actors_stopped

Injections of one call share DIR (default: a new temporary folder), so their uninterrupted reference runs are
made once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks._faults import Injection

KINDS: list = []  # a runner, no kinds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module")
    p.add_argument("kind")
    p.add_argument("launcher", choices=["local", "none", "mpirun", "horovodrun", "gloo"])
    p.add_argument("n", type=int)
    p.add_argument("first_seed", type=int)
    p.add_argument("prefix", nargs="?", default="", help="only points that start with this")
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args(argv)
    (kind,) = [k for k in importlib.import_module(f"benchmarks._faults.{args.module}").KINDS if k.name == args.kind]
    root = args.dir or Path(tempfile.mkdtemp(prefix=f"faults-{args.kind}-"))
    for seed in range(args.first_seed, args.first_seed + args.n):
        rng = random.Random(seed)
        points = [p for p in kind.points(rng) if p.startswith(args.prefix)]
        inj = Injection(kind=args.kind, point=rng.choice(points), seed=seed, launcher=args.launcher)
        t0 = time.monotonic()
        try:
            record = {**dataclasses.asdict(inj), **dataclasses.asdict(kind.run(inj, root / f"seed{seed}"))}
        except Exception:  # the campaign goes on; the failure is its record
            record = {**dataclasses.asdict(inj), "recovered": False, "error": traceback.format_exc()[-2000:]}
        record["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
