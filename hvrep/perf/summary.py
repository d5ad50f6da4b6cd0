"""``python -m hvrep.perf.summary RUN [BASELINE...]``: what a training run did, from its metrics.jsonl.

With 1-replica BASELINE runs of the same configuration it adds the scaling
efficiency against each: images/s of RUN / (replicas x images/s of BASELINE),
both the median over their epochs (the first epoch, which compiles, is
excluded when there are several). Each is labelled by how the baseline's batch
relates to RUN's: *weak* scaling when it has RUN's per-replica batch (the
definition Horovod's and Goyal et al.'s scaling figures use: each GPU keeps its
batch), *strong* when it has RUN's global batch (each replica's work halves at
2 replicas, so fixed per-step costs weigh twice as much), *mixed* otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hvrep.errors import HvrepError
from hvrep.train.metrics import read_events


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of ``run_dir``'s metrics.jsonl (torn or foreign lines skipped with a warning)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise HvrepError(f"{path} does not exist. Fix: point at the output_dir of an `hvrep train` run.")
    return read_events(path)


def _last_run(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the last run in the file (a resumed run appends)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "config"]
    return events[starts[-1]:] if starts else events


def throughput(events: list[dict[str, Any]]) -> float | None:
    """Median images/s over the epochs of the last run (first epoch excluded when there are more)."""
    epochs = [e["images_per_sec"] for e in _last_run(events) if e["event"] == "epoch" and "images_per_sec" in e]
    if not epochs:
        final = [e for e in _last_run(events) if e["event"] == "final"]
        return final[-1].get("images_per_sec") if final else None
    steady = sorted(epochs[1:] if len(epochs) > 1 else epochs)
    return steady[len(steady) // 2]


def _batch(config_event: dict[str, Any]) -> tuple[int, int]:
    """(global batch, replicas) of a run's config event."""
    return int(config_event["config"]["train"]["global_batch"]), int(config_event["replicas"])


def scaling_rule(run: tuple[int, int], baseline: tuple[int, int]) -> str:
    """"weak", "strong" or "mixed": how a baseline's (global batch, replicas) relates to a run's."""
    (gb, n), (base_gb, base_n) = run, baseline
    if gb == base_gb:
        return "strong"
    return "weak" if gb * base_n == base_gb * n else "mixed"


def summarize(run_dir: str | Path, *baseline_dirs: str | Path | None) -> dict[str, Any]:
    """What ``run_dir``'s run did; ``scaling_efficiency`` and ``baseline_images_per_sec`` are against the first
    baseline, ``baselines`` lists every one (run, images_per_sec, global_batch, rule, scaling_efficiency)."""
    events = _last_run(read_metrics(run_dir))
    config = next(e for e in events if e["event"] == "config")
    final = next((e for e in reversed(events) if e["event"] == "final"), {})
    out: dict[str, Any] = {
        "run": str(run_dir), "replicas": config["replicas"], "backend": config["backend"],
        "fast_path": config["fast_path"], "optimizer": config["optimizer"], "stopped": final.get("stopped"),
        "top1": final.get("top1"), "top5": final.get("top5"), "steps": final.get("step"),
        "wall_sec": final.get("wall_sec"), "images_per_sec": throughput(events),
    }
    out["global_batch"] = _batch(config)[0]
    out["baselines"] = []
    for baseline_dir in (d for d in baseline_dirs if d is not None):
        base_events = _last_run(read_metrics(baseline_dir))
        base = throughput(base_events)
        if not (base and out["images_per_sec"]):
            continue
        base_batch = _batch(next(e for e in base_events if e["event"] == "config"))
        out["baselines"].append({
            "run": str(baseline_dir), "images_per_sec": base, "global_batch": base_batch[0],
            "rule": scaling_rule(_batch(config), base_batch),
            "scaling_efficiency": out["images_per_sec"] / (out["replicas"] / base_batch[1] * base)})
    if out["baselines"]:
        out["baseline_images_per_sec"] = out["baselines"][0]["images_per_sec"]
        out["scaling_efficiency"] = out["baselines"][0]["scaling_efficiency"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m hvrep.perf.summary RUN_DIR [ONE_REPLICA_RUN_DIR...]", file=sys.stderr)
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
    for b in s["baselines"]:
        per = {"weak": f"{b['rule']} scaling, the same {s['global_batch'] // s['replicas']} images per replica",
               "strong": f"{b['rule']} scaling, the same global batch of {s['global_batch']}"}.get(
            b["rule"], f"mixed: global batch {b['global_batch']} against {s['global_batch']}")
        print(f"  {b['run']}: {b['images_per_sec']:,.0f} images/s -> scaling efficiency "
              f"{100 * b['scaling_efficiency']:.0f}% at {s['replicas']} replicas ({per})")
    if s["baselines"]:
        print("  (measured side by side on this machine; the ranks share its cores)")
    print(f"  outputs: {s['run']}/metrics.jsonl, {s['run']}/tensorboard/, {s['run']}/checkpoints/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
