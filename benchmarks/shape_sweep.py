"""A wider shape sweep than make test's: one training step per shape, in child processes that may crash.

    python benchmarks/shape_sweep.py --threads 1 2 4 --replicas 1 2

The demo model (``small_resnet``) at widths 1-32 and ResNet-50's stem, at batches 1-129 (global; on R
in-graph replicas split as evenly as they go), per (threads, replicas) group, as
tests/unit/known_issues/test_shape_sweep.py does (``tests/shape_sweep.py``). Prints each shape that did not
run (its signal, e.g. SIGSEGV) and a count per group; exits 1 if any failed. Takes minutes per group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.shape_sweep import sweep

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 15, 16, 17, 24, 32)
BATCHES = (1, 2, 3, 7, 15, 16, 31, 32, 33, 62, 63, 64, 65, 127, 128, 129)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--stem-images", type=int, nargs="+", default=[64, 224], help="ResNet-50 stem image sizes")
    args = p.parse_args(argv)
    shapes = [{"model": "demo", "width": w, "batch": b, "image": 32} for w in args.widths for b in args.batches]
    shapes += [{"model": "stem", "batch": b, "image": i} for i in args.stem_images for b in args.batches
               if i * i * b <= 224 * 224 * 33]  # the stem at 224 px up to batch 33: memory and minutes
    failed = 0
    for threads in args.threads:
        for replicas in args.replicas:
            results = sweep(shapes, threads, replicas, timeout=3600)
            bad = [r for r in results if r.status != "ok"]
            failed += len(bad)
            for r in bad:
                print(r, flush=True)
            print(f"threads={threads} replicas={replicas}: {len(results) - len(bad)} of {len(results)} shapes ran",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
