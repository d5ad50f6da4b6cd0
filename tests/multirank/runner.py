"""Runs multi-rank test cases inside ONE launch; executed on every rank.

    mpirun -np 2 python -m mpi4py tests/multirank/runner.py --out DIR cases_a.py cases_b.py
    horovodrun -np 2 --gloo python tests/multirank/runner.py --out DIR cases_a.py

Importing TensorFlow costs seconds per process, so all case modules share one
launch. Each ``case_*`` function of each module runs on every rank in file
order; each rank appends one JSON line per case to ``DIR/rank<R>.jsonl`` and
flushes it at once, so the pytest side (harness.py) can name the case that
hung if a launch times out. A case fails by raising.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"multirank_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--only", default="", help="comma-separated case names to run (default: all)")
    parser.add_argument("modules", nargs="+", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from hvrep import compat, resolve_placement

    rank = resolve_placement().rank
    hvd = compat.import_horovod()
    hvd.init()
    only = {c for c in args.only.split(",") if c}
    out = args.out / f"rank{rank}.jsonl"
    failures = 0
    with open(out, "a") as f:

        def record(**fields) -> None:
            f.write(json.dumps({"rank": rank, **fields}) + "\n")
            f.flush()
            os.fsync(f.fileno())

        record(event="start", size=hvd.size())
        for path in args.modules:
            module = _load(path)
            cases = [(n, fn) for n, fn in vars(module).items() if n.startswith("case_") and callable(fn)]
            for name, fn in cases:
                if only and name not in only:
                    continue
                record(event="begin", module=path.name, case=name)
                t0 = time.perf_counter()
                try:
                    fn()
                    status, error = "ok", ""
                except Exception:  # the case's failure is the result
                    status, error = "fail", traceback.format_exc(limit=8)
                    failures += 1
                record(event="end", module=path.name, case=name, status=status,
                       seconds=round(time.perf_counter() - t0, 3), error=error)
        record(event="done", failures=failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
