"""How a rank waits inside MPI (run by test_mpi_wait.py under mpirun, 2 ranks).

A Replicator with the CommConfig named on the command line starts Horovod (and so MPI); then rank 1
sleeps 1 s while rank 0 waits for it in an MPI barrier. Rank 0 prints one JSON line: its thread's
wall, user and system time in that barrier. Open MPI busy-polling spends the second in user space;
with mpi_yield_when_idle it calls sched_yield between polls, so most of it is system time.

    mpirun -np 2 python -m mpi4py tests/multirank/mpi_wait_probe.py default|none|mpi4py-first
"""

import json
import os
import resource
import sys
import time

mode = sys.argv[1]
if mode == "mpi4py-first":  # the user's script started MPI itself before hvrep could set anything
    from mpi4py import MPI

import hvrep  # noqa: E402

config = hvrep.CommConfig(mpi_yield_when_idle=None) if mode == "none" else hvrep.CommConfig()
repl = hvrep.Replicator("horovod", config=config)
from mpi4py import MPI  # noqa: E402 - after the Replicator: importing it starts MPI

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.rank == 1:
    time.sleep(1.0)
before, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
comm.Barrier()
after, t1 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
if comm.rank == 0:
    print("MPI_WAIT " + json.dumps({
        "mode": mode, "wall_s": t1 - t0, "user_s": after.ru_utime - before.ru_utime,
        "sys_s": after.ru_stime - before.ru_stime,
        "OMPI_MCA_mpi_yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle")}), flush=True)
