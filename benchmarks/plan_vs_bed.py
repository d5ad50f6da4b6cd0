"""`hvrep plan` against measured runs on namespace hosts (hvrep netbed): sync fp32, fp16, PowerSGD, local SGD (root).

    python benchmarks/plan_vs_bed.py --out results/plan_vs_bed.jsonl     # 45 min here at load average 17-55
    python benchmarks/plan_vs_bed.py --hosts 2 --link-gbit 1 --repeats 3 --out "$(mktemp -d)/x.jsonl"   # smoke

One bed of 4 network namespaces (``hvrep.cluster.netbed``). For each host count N (2, 3, 4):

1. **Profile** (``kind: "profile"``): ``hvrep bench node`` on host h1 with N ranks (``horovodrun --gloo``, one
   TensorFlow thread per rank), the model the bed trains (small ResNet, width 64, 32 px, batch 8 per rank;
   4.9 MB of fp32 gradients in 29 tensors), all-reduces up to 1 MB over h1's loopback, unshaped. N ranks on
   this 2-core machine: the profile's step times are those of N ranks computing at once, the contention the
   N bed hosts meet, so **the profile carries the contended compute** (one profile per N); its all-reduce
   fit gives β, the per-collective cost of Horovod's Gloo path, measured off the bed's shaped links.
2. **Cluster** (:func:`bed_cluster`): one device per node (a bed host runs one rank), a flat ring, the
   network B_e = the tbf rate × 1448/1514 (a full TCP segment carries 1448 payload bytes in a 1514-byte
   frame with TCP timestamps, and tbf counts whole frames), hop latency 0 (no netem on this kernel; a veth
   adds microseconds), the link's burst tbf's bucket (``netbed.tbf_burst_bytes``) in payload bytes. No figure
   is taken from a bed run.
3. **Plan**: ``hvrep.perf.plan.predict`` for fp32, fp16, powersgd:4 and local:4 at N nodes.
4. **Bed** (``kind: "point"``): at each rate, one launch of ``_multihost_worker.py train --schemes`` with one
   rank per host: each scheme trained as a user trains it (``Replicator.wrap_optimizer``, hvrep's default
   25 MiB buckets), and in the same round-robin rounds the step with no reduction on every rank
   (``compute_s_concurrent``). Measured efficiency = compute_s_concurrent / step, the plan's definition
   (its efficiency is against N devices each computing with no reduction); local SGD's step is a timed
   call of H steps / H.

Each point: predicted and measured step time and efficiency, the step's relative error and the efficiency's
difference against the targets (±15%, ±0.1), and the plan's breakdown. The table goes to stdout; the JSON
lines are appended to ``--out``. Every bed is torn down on the way out (``NetBed``'s ``with``), also on a
failure; everything root writes is in a ``tempfile.mkdtemp`` folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import append_jsonl, comma_floats, comma_ints, comma_words
from _common import run_id as new_run_id

from hvrep.cluster import launch, netbed
from hvrep.perf import plan as planlib

WORKER = Path(__file__).resolve().with_name("_multihost_worker.py")
DEFAULT_HOSTS = (2, 3, 4)
DEFAULT_GBIT = (0.1, 0.5, 1.0)
DEFAULT_SCHEMES = ("fp32", "fp16", "powersgd:4", "local:4")
# A full TCP segment on the bed's veths (MTU 1500): 1448 payload bytes (1500 − 20 IPv4 − 32 TCP with
# timestamps) in a 1514-byte frame (+14 Ethernet), the length tbf charges. The rest of the rate is headers.
TCP_PAYLOAD_SHARE = 1448 / 1514
# The issue's targets for every bed point.
EFFICIENCY_TOLERANCE = 0.1
STEP_TOLERANCE = 0.15
# The bed's model: the one benchmarks/multihost.py trains (4.9 MB of fp32 gradients for ~70 ms of compute alone).
MODEL = {"width": 64, "batch": 8, "image_size": 32}


def bed_cluster(link_gbit: float) -> dict[str, Any]:
    """The cluster description of a bed at ``link_gbit`` (``hvrep plan --cluster``'s JSON).

    One device per node; the network's bus bandwidth is the TCP payload rate of the shaped link (tbf shapes
    each direction at the rate, a ring sends and receives at once), its burst tbf's bucket; no hop latency
    (no netem). ``intra`` is never used with one device per node; it is the same link, so min(B_i, B_e) is B_e.
    """
    if not link_gbit > 0:
        raise ValueError(f"link_gbit must be > 0, got {link_gbit}.")
    link = {"name": f"netbed tbf {link_gbit:g} Gbit/s, TCP payload",
            "bandwidth_GBps": link_gbit / 8 * TCP_PAYLOAD_SHARE, "latency_us": 0.0,
            "burst_bytes": netbed.tbf_burst_bytes(link_gbit) * TCP_PAYLOAD_SHARE}
    return {"devices_per_node": 1, "intra": dict(link), "inter": link, "inter_algorithm": "ring",
            "source": "tbf rate and burst x 1448/1514 (TCP payload per full frame); latency 0: the kernel has "
                      "no netem"}


def measured_point(scheme_case: Mapping[str, Any], compute_case: Mapping[str, Any]) -> dict[str, Any]:
    """A scheme's measured step (per training step) and efficiency against the concurrent no-reduction step."""
    per_call = int(scheme_case.get("steps_per_call", 1))
    rounds = [s / per_call for s in scheme_case["seconds"]]
    step = float(scheme_case["median_s"]) / per_call
    compute = float(compute_case["median_s"])
    return {"measured_step_s": step, "measured_step_s_rounds": rounds, "compute_s_concurrent": compute,
            "compute_s_concurrent_rounds": list(compute_case["seconds"]), "measured_efficiency": compute / step}


def compare(predicted_step_s: float, predicted_efficiency: float, measured_step_s: float,
            measured_efficiency: float) -> dict[str, Any]:
    """The prediction's errors and whether they meet the targets (±15% of the step, ±0.1 of efficiency)."""
    step_error = predicted_step_s / measured_step_s - 1
    eff_diff = predicted_efficiency - measured_efficiency
    return {"step_error": step_error, "efficiency_diff": eff_diff,
            "step_within": abs(step_error) <= STEP_TOLERANCE,
            "efficiency_within": abs(eff_diff) <= EFFICIENCY_TOLERANCE}


def predict_point(profile_json: Mapping[str, Any], link_gbit: float, scheme: str, hosts: int,
                  compute_s: float | None = None, cpu_terms: bool = True, burst: bool = True) -> dict[str, Any]:
    """``hvrep plan``'s row for one bed point.

    ``compute_s``: the contended compute time to plan with (the bed's no-reduction step, timed in the same
    rounds as the schemes), in place of the profile's forward + backward; the profile's split between the
    two is kept. The profile's other work on the ranks' cores, its codec and γ (the reduction's arithmetic),
    is scaled by the same factor: the load that stretched the compute between the profile and the bed
    stretches them alike. None: the profile's own. ``cpu_terms=False``: without the codec and γ (the model
    before they were added), to show what they change; ``burst=False``: the link without tbf's burst.
    """
    profile = planlib.Profile.from_dict(profile_json)
    if not cpu_terms:
        profile = dataclasses.replace(profile, codec_s={}, gamma_s_per_byte={})
    if compute_s is not None:
        scale = compute_s / profile.compute_s
        profile = dataclasses.replace(profile, forward_s=profile.forward_s * scale,
                                      backward_s=profile.backward_s * scale,
                                      codec_s={k: v * scale for k, v in profile.codec_s.items()},
                                      gamma_s_per_byte={k: v * scale for k, v in profile.gamma_s_per_byte.items()})
    description = bed_cluster(link_gbit)
    if not burst:
        description["inter"] = description["intra"] = {**description["inter"], "burst_bytes": 0.0}
    cluster = planlib.Cluster.from_dict(description)
    row = planlib.predict(profile, cluster, planlib.Scheme.parse(scheme), hosts)
    return {"predicted_step_s": row.step_s, "predicted_efficiency": row.efficiency, "plan": row.as_dict(),
            "plan_compute_s": profile.compute_s}


def format_table(points: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table: one row per (hosts, rate, scheme)."""
    lines = ["| hosts | Gbit/s | scheme | compute ms (profile / bed) | step ms predicted | measured | error | "
             "efficiency predicted | measured | diff | within | profile alone: step error, eff diff |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for p in points:
        ok = "yes" if p["step_within"] and p["efficiency_within"] else \
            "step " + ("yes" if p["step_within"] else "NO") + ", eff " + ("yes" if p["efficiency_within"] else "NO")
        alone = p["profile_alone"]
        lines.append(f"| {p['hosts']} | {p['link_gbit']:g} | {p['scheme']} | {1e3 * alone['plan_compute_s']:.0f} / "
                     f"{1e3 * p['compute_s_concurrent']:.0f} | {1e3 * p['predicted_step_s']:.0f} | "
                     f"{1e3 * p['measured_step_s']:.0f} | {100 * p['step_error']:+.0f}% | "
                     f"{p['predicted_efficiency']:.2f} | {p['measured_efficiency']:.2f} | "
                     f"{p['efficiency_diff']:+.2f} | {ok} | {100 * alone['step_error']:+.0f}%, "
                     f"{alone['efficiency_diff']:+.2f} |")
    return "\n".join(lines)


class _Bed:
    def __init__(self, args: argparse.Namespace, tmp: Path, bed: netbed.NetBed) -> None:
        self.args, self.tmp, self.bed, self.n = args, tmp, bed, 0

    def _env(self) -> dict[str, str]:
        env = self.bed.env()
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        # One TensorFlow thread per rank, as benchmarks/multihost.py: a rank per core is what efficiency assumes.
        env.update(TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
        return env

    def _run(self, argv: list[str], env: dict[str, str], out: Path) -> None:
        argv[0] = launch.find_launcher(argv[0], env)
        proc = self.bed.run_on("h1", argv, env=env, capture_output=True, text=True, timeout=self.args.launch_timeout)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"launch failed (exit {proc.returncode}): {' '.join(argv)}\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")

    def profile(self, ranks: int) -> dict[str, Any]:
        """``hvrep bench node`` with ``ranks`` ranks on h1 (its loopback; the shaped links unused)."""
        out = self.tmp / f"profile{ranks}.json"
        env = self._env()
        env.pop("HOROVOD_GLOO_IFACE", None)  # one host: horovodrun runs locally, on the loopback
        cmd = (sys.executable, "-m", "hvrep.cli", "bench", "node", "--width", str(MODEL["width"]),
               "--per-replica-batch", str(MODEL["batch"]), "--image-size", str(MODEL["image_size"]),
               "--max-bytes", str(self.args.profile_max_bytes), "--out", str(out))
        spec = launch.LaunchSpec(np=ranks, command=cmd, launcher="horovodrun")
        self._run(launch.build_argv(spec, env), env, out)
        return json.loads(out.read_text())

    def train(self, hosts: int, schemes: Sequence[str]) -> dict[str, Any]:
        out = self.tmp / f"launch{self.n}.json"
        self.n += 1
        cmd = (sys.executable, str(WORKER), "train", "--width", str(MODEL["width"]), "--batch", str(MODEL["batch"]),
               "--image-size", str(MODEL["image_size"]), "--thresholds", "", "--schemes", ",".join(schemes),
               "--warmup", str(self.args.warmup), "--repeats", str(self.args.repeats), "--out", str(out))
        env = self._env()
        spec = launch.LaunchSpec(np=hosts, command=cmd, hosts=tuple(f"{h}:1" for h in self.bed.hosts[:hosts]),
                                 launcher="horovodrun", extra=("--network-interface", netbed.IFACE))
        self._run(launch.build_argv(spec, env), env, out)
        return json.loads(out.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=comma_ints, default=list(DEFAULT_HOSTS), help="host counts, 2-4")
    p.add_argument("--link-gbit", type=comma_floats, default=list(DEFAULT_GBIT), help="link rates, Gbit/s")
    p.add_argument("--schemes", type=comma_words, default=list(DEFAULT_SCHEMES), help="fp32, fp16, powersgd:R, local:H")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per launch (median)")
    p.add_argument("--profile-max-bytes", type=int, default=1 << 20,
                   help="largest all-reduce of the profile (its β comes from the small ones)")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=Path("results/plan_vs_bed.jsonl"))
    args = p.parse_args(argv)
    if not args.hosts or min(args.hosts) < 2 or max(args.hosts) > 4:
        p.error(f"--hosts must be 2 to 4 (two cores shared by every host), got {args.hosts}.")
    for s in args.schemes:
        planlib.Scheme.parse(s)  # a ConfigError names a bad one
    reason = netbed.unavailable_reason()
    if reason is not None:
        print(f"benchmarks/plan_vs_bed.py: cannot build the bed: {reason}.", file=sys.stderr)
        return 2
    run_id = new_run_id()
    common = {"benchmark": "plan_vs_bed", "run_id": run_id, "launcher": "horovodrun --gloo", "model": MODEL}
    started = time.perf_counter()
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hvrep-planbed-") as tmp, \
            netbed.NetBed(hosts=max(args.hosts), link_gbit=None) as bed:
        runner = _Bed(args, Path(tmp), bed)
        print(f"plan_vs_bed: bed {bed.prefix}; hosts {args.hosts}, rates {args.link_gbit} Gbit/s, schemes "
              f"{args.schemes}; appending to {args.out}", flush=True)
        for hosts in args.hosts:
            bed.set_rate(None)
            t0 = time.perf_counter()
            prof = runner.profile(hosts)
            pi = prof["plan_inputs"]
            append_jsonl(args.out, [{**common, "kind": "profile", "hosts": hosts, "profile": prof,
                                     "seconds": time.perf_counter() - t0, "loadavg": list(os.getloadavg())}])
            print(f"  profile, {hosts} ranks on h1: forward {1e3 * pi['forward_s']:.0f} ms + backward "
                  f"{1e3 * pi['backward_s']:.0f} ms, beta {1e6 * pi['beta_s']:.0f} us "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            for rate in args.link_gbit:
                bed.set_rate(rate)
                t0 = time.perf_counter()
                result = runner.train(hosts, args.schemes)
                compute = next(c for c in result["cases"] if c["case"] == "compute")
                cluster = bed_cluster(rate)
                batch = []
                for case in (c for c in result["cases"] if c["case"] == "scheme"):
                    measured = measured_point(case, compute)
                    # The plan with the compute time measured under the same contention, in the same rounds (the
                    # targets' comparison), and with the profile's alone (taken minutes apart: the load drifts).
                    same = predict_point(prof, rate, case["scheme"], hosts, measured["compute_s_concurrent"])
                    alone = predict_point(prof, rate, case["scheme"], hosts)
                    before = predict_point(prof, rate, case["scheme"], hosts, measured["compute_s_concurrent"],
                                           cpu_terms=False)
                    before.update(compare(before["predicted_step_s"], before["predicted_efficiency"],
                                          measured["measured_step_s"], measured["measured_efficiency"]))
                    steady = predict_point(prof, rate, case["scheme"], hosts, measured["compute_s_concurrent"],
                                           burst=False)
                    steady.update(compare(steady["predicted_step_s"], steady["predicted_efficiency"],
                                          measured["measured_step_s"], measured["measured_efficiency"]))
                    alone.update(compare(alone["predicted_step_s"], alone["predicted_efficiency"],
                                         measured["measured_step_s"], measured["measured_efficiency"]))
                    point = {**common, "kind": "point", "hosts": hosts, "link_gbit": rate, "scheme": case["scheme"],
                             "collectives_traced": case["collectives"], "cluster": cluster, **measured, **same,
                             **compare(same["predicted_step_s"], same["predicted_efficiency"],
                                       measured["measured_step_s"], measured["measured_efficiency"]),
                             "profile_alone": alone, "without_cpu_terms": before, "without_burst": steady,
                             "loadavg": result["loadavg"],
                             "launch_s": time.perf_counter() - t0}
                    batch.append(point)
                append_jsonl(args.out, batch)
                points.extend(batch)
                print(format_table(batch).split("\n", 2)[2], flush=True)
    print(format_table(points))
    both = sum(1 for q in points if q["step_within"] and q["efficiency_within"])
    print(f"{both} of {len(points)} points within ±{STEP_TOLERANCE:.0%} of the step and ±{EFFICIENCY_TOLERANCE} of "
          f"the efficiency; {time.perf_counter() - started:.0f} s; appended to {args.out}")
    before = sum(1 for q in points if (w := q["without_cpu_terms"])["step_within"] and w["efficiency_within"])
    print(f"without the codec and γ (the plan before they were added), same compute: {before} of {len(points)}")
    steady = sum(1 for q in points if (w := q["without_burst"])["step_within"] and w["efficiency_within"])
    print(f"without tbf's burst (the link at its rate only), same compute: {steady} of {len(points)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
