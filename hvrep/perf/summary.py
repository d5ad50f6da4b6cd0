"""``python -m hvrep.summary RUN [BASELINE]``: what a training run did, from its metrics.jsonl.

With a 1-replica BASELINE run of the same configuration it adds the scaling
efficiency: images/s of RUN / (replicas x images/s of BASELINE), both the
median over their epochs (the first epoch, which compiles, is excluded when
there are several).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hvrep.errors import HvrepError


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise HvrepError(f"{path} does not exist. Fix: point at the output_dir of an `hvrep train` run.")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_run(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the last run in the file (a resumed run appends)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "config"]
    return events[starts[-1]:] if starts else events


def throughput(events: list[dict[str, Any]]) -> float | None:
    """Median images/s over the epochs of the last run (first epoch excluded when there are more)."""
    epochs = [e["images_per_sec"] for e in _last_run(events) if e["event"] == "epoch"]
    if not epochs:
        final = [e for e in _last_run(events) if e["event"] == "final"]
        return final[-1].get("images_per_sec") if final else None
    steady = sorted(epochs[1:] if len(epochs) > 1 else epochs)
    return steady[len(steady) // 2]


def summarize(run_dir: str | Path, baseline_dir: str | Path | None = None) -> dict[str, Any]:
    events = _last_run(read_metrics(run_dir))
    config = next(e for e in events if e["event"] == "config")
    final = next((e for e in reversed(events) if e["event"] == "final"), {})
    out: dict[str, Any] = {
        "run": str(run_dir), "replicas": config["replicas"], "backend": config["backend"],
        "fast_path": config["fast_path"], "optimizer": config["optimizer"], "stopped": final.get("stopped"),
        "top1": final.get("top1"), "top5": final.get("top5"), "steps": final.get("step"),
        "wall_sec": final.get("wall_sec"), "images_per_sec": throughput(events),
    }
    if baseline_dir is not None:
        base = throughput(read_metrics(baseline_dir))
        if base and out["images_per_sec"]:
            out["baseline_images_per_sec"] = base
            out["scaling_efficiency"] = out["images_per_sec"] / (out["replicas"] * base)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m hvrep.perf.summary RUN_DIR [ONE_REPLICA_RUN_DIR]", file=sys.stderr)
        return 2
    try:
        s = summarize(*args)
    except HvrepError as e:
        print(f"hvrep summary: error: {e}", file=sys.stderr)
        return 2
    print(f"run {s['run']}: {s['replicas']} replica(s) on {s['backend']}, {s['optimizer']}, {s['steps']} steps, "
          f"stopped: {s['stopped']}, {s['wall_sec'] or 0:.0f} s")
    if s["top1"] is not None:
        print(f"  validation top-1 {s['top1']:.4f}, top-5 {s['top5']:.4f}")
    print(f"  throughput {s['images_per_sec'] or 0:,.0f} images/s (median epoch)")
    if "scaling_efficiency" in s:
        print(f"  1 replica: {s['baseline_images_per_sec']:,.0f} images/s -> scaling efficiency "
              f"{100 * s['scaling_efficiency']:.0f}% at {s['replicas']} replicas (measured side by side on this "
              "machine; both ranks share its cores)")
    print(f"  outputs: {s['run']}/metrics.jsonl, {s['run']}/tensorboard/, {s['run']}/checkpoints/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
