"""Training-step throughput on synthetic data, hvrep vs the plain-Horovod step, with a breakdown.

    python benchmarks/throughput.py --model small_resnet --per-replica-batch 32
    mpirun -np 2 python -m mpi4py benchmarks/throughput.py --out results/throughput.jsonl
    hvrep bench scaling --ranks 1,2        # the sweep, launched for you; then `hvrep report`

The measurement lives in ``hvrep.perf.bench`` (so ``hvrep bench`` works from an
installed hvrep); this script is its entry point in benchmarks/.
"""

import sys

from hvrep.perf.bench import main

if __name__ == "__main__":
    sys.exit(main(["throughput", *sys.argv[1:]]))
