"""Predict published scaling results with ``hvrep plan`` from their published hardware and single-GPU figures.

    python benchmarks/plan_vs_published.py [--inputs benchmarks/plan_vs_published_inputs.json] [--out FILE]

The inputs file names every input and its source; an input the publications do not give has a range. For
each published point this prints the model's efficiency with every input at its point value, and a band:
the lowest and highest efficiency over every corner of the ranges (all combinations of their ends). Also
per point: the step's breakdown at the point values (compute, exposed communication, negotiation) and
which input moves the prediction most (each range alone, the others at their points), to say which term
a miss comes from. No constant is fitted to any published point.

The models' layer structure (each gradient's bytes, and its layer's share of the backward pass, by forward
FLOPs) comes from ``keras.applications`` built with ``weights=None`` (nothing is downloaded; ~15 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvrep.perf.costmodel import Interconnect
from hvrep.perf.plan import Cluster, Profile, Scheme, predict

HERE = Path(__file__).resolve().parent
INPUTS = HERE / "plan_vs_published_inputs.json"
# The done-when targets of issue 51.
BAND_WIDTH_MAX, POINT_TOLERANCE, FALL_TOLERANCE = 0.20, 0.10, 0.05


def layer_profile(keras_name: str) -> tuple[list[tuple[float, float]], int]:
    """(bytes, forward FLOPs) per layer with trainable weights, in backward order, and the parameter count."""
    import keras

    model = getattr(keras.applications, keras_name)(weights=None)
    rows = []
    for layer in model.layers:
        if not layer.trainable_weights:
            continue
        nbytes = 4 * sum(math.prod(w.shape) for w in layer.trainable_weights)
        if isinstance(layer, keras.layers.Conv2D):
            out = layer.output.shape
            flops = 2 * out[1] * out[2] * math.prod(layer.kernel.shape)
        elif isinstance(layer, keras.layers.Dense):
            flops = 2 * math.prod(layer.kernel.shape)
        else:  # batch normalisation: memory-bound, its FLOPs negligible; ready with its neighbour
            flops = 0
        rows.append((float(nbytes), float(flops)))
    return rows[::-1], model.count_params()


def _ranged(spec: Any) -> tuple[float, float, float]:
    """(point, low, high) of an input (a number, or {"point", "range"})."""
    if isinstance(spec, Mapping):
        low, high = spec.get("range", (spec["point"], spec["point"]))
        return float(spec["point"]), float(low), float(high)
    return float(spec), float(spec), float(spec)


def _inputs_of(point: Mapping[str, Any], cluster: Mapping[str, Any], shared: Mapping[str, Any]) -> dict:
    """Every varying input of one point: name -> (point, low, high)."""
    out = {"single_gpu_images_per_sec": None, "backward_share": _ranged(shared["backward_share"])}
    if "overlap_slowdown" in shared:
        out["overlap_slowdown"] = _ranged(shared["overlap_slowdown"])
    if "backward_s" in point:  # published directly (Goyal et al.): the forward pass from the backward share
        out.pop("single_gpu_images_per_sec")
        out["backward_s"] = _ranged(point["backward_s"])
    else:
        out["single_gpu_images_per_sec"] = _ranged(point["single_gpu_images_per_sec"])
    for key in ("inter_bandwidth_GBps", "inter_latency_us", "intra_bandwidth_GBps", "intra_latency_us",
                "negotiation_us"):
        out[key] = _ranged(cluster[key])
    return out


def efficiency(point: Mapping[str, Any], cluster: Mapping[str, Any], layers: list[tuple[float, float]],
               values: Mapping[str, float], overlap: bool = True) -> tuple[float, Any]:
    """The model's efficiency at point['gpus'] against point['baseline_gpus'], and the target's step."""
    batch = point["per_gpu_batch"]
    share = values["backward_share"]
    if "backward_s" in values:
        backward = values["backward_s"]
        forward = backward * (1 - share) / share
    else:
        step = batch / values["single_gpu_images_per_sec"]
        backward, forward = share * step, (1 - share) * step
    grad_bytes = sum(b for b, _ in layers)
    profile = Profile(name=point["model"], per_replica_batch=batch, forward_s=forward, backward_s=backward,
                      grad_bytes=grad_bytes, tensors=len(layers), layers=tuple(layers),
                      beta_s=values["negotiation_us"] * 1e-6,
                      fusion_threshold_bytes=int(_ranged(cluster["fusion_threshold_bytes"])[0]),
                      cycle_s=_ranged(cluster["cycle_ms"])[0] * 1e-3,
                      bucketing=cluster.get("bucketing", {}).get("point", "dynamic"),
                      overlap_slowdown=values.get("overlap_slowdown", 0.0))
    g = cluster["gpus_per_server"]
    machines = Cluster(g, Interconnect("intra", values["intra_bandwidth_GBps"], values["intra_latency_us"]),
                       Interconnect("inter", values["inter_bandwidth_GBps"], values["inter_latency_us"]),
                       cluster.get("inter_algorithm", "ring"))
    scheme = Scheme("fp32", topology=cluster["topology"])

    def at(gpus: int):
        if gpus % g and gpus > 1:
            raise SystemExit(f"{point['label']}: {gpus} GPUs is not a whole number of {g}-GPU servers")
        if gpus < g:  # one server, partly used: a ring over `gpus` devices of it
            part = Cluster(gpus, machines.intra, machines.inter, machines.inter_algorithm)
            return predict(profile, part, scheme, 1, overlap_backward=overlap)
        return predict(profile, machines, scheme, gpus // g, overlap_backward=overlap)

    target, base = at(point["gpus"]), at(point["baseline_gpus"])
    per_gpu = lambda r: r.images_per_sec / r.devices  # noqa: E731
    return per_gpu(target) / per_gpu(base), target


def implied_bandwidth(point: Mapping[str, Any], cluster: Mapping[str, Any], layers: list[tuple[float, float]],
                      at_point: Mapping[str, float]) -> float | None:
    """The inter-node bus bandwidth (GB/s) at which the model meets the published efficiency (bisection)."""
    target = point["published_efficiency"]

    def gap(bandwidth: float) -> float:
        return efficiency(point, cluster, layers, {**at_point, "inter_bandwidth_GBps": bandwidth})[0] - target

    low, high = 0.05, 50.0
    if gap(low) > 0 or gap(high) < 0:
        return None
    for _ in range(50):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if gap(mid) < 0 else (low, mid)
    return math.sqrt(low * high)


def evaluate(point: Mapping[str, Any], cluster: Mapping[str, Any], shared: Mapping[str, Any],
             layers: list[tuple[float, float]]) -> dict[str, Any]:
    ranges = _inputs_of(point, cluster, shared)
    at_point = {k: v[0] for k, v in ranges.items()}
    eff, step = efficiency(point, cluster, layers, at_point)
    serial, serial_step = efficiency(point, cluster, layers, at_point, overlap=False)
    varying = [k for k, (_, lo, hi) in ranges.items() if lo != hi]
    corners = []
    for ends in itertools.product((1, 2), repeat=len(varying)):
        values = dict(at_point)
        values.update({k: ranges[k][e] for k, e in zip(varying, ends, strict=True)})
        corners.append(efficiency(point, cluster, layers, values)[0])
    swings = {}
    for k in varying:
        lo = efficiency(point, cluster, layers, {**at_point, k: ranges[k][1]})[0]
        hi = efficiency(point, cluster, layers, {**at_point, k: ranges[k][2]})[0]
        swings[k] = (lo, hi)
    return {"label": point["label"], "published": point["published_efficiency"], "point": eff,
            "implied_inter_bandwidth_GBps": implied_bandwidth(point, cluster, layers, at_point),
            "inter_bandwidth_range": "–".join(f"{v:g}" for v in ranges["inter_bandwidth_GBps"][1:]),
            "low": min([*corners, eff]), "high": max([*corners, eff]), "corners": len(corners),
            "step_s": step.step_s, "compute_s": step.compute_s, "exposed_s": step.exposed_communication_s,
            "contention_s": step.contention_s,
            "negotiation_s": step.negotiation_s, "communication_s": step.communication_s,
            "collectives": step.collectives, "swings": swings, "software": point.get("software", ""),
            "no_overlap": serial,
            "no_overlap_exposed_s": serial_step.exposed_communication_s + serial_step.negotiation_s,
            "overlap_exposed_s": step.exposed_communication_s + step.negotiation_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=Path, default=INPUTS)
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per point here")
    args = parser.parse_args(argv)
    data = json.loads(args.inputs.read_text())
    layers = {}
    for name, model in data["models"].items():
        layers[name], count = layer_profile(model["keras"])
        print(f"{name}: keras.applications.{model['keras']}: {count:,} parameters (inputs file: "
              f"{model['parameters']:,}); {len(layers[name])} layers with gradients, "
              f"{sum(b for b, _ in layers[name]) / 1e6:.1f} MB of fp32 gradients")
    results = []
    for point in data["points"]:
        r = evaluate(point, data["clusters"][point["cluster"]], data["shared"], layers[point["model"]])
        results.append(r)
    print()
    print("| published point | published | model (point) | band | width | band holds it | point within ±10 | "
          "no overlap (point) |")
    print("|---|---:|---:|---|---:|---|---|---:|")
    for r in results:
        width = r["high"] - r["low"]
        holds = r["low"] <= r["published"] <= r["high"]
        near = abs(r["point"] - r["published"]) <= POINT_TOLERANCE
        print(f"| {r['label']} | {100 * r['published']:.0f}% | {100 * r['point']:.1f}% | "
              f"{100 * r['low']:.1f}–{100 * r['high']:.1f}% | {100 * width:.1f} | "
              f"{'yes' if holds else 'NO'}{'' if width <= BAND_WIDTH_MAX else ' (band > 20 points)'} | "
              f"{'yes' if near else 'NO'} | {100 * r['no_overlap']:.1f}% |")
    print()
    for r in results:
        swing = ", ".join(f"{k} {100 * lo:.1f}–{100 * hi:.1f}%" for k, (lo, hi) in
                          sorted(r["swings"].items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])))
        print(f"{r['label']}: step {1e3 * r['step_s']:.0f} ms = compute {1e3 * r['compute_s']:.0f} + contention "
              f"{1e3 * r['contention_s']:.0f} + exposed "
              f"communication {1e3 * r['exposed_s']:.0f} + negotiation {1e3 * r['negotiation_s']:.1f} "
              f"(link busy {1e3 * r['communication_s']:.0f} ms in {r['collectives']:.0f} collectives); each input "
              f"alone: {swing}")
    print("\nWhat the published figure needs of the overlap term (a diagnosis, not an input): the share of the "
          "communication the model's overlap hides that the run hid, (no-overlap exposed − needed exposed) / "
          "(no-overlap exposed − model's exposed), at the point inputs.")
    for r in results:
        needed = r["compute_s"] / r["published"] - r["compute_s"]
        span = r["no_overlap_exposed_s"] - r["overlap_exposed_s"]
        share = (r["no_overlap_exposed_s"] - needed) / span if span > 0 else float("nan")
        print(f"  {r['label']}: needed {1e3 * needed:.0f} ms exposed; model's overlap "
              f"{1e3 * r['overlap_exposed_s']:.0f}, none {1e3 * r['no_overlap_exposed_s']:.0f}: "
              f"{share:.2f} of the model's hiding")
    print("\nWhat the published figure needs of the bandwidth term (a diagnosis, not an input): the network bus "
          "bandwidth B_e at which the model gives the published efficiency, every other input at its point.")
    for r in results:
        implied = r["implied_inter_bandwidth_GBps"]
        text = "none in 0.05-50 GB/s" if implied is None else f"{implied:.2f} GB/s"
        print(f"  {r['label']}: {text} (the inputs' range: {r['inter_bandwidth_range']})")
    by = {r["label"]: r for r in results}
    small, large = by.get("Horovod, VGG-16, 128 GPUs"), by.get("Horovod, VGG-16, 512 GPUs")
    if small and large:
        fall_pub = small["published"] - large["published"]
        fall = small["point"] - large["point"]
        fall_serial = small["no_overlap"] - large["no_overlap"]
        print(f"\nVGG-16 from 128 to 512 GPUs: published fall {100 * fall_pub:.0f} points, model {100 * fall:.1f} "
              f"points: direction {'right' if fall > 0 else 'WRONG'}, size "
              f"{'within' if abs(fall - fall_pub) <= FALL_TOLERANCE else 'NOT within'} 5 points (no overlap: "
              f"{100 * fall_serial:.1f} points). The two figures "
              f"come from different software: 128 GPUs: {small['software']}; 512 GPUs: {large['software']}.")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps({"benchmark": "plan_vs_published", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
