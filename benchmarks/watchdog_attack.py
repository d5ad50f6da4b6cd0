"""Steps/s of a 2-rank ``hvrep train`` while a peer without the secret attacks the watchdog's port, vs none.

    python benchmarks/watchdog_attack.py --rounds 3 --out results/watchdog_attack.jsonl
    python benchmarks/watchdog_attack.py --rounds 1 --launchers mpirun --steps 12    # smoke test

Each launch is ``hvrep train --config demo`` on 2 ranks (``mpirun`` and ``horovodrun --gloo``), one training
step a line in metrics.jsonl (``train.log_every=1``); steps/s is 1 / the median interval between consecutive
steps' lines after step ``--warmup`` (tracing, start-up and the epochs' evaluations excluded). Attacked and
unattacked launches alternate, the order flipped each round, so drift on a shared machine cancels in the
per-round ratios. The attacker (``tests/multirank/attacker.py``: forged heartbeats on kept-open connections,
made-up MAC fields, garbage, a 4 MB line every 3 s, 50 idle connections kept open) is its own process and
learns the port as a third party would, from the listening sockets: each launch gets
``HVREP_WATCHDOG_PORT`` as a range of its own, and the attacker takes whichever port of it is listening. It
runs from the moment the port listens until the job ends; its own CPU use counts against the attacked run,
as it would on a shared node.

Writes one JSON line per launch (steps/s, exit code, whether the attacker's marker appeared in the job's
output or metrics.jsonl) and one summary line per launcher: the ratio of the medians, attacked over
unattacked, with the p10-p90 spread of the per-round ratios. Issue 29's bar: within 10% (>= 0.90).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

# Benchmarks run as scripts: their folder holds the shared helpers; the attack is the multi-rank tests' own.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, environment, fmt_ratio, ratio, run_id

from tests.multirank import harness

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = ROOT / "tests" / "multirank" / "attacker.py"
MARKER = "INJECTED-watchdog-attack-benchmark"


def _free_range(width: int = 50) -> tuple[int, int]:
    """A range of ports whose first is free now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        first = s.getsockname()[1]
    return first, min(first + width, 65535)


def _listening_in(first: int, last: int) -> tuple[str, int] | None:
    """What `ss -ltn` shows a third party: a TCP port of the range in LISTEN."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and first <= c.laddr.port <= last:
            return c.laddr.ip, c.laddr.port
    return None


def _steps_per_sec(events: list[dict], warmup: int) -> float | None:
    """1 / the median time between consecutive steps' lines after ``warmup``: the epochs' evaluations and
    checkpoints fall between two steps, and the median leaves those few intervals out."""
    train = [e for e in events if e.get("event") == "train" and e["step"] >= warmup]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(train) if b["step"] == a["step"] + 1]
    return 1 / statistics.median(gaps) if gaps else None


def launch(launcher: str, attacked: bool, demo: Path, steps: int, warmup: int, rate: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hvrep-attack-") as tmp:
        out, log = Path(tmp) / "run", Path(tmp) / "job.log"
        first, last = _free_range()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
        env.update(HVREP_WATCHDOG_PORT=f"{first}-{last}", TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        args = ["--config", "demo", f"data.data_dir={demo}", f"output_dir={out}", f"train.max_steps={steps}",
                "train.log_every=1", "train.steps_per_loop=1"]
        attacker = None
        t0 = time.monotonic()
        with log.open("w") as sink:
            proc = subprocess.Popen(harness.train_command(launcher, args), stdout=sink, stderr=subprocess.STDOUT,
                                    env=env, cwd=ROOT, start_new_session=True)
            try:
                while attacked and attacker is None and proc.poll() is None:
                    found = _listening_in(first, last)
                    if found:
                        attacker = subprocess.Popen([sys.executable, str(ATTACKER), found[0], str(found[1]),
                                                     "--seconds", "3600", "--marker", MARKER, "--rate", str(rate)],
                                                    stdout=subprocess.PIPE, text=True)
                    time.sleep(0.2)
                code = proc.wait(timeout=900)
            finally:
                if attacker is not None:
                    attacker.send_signal(signal.SIGKILL)
                    attacker.wait()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        metrics = out / "metrics.jsonl"
        text = metrics.read_text() if metrics.is_file() else ""
        events = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
        output = log.read_text()
        return {"launcher": launcher, "attacked": attacked, "exit_code": code,
                "steps_per_sec": _steps_per_sec(events, warmup), "steps": steps, "warmup": warmup,
                "wall_sec": round(time.monotonic() - t0, 1), "attacker_started": attacker is not None,
                "marker_in_output_or_metrics": MARKER in output or MARKER in text,
                "watchdog_report": "hvrep: " in output and "collective" in output,
                **({"output_tail": output[-2000:]} if code else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="attacked + unattacked launches per launcher (default 3)")
    p.add_argument("--launchers", nargs="+", default=["mpirun", "horovodrun"], choices=["mpirun", "horovodrun"])
    p.add_argument("--steps", type=int, default=60, help="train.max_steps (default 60: about 3 demo epochs)")
    p.add_argument("--warmup", type=int, default=4, help="steps not timed (default 4)")
    p.add_argument("--rate", type=float, default=5, help="the attacker's rounds of forged lines per second (default 5)")
    p.add_argument("--out", type=Path, default=Path("results/watchdog_attack.jsonl"))
    args = p.parse_args(argv)

    from hvrep.data import write_demo

    rid = run_id()
    demo_root = Path(tempfile.mkdtemp(prefix="hvrep-demo-"))
    write_demo(demo_root)
    append_jsonl(args.out, [{"run": rid, "kind": "environment", **environment()}])
    for launcher in args.launchers:
        rates: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for attacked in order:
                rec = launch(launcher, attacked, demo_root / "tfrecord", args.steps, args.warmup, args.rate)
                rec.update(run=rid, kind="launch", round=r)
                append_jsonl(args.out, [rec])
                print(json.dumps({k: v for k, v in rec.items() if k != "output_tail"}), flush=True)
                if rec["steps_per_sec"] is not None and rec["exit_code"] == 0:
                    rates[attacked].append(rec["steps_per_sec"])
        pair = min(len(rates[True]), len(rates[False]))
        summary = {"run": rid, "kind": "summary", "launcher": launcher, "rounds": args.rounds,
                   "attacked_steps_per_sec": rates[True], "unattacked_steps_per_sec": rates[False],
                   "attacked_over_unattacked": ratio(rates[True][:pair], rates[False][:pair])}
        append_jsonl(args.out, [summary])
        print(f"{launcher}: attacked / unattacked steps/s = {fmt_ratio(summary['attacked_over_unattacked'])} "
              f"(median [p10-p90 per round]; {pair} rounds)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
