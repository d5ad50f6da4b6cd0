"""What the benchmarks share: round-robin ratios, spreads, and the common environment record.

Every benchmark times its cases round-robin (one call of each case per
round), so round i of two cases ran seconds apart under the same load;
ratios are taken per round, which cancels slow drift on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import traceback
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def comma_floats(text: str) -> list[float]:
    """``"0.1,1"`` → [0.1, 1.0]: a command-line list (argparse ``type=``)."""
    return [float(v) for v in text.split(",") if v.strip()]


def comma_ints(text: str) -> list[int]:
    """``"2,4"`` → [2, 4]."""
    return [int(v) for v in text.split(",") if v.strip()]


def comma_words(text: str) -> list[str]:
    """``"fp32, fp16"`` → ["fp32", "fp16"]."""
    return [v.strip() for v in text.split(",") if v.strip()]


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    """median, p10, p90, min and max of timings in milliseconds."""
    a = np.asarray(samples_ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "min_ms": float(a.min()), "max_ms": float(a.max())}


def ratio(a: Sequence[float], b: Sequence[float]) -> dict[str, float] | None:
    """Ratio of the medians of a over b, with the spread (p10-p90) of the per-round ratios."""
    if not a or not b or len(a) != len(b):
        return None
    per_round = np.asarray(a, dtype=np.float64) / np.asarray(b, dtype=np.float64)
    return {"of_medians": float(np.median(a) / np.median(b)), "per_round_p10": float(np.percentile(per_round, 10)),
            "per_round_p90": float(np.percentile(per_round, 90))}


def fmt_ratio(r: dict[str, float] | None) -> str:
    if r is None:
        return "-"
    return f"{r['of_medians']:.2f} [{r['per_round_p10']:.2f}-{r['per_round_p90']:.2f}]"


def environment() -> dict[str, Any]:
    """Versions, machine, TF threading and ``hvrep doctor``'s quick report; benchmarks add their own fields."""
    import keras
    import tensorflow as tf

    from hvrep.cluster import doctor

    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "python": sys.version.split()[0],
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(cpus) if cpus is not None else None,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "devices": [d.name for d in tf.config.list_logical_devices()],
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "doctor": doctor.collect(with_tensorflow=False),
    }


def timing_parser(doc: str | None, out: str, repeats_of: str, seed_of: str, quick_warmup: int,
                  quick_repeats: int) -> argparse.ArgumentParser:
    """The flags every timing benchmark takes: --repeats, --warmup, --out, --quick, --seed."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20, help=f"timed calls per {repeats_of} (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first, incl. tracing/compilation (default 3)")
    p.add_argument("--out", type=Path, default=Path(out),
                   help=f"JSON lines file to append to; its folder is created (default {out})")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: {quick_warmup} warm-up call(s) and {quick_repeats} repeats (overrides both)")
    p.add_argument("--seed", type=int, default=0, help=f"seed of the random {seed_of} (default 0)")
    p.set_defaults(_quick=(quick_warmup, quick_repeats))
    return p


def add_shrink_flag(p: argparse.ArgumentParser) -> None:
    """--shrink N, for the benchmarks of ResNet-50's tensors: the same tensors, about 1/N of the bytes."""
    p.add_argument("--shrink", type=int, default=1, metavar="N",
                   help="divide each tensor's last dimension by N, rounded up: the same tensors with about 1/N of "
                        "the bytes, so a smoke test checks every case and record in seconds (default 1: ResNet-50's "
                        "own sizes; timings at N > 1 are not ResNet-50's)")


def shrink_shapes(shapes: Sequence[tuple[str, tuple[int, ...]]], n: int) -> list[tuple[str, tuple[int, ...]]]:
    """``shapes`` with each last dimension divided by ``n``, rounded up; n = 1 leaves them as they are."""
    return [(name, (*s[:-1], -(-s[-1] // n))) for name, s in shapes]


def parse_timing_args(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if getattr(args, "shrink", 1) < 1:
        p.error(f"--shrink must be >= 1, got {args.shrink}.")
    if args.quick:
        args.warmup, args.repeats = args._quick
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}.")
    if args.warmup < 1:
        p.error(f"--warmup must be >= 1 (the first call traces and compiles), got {args.warmup}.")
    return args


def run_id() -> str:
    """An id shared by every record of one run: UTC time, then 8 random hex digits."""
    return f"{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def append_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Appends one JSON line per record to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def warm_up(cases: Sequence[Any], calls: int, label: Callable[[Any], str]) -> None:
    """Runs ``calls`` untimed calls of each case that has no ``error`` yet, into its ``warmup_ms``.

    A case whose call raises gets ``error`` set and is skipped from then on
    (e.g. XLA failing to compile one case); the others still run. Cases have
    ``error``, ``warmup_ms`` and ``timed_call()``.
    """
    for case in cases:
        if case.error is not None:
            continue
        try:
            for _ in range(calls):
                case.warmup_ms.append(case.timed_call())
        except Exception as e:  # reported in the case's record, not fatal to the run
            case.error = f"{type(e).__name__}: {e}".strip()[:2000]
            print(f"{label(case)} failed in warm-up, skipped:\n"
                  + "".join(traceback.format_exception_only(e))[-1500:], file=sys.stderr)


# --------------------------------------------------------------------------- two ranks on this machine
# For benchmarks that launch 2 ranks of themselves (step_overhead, allreduce_parts): the launcher binds
# nothing and each rank pins itself to its local rank's core, so mpirun and horovodrun place ranks alike.

LAUNCH_DROP = ("OMPI_", "PMI_", "PMIX_", "HOROVOD_", "SLURM_")


def pin_to_local_core() -> int:
    """Pins this process to one core: its local rank's among those it may use. Returns the core."""
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or os.environ.get("HOROVOD_LOCAL_RANK") or 0)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[local % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def small_page_pairs(values: int, fill: float, pairs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``pairs`` (send, receive) float32 buffers of ``values`` on 4 KB pages, like TensorFlow's.

    numpy asks the kernel for transparent huge pages for arrays of 4 MB and more (madvise); TensorFlow's
    allocator does not, and Open MPI's single-copy transfer (CMA) pins every page of the peer's buffer.
    """
    huge = np.core.multiarray._get_madvise_hugepage()
    np.core.multiarray._set_madvise_hugepage(False)
    try:
        return [(np.full(values, fill, np.float32), np.empty(values, np.float32)) for _ in range(pairs)]
    finally:
        np.core.multiarray._set_madvise_hugepage(huge)


def two_rank_command(launcher: str, script: str, script_args: Sequence[str]) -> list[str]:
    """``mpirun`` (``-m mpi4py``: one rank's error ends both) or ``horovodrun --gloo``: ``script`` on 2 ranks here."""
    bin_dir = Path(sys.executable).parent
    if launcher == "mpirun":
        return [str(bin_dir / "mpirun"), "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca",
                "mpi_yield_when_idle", "1", sys.executable, "-m", "mpi4py", script, *script_args]
    if launcher == "horovodrun":
        return [str(bin_dir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, script,
                *script_args]
    raise ValueError(f"launcher must be mpirun or horovodrun, got {launcher!r}")


def launch_env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment less any launcher's or scheduler's variables, ``root`` importable, one TensorFlow thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_DROP)}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
               TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(extra or {}))
    return env
