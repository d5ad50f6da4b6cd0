"""``hvrep plan``: from one node's profile and a cluster description, the step time per scheme at each node count.

A MODEL, not a measurement. Every input comes from the profile (``hvrep bench node``, or written by hand
from published figures) or from the cluster description; nothing here is fitted to a scaling result. The
equations, with their sources, are in docs/planning.md:

* all-reduce of ``b`` bytes over ``N`` devices on ``M`` nodes of ``g`` (Thakur, Rabenseifner & Gropp 2005;
  Patarasuk & Yuan 2009)::

      flat ring      2M·α_e + (2(N−1) − 2M)·α_i + 2(N−1)/N · b / min(B_i, B_e)     (one node: α_i, B_i)
      hierarchical   2(g−1)·α_i + 2(g−1)/g · b / B_i                    reduce + broadcast in the node
                   + 2(M−1)·α_e + 2(M−1)/M · b / B_e                    ring between the nodes
      (halving-doubling between the nodes: 2·log2(M)·α_e instead of 2(M−1)·α_e)

  with B_e the node's achievable network bus bandwidth (all its NICs together: in a ring every node sends
  2(N−1)/N·b however many devices it has) and B_i the bus bandwidth between the node's devices;
* overlap of the reduction with the backward pass: gradients become ready in backward order (at times given
  by the profile's layers, or evenly over the backward pass); whenever the link is free, everything ready, up
  to the fusion threshold, goes as one collective (Horovod's Tensor Fusion; PyTorch DDP's buckets are the
  static form; hvrep's buckets are static too, each enqueued when complete and sent at the next cycle tick).
  Horovod 0.9-0.13 in a TF 1.x graph ("launch") fixed its fused groups when the gradients' kernels were
  launched, ahead of their data: static groups, each sent when its last gradient is ready, back to back with
  no tick between them. Exposed communication = when the last collective ends − when the backward pass ends;
* negotiation: β per collective (Horovod's coordination of which tensors are ready), not overlapped;
* the reduction's arithmetic (the γ term of Thakur et al.): each device sums (N−1)/N of a ring's bytes (in
  a hierarchical all-reduce (g−1)/g in the node and (M−1)/M of a 1/g shard between nodes); the profile's γ
  of a wire dtype is what that costs per byte beyond float32 (whose arithmetic the measured link already
  carries), e.g. float16 summed in software by Gloo on a CPU without half-precision arithmetic;
* the codec: what a device spends per step around the collectives in series with its compute (hvrep's
  packing of the buckets, fp16's casts, PowerSGD's products, orthogonalisation and error feedback), from the
  profile per scheme;
* a link's burst (``burst_bytes``: a token bucket that refills at the link's rate, as a shaped link's or a
  cloud instance's burstable bandwidth; 0 for a NIC): the bucket fills while the link idles between a step's
  collectives and the next step's, up to its size, and the bytes it holds go at once; the rest at the rate. A
  step's collectives draw on it in order, each device's link carrying the bandwidth term's bytes (2(N−1)/N·b in
  a ring); what the bucket holds at a step's start is min(burst, rate × the link's idle time per step), solved
  with the step it shortens;
* contention (``overlap_slowdown``, σ; 0 unless the profile gives it): while a collective runs beside the
  backward pass, the pass computes at 1/(1 + σ) of its speed, so the gradients after it are ready later and
  the pass ends later (Lee et al. 2025, arXiv:2507.03114, measure this slowdown for NCCL beside GPU kernels);
* input: the node's pipeline must deliver g·batch images per step; prefetching hides it behind the rest, so
  the step is max(compute + contention + codec + exposed communication + negotiation, g·batch / input images/s).

Left out: congestion and oversubscribed fabrics, stragglers, NCCL's tree algorithm, a codec or γ the profile
does not give (counted 0), and any change in the number of steps a scheme needs to reach an accuracy (local
SGD and PowerSGD change the optimisation; their time to train assumes the same epochs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvrep.errors import ConfigError, HvrepError
from hvrep.perf.costmodel import DEFAULT_BETA_TENSOR_S, PRESETS, Interconnect, payload_bytes

TOPOLOGIES = ("ring", "hierarchical")
INTER_ALGORITHMS = ("ring", "halving_doubling")
BUCKETINGS = ("dynamic", "static", "launch")
# hvrep's own fusion threshold (CommConfig.fusion_threshold_bytes): the default bucket when a profile names none.
DEFAULT_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024


def _positive(name: str, value: object, *, zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= 0 if zero else value > 0)
    if not ok:
        raise ConfigError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {value!r}.")
    return float(value)  # type: ignore[arg-type]


def _count(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


@dataclass(frozen=True)
class Profile:
    """One replica's step, as the plan needs it (seconds, bytes; per device unless said).

    Attributes:
      name: a label (the model).
      per_replica_batch: images per device per step.
      forward_s: the part of the step no reduction can hide behind: forward pass and optimizer update.
      backward_s: the backward pass, behind which the gradients' reduction may run.
      grad_bytes: S, the float32 gradients' bytes.
      tensors: the gradient tensors (collectives without fusion).
      layers: optional (bytes, backward seconds) per gradient in the order the backward pass produces
        them; without it, ``tensors`` equal gradients appear evenly over ``backward_s``.
      gradient_shapes: optional shapes of the gradients, needed for PowerSGD's payload.
      beta_s: β, the fixed cost of one collective (negotiation), seconds.
      fusion_threshold_bytes: the largest fused collective.
      bucketing: "dynamic" (Horovod's Tensor Fusion: whatever is ready when the link frees), "static"
        (hvrep's and PyTorch DDP's buckets: fixed groups of consecutive gradients, each sent when complete, at
        the next cycle tick), or "launch" (Horovod 0.9-0.13 in a TF 1.x graph: the ops are enqueued when the
        executor launches the gradients' kernels, ahead of the device computing them, so the coordinator
        fixes the fused groups (consecutive, up to the threshold) before their data exist; each group waits
        for its last gradient and they run back to back, no cycle tick between them).
      cycle_s: how often the library looks for ready gradients (Horovod's HOROVOD_CYCLE_TIME: 1 ms since 0.21,
        5 ms before): a collective starts only at a cycle's tick; 0 means at once.
      input_images_per_sec: the node's input pipeline, images/s, or None (not limiting).
      state_bytes: non-trainable float state local SGD averages with the weights (batch-norm statistics).
      gamma_s_per_byte: per wire dtype ("float16"), the seconds per byte a device's reduction arithmetic
        costs beyond float32's, charged on the bytes the device sums (γ of Thakur et al. 2005); absent: 0.
      codec_s: per scheme ("fp32", "fp16", "powersgd:R"), the seconds per step a device spends around its
        collectives in series with its compute (packing and unpacking the buckets, casts, PowerSGD's
        factors and error feedback); local SGD pays "fp32"'s on its synchronising steps; absent: 0.
      overlap_slowdown: σ, how much slower the backward pass computes while a collective runs beside it
        (the collective's kernels, copies or CPU threads share the device): 0.2 means 1.2 times as long. 0
        (the default) is a device the collectives do not touch; ``hvrep bench node`` measures it.
      source: where the figures came from (measured, or the publications).
    """

    name: str
    per_replica_batch: int
    forward_s: float
    backward_s: float
    grad_bytes: float
    tensors: int
    layers: tuple[tuple[float, float], ...] | None = None
    gradient_shapes: tuple[tuple[int, ...], ...] | None = None
    beta_s: float = DEFAULT_BETA_TENSOR_S
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES
    cycle_s: float = 1e-3
    bucketing: str = "dynamic"
    input_images_per_sec: float | None = None
    state_bytes: float = 0.0
    gamma_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    codec_s: Mapping[str, float] = field(default_factory=dict)
    overlap_slowdown: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        _count("per_replica_batch", self.per_replica_batch)
        _positive("forward_s", self.forward_s, zero=True)
        _positive("backward_s", self.backward_s)
        _positive("grad_bytes", self.grad_bytes)
        _count("tensors", self.tensors)
        _positive("beta_s", self.beta_s, zero=True)
        _count("fusion_threshold_bytes", self.fusion_threshold_bytes)
        _positive("state_bytes", self.state_bytes, zero=True)
        _positive("cycle_s", self.cycle_s, zero=True)
        _positive("overlap_slowdown", self.overlap_slowdown, zero=True)
        if self.bucketing not in BUCKETINGS:
            raise ConfigError(f"bucketing must be one of {', '.join(BUCKETINGS)}, got {self.bucketing!r}. Fix: "
                              "'static' for hvrep's buckets, 'dynamic' for Horovod's Tensor Fusion (docs/planning.md).")
        if self.input_images_per_sec is not None:
            _positive("input_images_per_sec", self.input_images_per_sec)
        for what, table in (("gamma_s_per_byte", self.gamma_s_per_byte), ("codec_s", self.codec_s)):
            if not isinstance(table, Mapping):
                raise ConfigError(f"{what} must be an object of name -> seconds, got {table!r}. Fix: e.g. "
                                  f'{{"float16": 8e-9}} (docs/planning.md).')
            for key, value in table.items():
                _positive(f"{what}[{key!r}]", value, zero=True)
        if self.layers is not None and not self.layers:
            raise ConfigError("layers is empty. Fix: list (bytes, backward seconds) per gradient, or leave it out.")

    @property
    def compute_s(self) -> float:
        """forward + backward (+ update): the step on one device with no reduction."""
        return self.forward_s + self.backward_s

    def ready(self, scale: float = 1.0) -> list[tuple[float, float]]:
        """(time the gradient is ready after the backward pass starts, its bytes × scale), in that order.

        The profile's layers' backward seconds are rescaled to add up to ``backward_s``.
        """
        if self.layers is None:
            step = self.backward_s / self.tensors
            size = self.grad_bytes / self.tensors * scale
            return [((i + 1) * step, size) for i in range(self.tensors)]
        total = sum(t for _, t in self.layers) or 1.0
        out, clock = [], 0.0
        for nbytes, seconds in self.layers:
            clock += seconds / total * self.backward_s
            out.append((clock, nbytes * scale))
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        """From a profile JSON: ``hvrep bench node``'s, or one written by hand (its ``plan_inputs`` object)."""
        src = d.get("plan_inputs", d)
        try:
            layers = src.get("layers")
            shapes = src.get("gradient_shapes")
            return cls(
                name=str(src.get("name", "model")), per_replica_batch=src["per_replica_batch"],
                forward_s=src["forward_s"], backward_s=src["backward_s"], grad_bytes=src["grad_bytes"],
                tensors=src["tensors"],
                layers=None if layers is None else tuple((float(b), float(t)) for b, t in layers),
                gradient_shapes=None if shapes is None else tuple(tuple(int(x) for x in s) for s in shapes),
                beta_s=src.get("beta_s", DEFAULT_BETA_TENSOR_S),
                fusion_threshold_bytes=src.get("fusion_threshold_bytes", DEFAULT_FUSION_THRESHOLD_BYTES),
                cycle_s=src.get("cycle_s", 1e-3), bucketing=src.get("bucketing", "dynamic"),
                input_images_per_sec=src.get("input_images_per_sec"), state_bytes=src.get("state_bytes", 0.0),
                gamma_s_per_byte=src.get("gamma_s_per_byte") or {}, codec_s=src.get("codec_s") or {},
                overlap_slowdown=src.get("overlap_slowdown", 0.0), source=str(src.get("source", "")))
        except KeyError as e:
            raise ConfigError(f"the profile has no {e.args[0]!r}. Fix: write it with `hvrep bench node`, or add "
                              f"it by hand (docs/planning.md lists the fields).") from None


def _link(name: str, value: object) -> Interconnect:
    if isinstance(value, str):
        if value.lower() not in PRESETS:
            raise ConfigError(f"cluster {name} {value!r} is not a preset. Fix: use one of {', '.join(PRESETS)} or "
                              '{"bandwidth_GBps": B, "latency_us": A}.')
        return PRESETS[value.lower()]
    if not isinstance(value, Mapping) or "bandwidth_GBps" not in value or "latency_us" not in value:
        raise ConfigError(f'cluster {name} must be a preset name or {{"bandwidth_GBps": B, "latency_us": A}} '
                          f'(and optionally "burst_bytes"), got {value!r}.')
    return Interconnect(str(value.get("name", name)), value["bandwidth_GBps"], value["latency_us"],
                        value.get("burst_bytes", 0.0))


@dataclass(frozen=True)
class Cluster:
    """The machines to plan for.

    Attributes:
      devices_per_node: g, devices (GPUs, or CPU ranks) per node.
      intra: the link between a node's devices: B_i (all-reduce bus bandwidth, GB/s), α_i (µs per hop).
      inter: the network: B_e (the node's achievable all-reduce bus bandwidth over all its NICs, GB/s),
        α_e (µs per hop).
      inter_algorithm: "ring", or "halving_doubling" (recursive halving and doubling: 2·log2(M) latency
        steps; Thakur et al. 2005), for the hierarchical scheme's step between nodes.
    """

    devices_per_node: int
    intra: Interconnect
    inter: Interconnect
    inter_algorithm: str = "ring"

    def __post_init__(self) -> None:
        _count("devices_per_node", self.devices_per_node)
        if self.inter_algorithm not in INTER_ALGORITHMS:
            raise ConfigError(f"inter_algorithm must be one of {INTER_ALGORITHMS}, got {self.inter_algorithm!r}.")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        for key in ("devices_per_node", "intra", "inter"):
            if key not in d:
                raise ConfigError(f"the cluster description has no {key!r}. Fix: see docs/planning.md, e.g. "
                                  '{"devices_per_node": 8, "intra": "nvlink", "inter": "ndr"}.')
        return cls(d["devices_per_node"], _link("intra", d["intra"]), _link("inter", d["inter"]),
                   d.get("inter_algorithm", "ring"))


def allreduce_s(nbytes: float, nodes: int, cluster: Cluster, topology: str = "ring") -> float:
    """Seconds of one all-reduce of ``nbytes`` over ``nodes`` × g devices, β excluded (see the module doc)."""
    if topology not in TOPOLOGIES:
        raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {topology!r}.")
    _count("nodes", nodes)
    _positive("nbytes", nbytes, zero=True)
    g, m = cluster.devices_per_node, nodes
    n = g * m
    if n == 1:
        return 0.0
    bi, be = cluster.intra.bus_bandwidth_Bps, cluster.inter.bus_bandwidth_Bps
    ai, ae = cluster.intra.latency_s, cluster.inter.latency_s
    if m == 1:
        return 2 * (g - 1) * ai + 2 * (g - 1) / g * nbytes / bi
    if topology == "ring":
        # A pipelined ring pays each hop's own latency: of its 2(N−1) steps, 2M cross the network (NCCL's
        # tuning model, src/graph/tuning.cc, counts them so), the rest stay in a node. Its bandwidth is its
        # slowest link's.
        inter_steps = 2 * m if g > 1 else 2 * (n - 1)
        return (2 * (n - 1) - inter_steps) * ai + inter_steps * ae + 2 * (n - 1) / n * nbytes / min(bi, be)
    intra = 2 * (g - 1) * ai + 2 * (g - 1) / g * nbytes / bi if g > 1 else 0.0
    hops = 2 * math.ceil(math.log2(m)) if cluster.inter_algorithm == "halving_doubling" else 2 * (m - 1)
    return intra + hops * ae + 2 * (m - 1) / m * nbytes / be


def link_bytes(nbytes: float, nodes: int, cluster: Cluster, topology: str = "ring") -> list[tuple[str, float]]:
    """The bandwidth terms of :func:`allreduce_s`: ("intra" or "inter", the bytes each device's link carries at
    that link's rate) for one all-reduce of ``nbytes``."""
    g, m = cluster.devices_per_node, nodes
    n = g * m
    if n == 1:
        return []
    if m == 1:
        return [("intra", 2 * (g - 1) / g * nbytes)]
    if topology == "ring":  # its slowest link sets the rate
        slow = "inter" if cluster.inter.bus_bandwidth_Bps <= cluster.intra.bus_bandwidth_Bps else "intra"
        return [(slow, 2 * (n - 1) / n * nbytes)]
    return ([("intra", 2 * (g - 1) / g * nbytes)] if g > 1 else []) + [("inter", 2 * (m - 1) / m * nbytes)]


def reduced_share(nodes: int, cluster: Cluster, topology: str = "ring") -> float:
    """The share of an all-reduce's bytes each device sums (the γ term's; a reduce-scatter's sums, Thakur et al.
    2005): (N−1)/N in a ring; in the hierarchical all-reduce (g−1)/g in the node, then (M−1)/M of its 1/g shard
    between the nodes (each of a node's devices reduces one shard across the nodes, as Horovod's hierarchical
    all-reduce and NCCL's do)."""
    g, m = cluster.devices_per_node, nodes
    n = g * m
    if n == 1:
        return 0.0
    if topology == "ring" or m == 1:
        return (n - 1) / n
    return (g - 1) / g + (m - 1) / m / g


@dataclass(frozen=True)
class Overlap:
    """The reduction's timeline over one backward pass (seconds from its start)."""

    collectives: int
    busy_s: float  # the link's time, all collectives together
    end_s: float  # when the last collective ends
    exposed_s: float  # max(0, end − the backward pass's end)
    stretch_s: float = 0.0  # how much longer the backward pass took for the collectives beside it (contention)


def overlap(ready: Sequence[tuple[float, float]], backward_s: float, collective_s: Callable[[float], float],
            threshold_bytes: float, *, after_backward: bool = False, cycle_s: float = 0.0,
            static: bool = False, slowdown: float = 0.0) -> Overlap:
    """When the reduction of gradients ready at ``ready`` (time, bytes) ends, fused as Horovod fuses.

    At the first cycle tick (a multiple of ``cycle_s``; 0: at once) at which the link is free and a
    gradient is ready, every gradient ready by then (in order, up to ``threshold_bytes``, at least one) goes
    as one collective of ``collective_s(bytes)`` seconds. ``static``: the buckets are fixed beforehand
    instead (consecutive gradients up to ``threshold_bytes``, as hvrep's ``fusion_threshold_bytes`` and
    PyTorch DDP pack them), each ready with its last gradient and sent alone. ``after_backward`` makes every
    gradient ready at the end of the backward pass (no overlap).

    ``slowdown`` (σ): while a collective runs, the backward pass computes at 1/(1 + σ) of its speed (the
    collective's kernels and copies share the device). ``ready``'s times are then the backward pass's own
    compute time; each gradient's wall-clock time follows the collectives placed before it, and the pass ends
    ``stretch_s`` later than ``backward_s``. A collective starts no earlier than the link frees, so the spans
    before a gradient are all known when its time is needed.
    """
    spans: list[tuple[float, float]] = []  # the collectives so far, (start, end), in order, not overlapping

    def wall(work: float) -> float:
        """When the backward pass has computed ``work`` seconds of itself, given the collectives so far."""
        clock = done = 0.0
        for begin, end in spans if slowdown > 0 else ():
            if done + (begin - clock) >= work:
                break
            done += begin - clock
            inside = (end - begin) / (1.0 + slowdown)
            if done + inside >= work:
                return begin + (work - done) * (1.0 + slowdown)
            done, clock = done + inside, end
        return clock + (work - done)

    items = [(backward_s if after_backward else t, b) for t, b in ready]
    if static:
        buckets: list[tuple[float, float]] = []
        for t, b in items:
            if buckets and buckets[-1][1] + b <= threshold_bytes:
                buckets[-1] = (t, buckets[-1][1] + b)
            else:
                buckets.append((t, b))
        items, threshold_bytes = buckets, 0.0
    free, busy, k, i = 0.0, 0.0, 0, 0
    while i < len(items):
        start = max(free, wall(items[i][0]))
        if cycle_s > 0:
            start = math.ceil(start / cycle_s - 1e-9) * cycle_s
        size, j = 0.0, i
        while j < len(items) and wall(items[j][0]) <= start and (j == i or size + items[j][1] <= threshold_bytes):
            size += items[j][1]
            j += 1
        seconds = collective_s(size)
        spans.append((start, start + seconds))
        free, busy, k, i = start + seconds, busy + seconds, k + 1, j
    end = wall(backward_s)
    return Overlap(k, busy, free, max(0.0, free - end), end - backward_s)


@dataclass(frozen=True)
class Scheme:
    """A communication setting: ``fp32``, ``fp16``, ``powersgd:R``, ``local:H``, each on a ring or two levels."""

    compression: str = "fp32"  # fp32, fp16, powersgd, local
    rank: int = 0  # PowerSGD's r
    local_steps: int = 1  # local SGD's H
    topology: str = "ring"

    @property
    def name(self) -> str:
        base = {"powersgd": f"powersgd r{self.rank}", "local": f"local H={self.local_steps}"}.get(
            self.compression, self.compression)
        return f"{base}, {'flat ring' if self.topology == 'ring' else 'hierarchical'}"

    @classmethod
    def parse(cls, text: str, topology: str = "ring") -> Scheme:
        kind, _, arg = text.strip().partition(":")
        if topology not in TOPOLOGIES:
            raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {topology!r}.")
        if kind in ("fp32", "fp16") and not arg:
            return cls(kind, topology=topology)
        if kind in ("powersgd", "local") and arg.isdigit() and int(arg) >= 1:
            return cls(kind, rank=int(arg), topology=topology) if kind == "powersgd" else \
                cls(kind, local_steps=int(arg), topology=topology)
        raise ConfigError(f"scheme {text!r} is not one of fp32, fp16, powersgd:R, local:H (R, H >= 1). "
                          "Fix: e.g. --schemes fp32,fp16,powersgd:4,local:16.")


@dataclass(frozen=True)
class StepPrediction:
    """The model's step at one node count, seconds unless said; images/s for the whole job."""

    scheme: str
    nodes: int
    devices: int
    compute_s: float
    exposed_communication_s: float
    negotiation_s: float
    input_stall_s: float
    communication_s: float  # the link's busy time per step (hidden or not)
    collectives: float  # per step (local SGD: averaged over H)
    step_s: float
    images_per_sec: float
    efficiency: float  # images/s ÷ (devices × one device's images/s with no reduction)
    time_to_train_s: float | None = None
    codec_s: float = 0.0  # per step, in series with the compute (local SGD: averaged over H)
    contention_s: float = 0.0  # the backward pass's stretch by the collectives beside it (overlap_slowdown)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _codec_key(scheme: Scheme) -> str:
    """The profile's codec_s entry a scheme pays (local SGD's synchronisation goes through the fp32 buckets)."""
    return {"powersgd": f"powersgd:{scheme.rank}", "local": "fp32"}.get(scheme.compression, scheme.compression)


def predict(profile: Profile, cluster: Cluster, scheme: Scheme, nodes: int, *, overlap_backward: bool = True,
            epochs: float | None = None, images: int | None = None) -> StepPrediction:
    """The step of ``scheme`` on ``nodes`` nodes (see the module doc for the equations)."""
    _count("nodes", nodes)
    devices = nodes * cluster.devices_per_node

    # γ: the reduction's arithmetic beyond float32's, for the wire dtype (only fp16 sends anything but float32).
    gamma = profile.gamma_s_per_byte.get("float16", 0.0) if scheme.compression == "fp16" else 0.0
    share = reduced_share(nodes, cluster, scheme.topology)

    links = {"intra": cluster.intra, "inter": cluster.inter}
    bursty = devices > 1 and any(link.burst_bytes > 0 for link in links.values())
    tokens = {name: link.burst_bytes for name, link in links.items()}  # the buckets' levels, drawn in order

    def one(nbytes: float) -> float:
        seconds = allreduce_s(nbytes, nodes, cluster, scheme.topology) + share * nbytes * gamma
        for name, sent in link_bytes(nbytes, nodes, cluster, scheme.topology) if bursty else ():
            burst = min(tokens[name], sent)  # these bytes go at once instead of at the rate
            tokens[name] -= burst
            seconds -= burst / links[name].bus_bandwidth_Bps
        return seconds

    # The buckets start a step as full as the link's idle time since the last step refilled them; that
    # time depends on the step, so the two are solved together (a few rounds: the burst is one term).
    level = {name: link.burst_bytes for name, link in links.items()}
    for _ in range(8 if bursty else 1):
        tokens.update(level)
        comm, per, step, stall, codec = _communicate(profile, scheme, devices, cluster.devices_per_node, one,
                                                     overlap_backward)
        idle = max(0.0, step / per - comm.busy_s)  # per synchronisation: local SGD's idles H steps
        new = {name: min(link.burst_bytes, link.bus_bandwidth_Bps * idle) for name, link in links.items()}
        if all(abs(new[k] - level[k]) < 1.0 for k in level):
            break
        level = new
    return _prediction(profile, cluster, scheme, nodes, devices, comm, per, stall, step, codec, epochs, images)


def _communicate(profile: Profile, scheme: Scheme, devices: int, devices_per_node: int,
                 one: Callable[[float], float], overlap_backward: bool) -> tuple[Overlap, float, float, float, float]:
    """One step's reduction: (its overlap, 1/H, the step's seconds, the input stall, the codec)."""
    threshold = profile.fusion_threshold_bytes
    if devices == 1:
        comm = Overlap(0, 0.0, profile.backward_s, 0.0)
        per = 1.0
    elif scheme.compression in ("fp32", "fp16"):
        scale = 0.5 if scheme.compression == "fp16" else 1.0
        # "launch": the groups were negotiated when the kernels were launched, so no cycle tick delays them.
        comm = overlap(profile.ready(scale), profile.backward_s, one, threshold, after_backward=not overlap_backward,
                       cycle_s=0.0 if profile.bucketing == "launch" else profile.cycle_s,
                       static=profile.bucketing != "dynamic", slowdown=profile.overlap_slowdown)
        per = 1.0
    elif scheme.compression == "powersgd":
        if profile.gradient_shapes is None:
            raise ConfigError("powersgd needs the profile's gradient_shapes (its payload depends on them). Fix: "
                              "profile with `hvrep bench node`, or add them by hand.")
        # After the backward pass (the factors need the whole gradient), in two rounds: P, then Q and the
        # uncompressed gradients; each round one fused collective per threshold.
        payload = payload_bytes(profile.gradient_shapes, "powersgd", powersgd_rank=scheme.rank)
        half = [(profile.backward_s, payload / 2)]
        first = overlap(half, profile.backward_s, one, threshold, after_backward=True)
        second = overlap(half, profile.backward_s, one, threshold, after_backward=True)
        comm = Overlap(first.collectives + second.collectives, first.busy_s + second.busy_s,
                       profile.backward_s + first.busy_s + second.busy_s, first.busy_s + second.busy_s)
        per = 1.0
    else:  # local SGD: the weights and state, every H-th step, after it
        sync = [(profile.backward_s, profile.grad_bytes + profile.state_bytes)]
        comm = overlap(sync, profile.backward_s, one, threshold, after_backward=True)
        per = 1.0 / scheme.local_steps
    codec = 0.0 if devices == 1 else profile.codec_s.get(_codec_key(scheme), 0.0) * per
    inner = profile.compute_s + codec + (comm.stretch_s + comm.exposed_s + comm.collectives * profile.beta_s) * per
    stall = 0.0
    if profile.input_images_per_sec is not None:
        need = devices_per_node * profile.per_replica_batch / profile.input_images_per_sec
        stall = max(0.0, need - inner)
    return comm, per, inner + stall, stall, codec


def _prediction(profile: Profile, cluster: Cluster, scheme: Scheme, nodes: int, devices: int, comm: Overlap,
                per: float, stall: float, step: float, codec: float, epochs: float | None,
                images: int | None) -> StepPrediction:
    exposed = comm.exposed_s * per
    negotiation = comm.collectives * profile.beta_s * per
    busy = comm.busy_s * per
    compute = profile.compute_s
    ips = devices * profile.per_replica_batch / step
    single = profile.per_replica_batch / compute
    if profile.input_images_per_sec is not None:
        single = min(single, profile.input_images_per_sec)
    ttt = None
    if epochs is not None and images is not None:
        steps = math.ceil(epochs * images / (devices * profile.per_replica_batch))
        ttt = steps * step
    return StepPrediction(scheme.name, nodes, devices, compute, exposed, negotiation, stall, busy,
                          comm.collectives * per, step, ips, ips / (devices * single), ttt, codec,
                          comm.stretch_s * per)


def plan(profile: Profile, cluster: Cluster, schemes: Iterable[Scheme], nodes: Iterable[int], *,
         overlap_backward: bool = True, epochs: float | None = None,
         images: int | None = None) -> list[StepPrediction]:
    """Every scheme at every node count, scheme by scheme."""
    node_list = list(nodes)
    return [predict(profile, cluster, s, m, overlap_backward=overlap_backward, epochs=epochs, images=images)
            for s in schemes for m in node_list]


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def format_table(rows: Sequence[StepPrediction]) -> str:
    """A Markdown table: one row per (scheme, nodes); a "contention" column where the profile has σ."""
    contended = any(r.contention_s > 0 for r in rows)
    lines = ["| scheme | nodes | devices | step ms | compute | " + ("contention | " if contended else "") +
             "codec | exposed comm | negotiation | input stall | images/s | efficiency | time to train |",
             "|---|---:|---:|---:|---:|" + ("---:|" if contended else "") + "---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.scheme} | {r.nodes} | {r.devices} | {1e3 * r.step_s:.1f} | {1e3 * r.compute_s:.1f} | " +
                     (f"{1e3 * r.contention_s:.1f} | " if contended else "") +
                     f"{1e3 * r.codec_s:.1f} | {1e3 * r.exposed_communication_s:.1f} | {1e3 * r.negotiation_s:.2f} | "
                     f"{1e3 * r.input_stall_s:.1f} | {r.images_per_sec:,.0f} | {100 * r.efficiency:.1f}% | "
                     f"{_hours(r.time_to_train_s)} |")
    return "\n".join(lines)


def plot(rows: Sequence[StepPrediction], path: str | Path, title: str = "") -> Path:
    """Efficiency against nodes, one line per scheme (matplotlib, Agg: no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, scheme in enumerate(dict.fromkeys(r.scheme for r in rows)):
        mine = [r for r in rows if r.scheme == scheme]
        ax.plot([r.nodes for r in mine], [100 * r.efficiency for r in mine], marker="o",
                linestyle="--" if "hierarchical" in scheme else "-", color=f"C{i // 2 % 10}", label=scheme)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("scaling efficiency, % (model)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or "hvrep plan: predicted scaling efficiency")
    ax.legend(fontsize=7)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist. Fix: give the path of a JSON file.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path} is not JSON ({e.msg}, line {e.lineno}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object.")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvrep plan", description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a profile JSON (`hvrep bench node --out`, or written by hand)")
    parser.add_argument("--cluster", required=True, help='a cluster JSON: devices_per_node, intra, inter ("intra": '
                        '"profile" takes the link `hvrep bench node` measured)')
    parser.add_argument("--nodes", default="1,2,4,8,16,32", help="comma-separated node counts")
    parser.add_argument("--schemes", default="fp32,fp16,powersgd:4,local:16",
                        help="comma-separated: fp32, fp16, powersgd:R, local:H")
    parser.add_argument("--topology", default="ring,hierarchical", help="ring, hierarchical, or both")
    parser.add_argument("--no-overlap", action="store_true",
                        help="reduce after the whole backward pass (no overlap with it)")
    parser.add_argument("--epochs", type=float, default=None, help="with --images: time to train")
    parser.add_argument("--images", type=int, default=None, help="images in one epoch")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write efficiency against nodes here")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    args = parser.parse_args(argv)
    try:
        profile_json = _read_json(args.profile, "profile")
        profile = Profile.from_dict(profile_json)
        cluster_json = _read_json(args.cluster, "cluster")
        if cluster_json.get("intra") == "profile":  # the link `hvrep bench node` measured between the node's ranks
            if not profile_json.get("intra_node_link"):
                raise ConfigError(f'the cluster\'s intra is "profile" but {args.profile} has no intra_node_link (a '
                                  "1-rank profile). Fix: profile under the launcher with every device of the node, "
                                  'or give {"bandwidth_GBps": B, "latency_us": A}.')
            cluster_json = {**cluster_json, "intra": profile_json["intra_node_link"]}
        cluster = Cluster.from_dict(cluster_json)
        try:
            nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
        except ValueError:
            raise ConfigError(f"--nodes must be comma-separated whole numbers, got {args.nodes!r}.") from None
        topologies = [t.strip() for t in args.topology.split(",") if t.strip()]
        schemes = [Scheme.parse(s, t) for s in args.schemes.split(",") if s.strip() for t in topologies]
        if (args.epochs is None) != (args.images is None):
            raise ConfigError("--epochs and --images go together. Fix: give both, e.g. --epochs 90 --images 1281167.")
        rows = plan(profile, cluster, schemes, nodes, overlap_backward=not args.no_overlap, epochs=args.epochs,
                    images=args.images)
    except HvrepError as e:
        print(f"hvrep plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(f"hvrep plan: {profile.name}, batch {profile.per_replica_batch} per device, {cluster.devices_per_node} "
              f"device(s) per node; intra {cluster.intra.bus_bandwidth_GBps:g} GB/s {cluster.intra.latency_us:g} µs, "
              f"inter {cluster.inter.bus_bandwidth_GBps:g} GB/s {cluster.inter.latency_us:g} µs. A model, not a "
              "measurement (docs/planning.md).")
        print(format_table(rows))
        keys = dict.fromkeys(_codec_key(s) for s in schemes)
        missing = [k for k in keys if k not in profile.codec_s]
        if missing:
            print(f"codec: not in the profile for {', '.join(missing)}: counted 0 (`hvrep bench node` measures it).")
        if "fp16" in keys and "float16" not in profile.gamma_s_per_byte:
            print("fp16: the profile gives no γ for float16: its reduction's arithmetic is taken as float32's.")
    if args.plot:
        print(f"plot: {plot(rows, args.plot, f'hvrep plan: {profile.name}')}")
    return 0


__all__ = ["Cluster", "Overlap", "Profile", "Scheme", "StepPrediction", "allreduce_s", "format_table", "main",
           "overlap", "plan", "plot", "predict", "reduced_share"]
