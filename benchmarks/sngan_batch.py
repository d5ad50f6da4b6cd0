"""The SN-GAN batch-size finding at small scale: sample quality at equal generator steps, by global batch.

    python benchmarks/sngan_batch.py --steps 600 --seeds 0 1 2 --out results/sngan_batch.jsonl \
        --plot docs/sngan_batch.png

TF-Replicator's paper trained its class-conditional SN-GAN on larger global batches than one device holds
(cross-replica batch norm in the generator) and found better samples at equal generator updates. Here:
``examples.sngan.train`` on the shipped digits at global batch 32, 64, 128 and 256 (per D or G update), on 1
process and on 2 ranks (``horovodrun --gloo``), each for ``--steps`` generator updates and each seed, one run
at a time. Each run's last evaluation (the Fréchet distance and class accuracy of the EMA generator's samples,
by the cached digits classifier) is one JSON line; then one line per (batch, ranks) with the mean and spread
over seeds, and a table. ``--plot`` draws the Fréchet distance against the global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _command(ranks: int, overrides: list[str]) -> list[str]:
    app = [sys.executable, "-m", "examples.sngan.train", *overrides]
    if ranks == 1:
        return app
    return [str(BIN / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", *app]


def one_run(batch: int, ranks: int, seed: int, steps: int, threads: int | None, timeout: float) -> dict[str, Any]:
    """One training run; its final evaluation, wall time and exit code."""
    with tempfile.TemporaryDirectory(prefix="sngan-batch-") as tmp:
        overrides = [f"output_dir={tmp}/run", f"global_batch={batch}", f"steps={steps}", "eval_every=0",
                     "checkpoint_every=0", f"gan.seed={seed}", "steps_per_loop=50"]
        if threads:
            overrides.append(f"threads={threads}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   TF_CPP_MIN_LOG_LEVEL="2")
        t0 = time.time()
        proc = subprocess.run(_command(ranks, overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        wall = time.time() - t0
        lines = [json.loads(s) for s in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()] \
            if (Path(tmp) / "run" / "metrics.jsonl").is_file() else []
    evals = [r for r in lines if r["event"] == "eval"]
    refs = [r for r in lines if r["event"] == "reference"]
    record: dict[str, Any] = {"kind": "run", "global_batch": batch, "ranks": ranks, "seed": seed, "steps": steps,
                              "returncode": proc.returncode, "wall_sec": round(wall, 1)}
    if evals:
        record.update(fid=evals[-1]["fid"], class_accuracy=evals[-1]["class_accuracy"])
    if refs:
        record.update(class_mean_fid=refs[-1]["class_mean"]["fid"], held_out_fid=refs[-1]["held_out"]["fid"])
    if proc.returncode != 0:
        record["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
    return record


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (global batch, ranks): mean, min and max of the Fréchet distance and class accuracy over seeds."""
    out = []
    for key in sorted({(r["global_batch"], r["ranks"]) for r in runs}):
        ok = [r for r in runs if (r["global_batch"], r["ranks"]) == key and "fid" in r]
        if not ok:
            continue
        fids, accs = [r["fid"] for r in ok], [r["class_accuracy"] for r in ok]
        out.append({"kind": "summary", "global_batch": key[0], "ranks": key[1], "seeds": len(ok),
                    "steps": ok[0]["steps"], "fid_mean": statistics.mean(fids), "fid_min": min(fids),
                    "fid_max": max(fids), "class_accuracy_mean": statistics.mean(accs),
                    "class_accuracy_min": min(accs), "class_accuracy_max": max(accs),
                    "wall_sec_mean": statistics.mean(r["wall_sec"] for r in ok)})
    return out


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for ranks in sorted({s["ranks"] for s in summary}):
        rows = [s for s in summary if s["ranks"] == ranks]
        xs = [s["global_batch"] for s in rows]
        ax.errorbar(xs, [s["fid_mean"] for s in rows],
                    yerr=[[s["fid_mean"] - s["fid_min"] for s in rows], [s["fid_max"] - s["fid_mean"] for s in rows]],
                    marker="o", capsize=3, label=f"{ranks} rank(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch per update")
    ax.set_ylabel("Fréchet distance (lower is better)")
    ax.set_title(f"SN-GAN on the digits, {summary[0]['steps']} G steps")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=600, help="generator updates per run (equal for every batch)")
    p.add_argument("--threads", type=int, default=None, help="each rank's threads (default: its share)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", type=Path, default=Path("results/sngan_batch.jsonl"))
    p.add_argument("--plot", type=Path, default=None, help="PNG of the Fréchet distance by global batch")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    with args.out.open("a") as sink:
        for seed in args.seeds:  # every configuration once per seed, so drift in the machine's load spreads evenly
            for ranks in args.ranks:
                for batch in args.batches:
                    rec = one_run(batch, ranks, seed, args.steps, args.threads, args.timeout)
                    runs.append(rec)
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                    print(json.dumps({k: v for k, v in rec.items() if k != "error_tail"}), flush=True)
        summary = summarise(runs)
        for s in summary:
            sink.write(json.dumps(s) + "\n")
    print(f"{'batch':>6} {'ranks':>5} {'seeds':>5} {'FID mean [min-max]':>24} {'class acc mean [min-max]':>26}")
    for s in summary:
        print(f"{s['global_batch']:>6} {s['ranks']:>5} {s['seeds']:>5} "
              f"{s['fid_mean']:>10.2f} [{s['fid_min']:.2f}-{s['fid_max']:.2f}] "
              f"{s['class_accuracy_mean']:>10.3f} [{s['class_accuracy_min']:.3f}-{s['class_accuracy_max']:.3f}]")
    if args.plot and summary:
        plot(summary, args.plot)
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
