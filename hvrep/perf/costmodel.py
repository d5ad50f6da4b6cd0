"""A MODEL, not a measurement: the α-β cost of ring all-reduce and the scaling efficiency it predicts.

One data-parallel step computes for ``compute`` seconds, then all-reduces
``S`` bytes of gradients over ``N`` GPUs. A bandwidth-optimal ring
(reduce-scatter, then all-gather) takes 2(N−1) steps, each moving S/N bytes
per GPU over its link, and the library pays a fixed cost per collective::

    time(N, S) = 2(N−1)·α + 2(N−1)/N · S/B + k·β_tensor

    α         per-hop latency, s (one ring step)
    B         bus bandwidth per GPU link, bytes/s (what nccl-tests calls "busbw")
    S         bytes all-reduced per step (the gradients)
    k         collectives per step: one per tensor unfused (161 for ResNet-50),
              one per fusion bucket fused (1 at hvrep's 128 MiB threshold)
    β_tensor  fixed cost of one collective (launch, negotiation, bookkeeping);
              the per-tensor overhead that tensor fusion removes

The formula is the textbook one (Thakur, Rabenseifner & Gropp 2005; Patarasuk
& Yuan 2009) with α counted once per step: the extra hop latency of each
additional collective is folded into β_tensor. One rank communicates nothing
(time 0). Efficiency against perfect linear scaling is::

    efficiency = compute / (compute + exposed communication)
    exposed    = communication − min(overlap · communication, compute)

where ``overlap`` is the fraction of the communication hidden behind the
backward pass (0: none, as in a step that reduces after the whole backward).

The two-level variant (``gpus_per_node``) is the hierarchical all-reduce:
a reduce-scatter on the intra-node link (NVLink), a ring all-reduce of each
GPU's 1/g shard across the M nodes on the network, then an all-gather on the
intra-node link. It assumes each GPU has its own NIC (DGX H100: 8 × NDR, one per
GPU); where g GPUs share one NIC, pass an Interconnect with B/g.

What the model leaves out: congestion and topology (fat-tree oversubscription,
rail alignment), NCCL's tree and NVLS algorithms, stragglers, input-pipeline
stalls, and the optimizer step. Calibrate α, β_tensor and B on measured
all-reduce times (``calibrate``) before trusting its numbers on a cluster.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from hvrep.errors import ConfigError
from hvrep.replica.comm import powersgd_matrix

_GB = 1e9  # the presets are decimal GB/s, as link rates are quoted


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}.")


def _check_bytes(nbytes: object) -> None:
    if not _is_real(nbytes) or not 0 <= nbytes < math.inf:  # type: ignore[operator]
        raise ConfigError(f"bytes must be a finite number >= 0, got {nbytes!r}.")


def _check_beta(beta_tensor_s: object) -> None:
    if not _is_real(beta_tensor_s) or not 0 <= beta_tensor_s < math.inf:  # type: ignore[operator]
        raise ConfigError(f"beta_tensor_s must be a finite number of seconds >= 0, got {beta_tensor_s!r}.")


@dataclass(frozen=True)
class Interconnect:
    """One kind of link between GPUs, as the cost model sees it.

    Attributes:
      name: a label for reports.
      bus_bandwidth_GBps: B, the achievable all-reduce bus bandwidth per GPU
        link, in GB/s (1e9 bytes/s), not the marketing line rate.
      latency_us: α, the latency of one ring hop, in microseconds.
      burst_bytes: bytes the link lets through above its rate after idling: a token bucket of this size
        that refills at the rate (a shaped link, Linux tc tbf's burst; a cloud instance's burstable
        network bandwidth). 0, a NIC's line rate, has none. Only ``hvrep plan`` uses it.
    """

    name: str
    bus_bandwidth_GBps: float
    latency_us: float
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("Interconnect.name is empty. Fix: give it a label, e.g. 'NDR InfiniBand'.")
        if not _is_real(self.bus_bandwidth_GBps) or not 0 < self.bus_bandwidth_GBps < math.inf:
            raise ConfigError(f"Interconnect {self.name!r}: bus_bandwidth_GBps must be a finite number > 0, "
                              f"got {self.bus_bandwidth_GBps!r}.")
        if not _is_real(self.latency_us) or not 0 <= self.latency_us < math.inf:
            raise ConfigError(f"Interconnect {self.name!r}: latency_us must be a finite number >= 0, "
                              f"got {self.latency_us!r}.")
        if not _is_real(self.burst_bytes) or not 0 <= self.burst_bytes < math.inf:
            raise ConfigError(f"Interconnect {self.name!r}: burst_bytes must be a finite number >= 0, "
                              f"got {self.burst_bytes!r}.")

    @property
    def bus_bandwidth_Bps(self) -> float:
        """B in bytes/s."""
        return self.bus_bandwidth_GBps * _GB

    @property
    def latency_s(self) -> float:
        """α in seconds."""
        return self.latency_us * 1e-6


# Presets: achievable bus bandwidth per GPU link. Line rates are the vendors'
# (Gb/s of payload signalling); "achievable" is what an all-reduce's bus
# bandwidth reaches in practice, assumed here, not measured by hvrep. The
# latencies are assumed orders of magnitude for one NCCL ring hop; calibrate
# both on your cluster.
#
# NVLink 4 (H100 SXM5 behind NVSwitch): NVIDIA quotes 900 GB/s per GPU, both
# directions together, i.e. 450 GB/s each way; nccl-tests all_reduce_perf on
# 8 × H100 SXM reports a bus bandwidth of roughly 360-380 GB/s for large
# messages, so 370 GB/s (~82% of 450). Intra-node only (a flat ring over more
# than 8 GPUs on NVLink needs an NVLink Switch system). α ≈ 2 µs: assumed.
NVLINK = Interconnect("NVLink 4 (H100 SXM, NVSwitch), intra-node", 370.0, 2.0)
# NDR InfiniBand: 400 Gb/s per port = 50 GB/s line rate; ~92% of it after
# encoding and protocol overheads, 46 GB/s, with one NIC per GPU (DGX H100
# has 8 ConnectX-7). α ≈ 5 µs: assumed (IB hardware latency ~1 µs plus the
# NCCL proxy and GPU-NIC hops).
NDR_INFINIBAND = Interconnect("NDR InfiniBand (400 Gb/s, one NIC per GPU)", 46.0, 5.0)
# 100 GbE: 100 Gb/s = 12.5 GB/s line rate; ~88% achievable with RoCE, 11 GB/s.
# α ≈ 10 µs: assumed for RoCE; kernel TCP (e.g. Gloo) is several times slower.
ETHERNET_100G = Interconnect("100 GbE (RoCE)", 11.0, 10.0)
# 25 GbE: 25 Gb/s = 3.125 GB/s line rate; ~90% achievable, 2.8 GB/s. The
# network of the Horovod benchmark below (RoCE-capable 25 Gbit/s). α as 100 GbE.
ETHERNET_25G = Interconnect("25 GbE (RoCE)", 2.8, 10.0)

PRESETS: Mapping[str, Interconnect] = MappingProxyType({
    "nvlink": NVLINK,
    "ndr": NDR_INFINIBAND,
    "100gbe": ETHERNET_100G,
    "25gbe": ETHERNET_25G,
})

# β_tensor when nothing was calibrated: an assumed 20 µs per collective, the
# order of a NCCL kernel launch plus Horovod's per-tensor negotiation. An
# assumption to replace with ``calibrate``, not a published figure.
DEFAULT_BETA_TENSOR_S = 20e-6

# ResNet-50's gradients: hvrep.models.resnet50_variable_shapes() lists 161
# trainable variables holding 25,557,032 parameters (1000 classes), so one
# fp32 all-reduce moves 102,228,128 bytes.
RESNET50_TENSORS = 161
RESNET50_GRAD_BYTES = 25_557_032 * 4

# GPU compute time per step, from a PUBLISHED figure: MLPerf Training, 8 × H100
# SXM, ResNet-50 v1.5, approximately 7,160 images/s per GPU. MLPerf publishes
# time to train, not images/s, so the rate is derived from it and approximate
# (not re-derived from the results table here). At a per-GPU batch of 256
# a step takes 256 / 7160 ≈ 35.8 ms. It already includes MLPerf's own
# communication on 8 GPUs (NVLink), so using it as pure compute slightly
# flatters the model.
MLPERF_H100_RESNET50_IMAGES_PER_SEC_PER_GPU = 7160.0
MLPERF_H100_RESNET50_BATCH_PER_GPU = 256
H100_RESNET50_COMPUTE_S = MLPERF_H100_RESNET50_BATCH_PER_GPU / MLPERF_H100_RESNET50_IMAGES_PER_SEC_PER_GPU


@dataclass(frozen=True)
class PublishedPoint:
    """A published scaling result, to show next to the model (other hardware; orientation, not a check).

    Attributes:
      label: a short name for tables.
      source: who published it, and where.
      hardware: GPUs and network as published.
      workload: the model(s) trained.
      gpus: GPUs in the largest run.
      efficiency: scaling efficiency (0-1) as published, or None where the
        source gives a throughput instead.
      images_per_sec_per_gpu: throughput per GPU, where that is what was published.
      note: how exact the number is, and its baseline.
    """

    label: str
    source: str
    hardware: str
    workload: str
    gpus: int
    efficiency: float | None
    images_per_sec_per_gpu: float | None
    note: str


PUBLISHED_POINTS: tuple[PublishedPoint, ...] = (
    PublishedPoint(
        label="MLPerf, 8 × H100",
        source="MLPerf Training (NVIDIA submissions), 8 × H100",
        hardware="8 × H100 SXM, NVLink 4 / NVSwitch",
        workload="ResNet-50 v1.5",
        gpus=8,
        efficiency=None,
        images_per_sec_per_gpu=MLPERF_H100_RESNET50_IMAGES_PER_SEC_PER_GPU,
        note="approximately; derived from a time-to-train result; the compute time the model uses",
    ),
    PublishedPoint(
        label="Goyal et al. 2017",
        source="Goyal et al. 2017, arXiv:1706.02677",
        hardware="32 servers × 8 P100 (NVLink); Ethernet between servers (50 Gbit/s, approximately)",
        workload="ResNet-50, minibatch 8k",
        gpus=256,
        efficiency=0.90,
        images_per_sec_per_gpu=None,
        note="'~90% scaling efficiency when moving from 8 to 256 GPUs' (abstract); baseline 8 GPUs, not 1",
    ),
    PublishedPoint(
        label="Horovod README 2017, 128 GPUs",
        source="Horovod README (2017); Sergeev & Del Balso 2018, arXiv:1802.05799",
        hardware="32 servers × 4 Pascal GPUs, RoCE 25 Gbit/s",
        workload="Inception V3, ResNet-101 (VGG-16: 79%)",
        gpus=128,
        efficiency=0.90,
        images_per_sec_per_gpu=None,
        note="90% in the README's text; the paper describes this benchmark (approximately; not re-checked there)",
    ),
    PublishedPoint(
        label="Horovod README, 512 GPUs",
        source="Horovod README and docs/benchmarks (2018 onwards)",
        hardware="128 servers × 4 Pascal GPUs, RoCE 25 Gbit/s",
        workload="Inception V3, ResNet-101 (VGG-16: 68%)",
        gpus=512,
        efficiency=0.90,
        images_per_sec_per_gpu=None,
        note="90% in the text (a round figure; the chart is per model); tf_cnn_benchmarks",
    ),
)


def interconnect(name: str) -> Interconnect:
    """The preset called ``name`` (nvlink, ndr, 100gbe, 25gbe)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"interconnect {name!r} is not a preset. Fix: use one of {', '.join(PRESETS)}.") from None


def collectives_for(grad_bytes: float, tensors: int, fusion_threshold_bytes: int) -> int:
    """k: collectives per step for ``tensors`` gradients of ``grad_bytes`` in all.

    0 as the threshold means no fusion (one collective per tensor). Otherwise
    ceil(bytes / threshold), at least 1 and at most one per tensor: an estimate,
    since real buckets also close at tensor boundaries (hvrep.replica.fusion.plan_buckets
    gives the exact count for real shapes).
    """
    _check_int("tensors", tensors, 1)
    _check_int("fusion_threshold_bytes", fusion_threshold_bytes, 0)
    _check_bytes(grad_bytes)
    if fusion_threshold_bytes == 0:
        return tensors
    return max(1, min(tensors, math.ceil(grad_bytes / fusion_threshold_bytes)))


# payload_bytes' schemes: the dtype gradients travel in, or PowerSGD's factors.
PAYLOAD_SCHEMES = ("fp32", "fp16", "powersgd")


def payload_bytes(shapes: Sequence[Sequence[int]], scheme: str = "fp32", *, powersgd_rank: int = 1,
                  powersgd_min_compression_rate: float = 2.0) -> int:
    """S: the bytes one rank hands the all-reduces per step for float32 gradients of ``shapes``.

    "fp32": 4 per value; "fp16" (``CommConfig(compression="fp16")``): 2 per value; "powersgd": each matrix
    PowerSGD compresses (``hvrep.replica.comm.powersgd_matrix``, the rule hvrep applies) sends its factors P
    (rows x r) and Q (cols x r) in float32, 4*(rows+cols)*r, and everything else goes exact at 4 per value (the
    steps before ``powersgd_start_step`` are "fp32" steps). This is what the backend is asked to reduce
    (``Replicator.collective_bytes``), not what crosses a link: a ring moves 2(N-1)/N of it per rank
    (:func:`ring_wire_bytes`), and Horovod's negotiation and TCP's headers come on top.
    """
    if scheme not in PAYLOAD_SCHEMES:
        raise ConfigError(f"scheme must be one of {PAYLOAD_SCHEMES}, got {scheme!r}.")
    total = 0
    for shape in shapes:
        values = math.prod(int(d) for d in shape)
        if scheme == "fp16":
            total += 2 * values
            continue
        plan = powersgd_matrix(tuple(shape), powersgd_rank, powersgd_min_compression_rate) \
            if scheme == "powersgd" else None
        total += 4 * (values if plan is None else (plan[0] + plan[1]) * plan[2])
    return total


def ring_wire_bytes(ranks: int, payload: float) -> float:
    """Bytes each rank sends (and receives) in a bandwidth-optimal ring all-reduce of ``payload`` bytes:
    2(N-1)/N of it (reduce-scatter, then all-gather); 0 on one rank."""
    _check_int("ranks", ranks, 1)
    _check_bytes(payload)
    return 2 * (ranks - 1) / ranks * payload


def allreduce_time(ranks: int, nbytes: float, link: Interconnect, collectives: int = 1,
                   beta_tensor_s: float = DEFAULT_BETA_TENSOR_S) -> float:
    """Seconds of one step's ring all-reduce: 2(N−1)·α + 2(N−1)/N · S/B + k·β_tensor (0 for one rank).

    Args:
      ranks: N, GPUs in the ring.
      nbytes: S, bytes reduced in the step.
      link: gives α and B.
      collectives: k, collectives issued for those bytes.
      beta_tensor_s: β_tensor, seconds per collective.
    """
    _check_int("ranks", ranks, 1)
    _check_bytes(nbytes)
    _check_int("collectives", collectives, 1)
    _check_beta(beta_tensor_s)
    if ranks == 1:
        return 0.0
    n = ranks
    latency = 2 * (n - 1) * link.latency_s
    bandwidth = 2 * (n - 1) / n * nbytes / link.bus_bandwidth_Bps
    return latency + bandwidth + collectives * beta_tensor_s


def two_level_allreduce_time(ranks: int, nbytes: float, gpus_per_node: int, network: Interconnect,
                             intra_node: Interconnect = NVLINK, collectives: int = 1,
                             beta_tensor_s: float = DEFAULT_BETA_TENSOR_S) -> float:
    """Seconds of one step's hierarchical all-reduce (g GPUs per node on ``intra_node``, M nodes on ``network``).

        2(g−1)·α_intra + 2(g−1)/g · S/B_intra       reduce-scatter + all-gather in the node
      + 2(M−1)·α_net   + 2(M−1)/M · (S/g)/B_net     ring across nodes, each GPU its 1/g shard
      + k·β_tensor

    Up to one node it is the one-ring time on ``intra_node``.
    """
    _check_int("ranks", ranks, 1)
    _check_int("gpus_per_node", gpus_per_node, 1)
    _check_bytes(nbytes)
    _check_int("collectives", collectives, 1)
    _check_beta(beta_tensor_s)
    if ranks <= gpus_per_node:
        return allreduce_time(ranks, nbytes, intra_node, collectives, beta_tensor_s)
    if ranks % gpus_per_node:
        raise ConfigError(f"ranks={ranks} is not a whole number of nodes of gpus_per_node={gpus_per_node}. "
                          f"Fix: use a multiple of {gpus_per_node}, e.g. {ranks // gpus_per_node * gpus_per_node}.")
    g, m = gpus_per_node, ranks // gpus_per_node
    intra = 2 * (g - 1) * intra_node.latency_s + 2 * (g - 1) / g * nbytes / intra_node.bus_bandwidth_Bps
    inter = 2 * (m - 1) * network.latency_s + 2 * (m - 1) / m * (nbytes / g) / network.bus_bandwidth_Bps
    return intra + inter + collectives * beta_tensor_s


@dataclass(frozen=True)
class Prediction:
    """The model's step at one GPU count (seconds per step; efficiency in [0, 1])."""

    gpus: int
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    efficiency: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_communication_s


def predict(gpus: int, compute_time_per_step_s: float, grad_bytes: float, link: Interconnect, collectives: int,
            overlap: float = 0.0, *, beta_tensor_s: float = DEFAULT_BETA_TENSOR_S, gpus_per_node: int | None = None,
            intra_node: Interconnect = NVLINK) -> Prediction:
    """The model's step at ``gpus`` GPUs: one ring over all of them on ``link``, or two levels.

    Args:
      gpus: N.
      compute_time_per_step_s: forward + backward + update on one GPU, seconds.
      grad_bytes: S, bytes all-reduced per step.
      link: the ring's link; with ``gpus_per_node``, the network between nodes.
      collectives: k (see ``collectives_for``).
      overlap: fraction in [0, 1] of the communication hidden behind compute
        (never more than the compute time itself).
      beta_tensor_s: β_tensor, seconds per collective.
      gpus_per_node: None for one flat ring; g for the two-level variant with
        ``intra_node`` inside each node.
      intra_node: the link inside a node, two-level only.
    """
    if not _is_real(compute_time_per_step_s) or not 0 < compute_time_per_step_s < math.inf:
        raise ConfigError(f"compute_time_per_step_s must be a finite number > 0, got {compute_time_per_step_s!r}.")
    if not _is_real(overlap) or not 0 <= overlap <= 1:
        raise ConfigError(f"overlap must be in [0, 1] (the fraction of communication hidden), got {overlap!r}.")
    if gpus_per_node is None:
        comm = allreduce_time(gpus, grad_bytes, link, collectives, beta_tensor_s)
    else:
        comm = two_level_allreduce_time(gpus, grad_bytes, gpus_per_node, link, intra_node, collectives, beta_tensor_s)
    exposed = comm - min(overlap * comm, compute_time_per_step_s)
    efficiency = compute_time_per_step_s / (compute_time_per_step_s + exposed)
    return Prediction(gpus, compute_time_per_step_s, comm, exposed, efficiency)


def predict_efficiency(gpus: int, compute_time_per_step_s: float, grad_bytes: float, link: Interconnect,
                       collectives: int, overlap: float = 0.0, *, beta_tensor_s: float = DEFAULT_BETA_TENSOR_S,
                       gpus_per_node: int | None = None, intra_node: Interconnect = NVLINK) -> float:
    """compute / (compute + exposed communication) at ``gpus`` GPUs; see ``predict`` for the arguments."""
    return predict(gpus, compute_time_per_step_s, grad_bytes, link, collectives, overlap,
                   beta_tensor_s=beta_tensor_s, gpus_per_node=gpus_per_node, intra_node=intra_node).efficiency


@dataclass(frozen=True)
class Calibration:
    """α, β_tensor and B fitted to measured all-reduce times.

    Attributes:
      alpha_s: α, seconds per ring hop.
      beta_tensor_s: β_tensor, seconds per collective.
      bus_bandwidth_GBps: B, GB/s.
      rms_residual_s: root-mean-square of measured − fitted, seconds.
      points: measurements used.
    """

    alpha_s: float
    beta_tensor_s: float
    bus_bandwidth_GBps: float
    rms_residual_s: float
    points: int

    def interconnect(self, name: str = "calibrated") -> Interconnect:
        """The fitted link, to pass to ``predict`` (with ``beta_tensor_s=self.beta_tensor_s``)."""
        return Interconnect(name, self.bus_bandwidth_GBps, self.alpha_s * 1e6)


def calibrate(measured: Sequence[tuple[int, float, int, float]]) -> Calibration:
    """Fits α, β_tensor and B to measured all-reduce times by non-negative least squares.

    The model is linear in (α, 1/B, β_tensor): each measurement (N, S, k, t)
    gives one row  t ≈ 2(N−1)·α + [2(N−1)/N · S]·(1/B) + k·β_tensor.  The
    three coefficients minimise the squared error subject to being >= 0 (a
    negative latency or bandwidth has no meaning; noise would otherwise
    produce one when a term is small). The columns are scaled to unit size
    first, since S is ~1e8 where N and k are ~10.

    Measure with at least two rank counts, two message sizes and two
    collective counts, so that the three terms can be told apart.

    Args:
      measured: (ranks >= 2, bytes, collectives, seconds) per measurement.

    Raises:
      hvrep.errors.ConfigError: fewer than 3 points, a malformed point, points
        that cannot separate the three terms, or no dependence on bytes.
    """
    rows = []
    for i, point in enumerate(measured):
        if len(point) != 4:
            raise ConfigError(f"measured[{i}] = {point!r} must be (ranks, bytes, collectives, seconds).")
        ranks, nbytes, k, seconds = point
        try:
            _check_int("ranks", ranks, 2)  # one rank communicates nothing: no information
            _check_bytes(nbytes)
            _check_int("collectives", k, 1)
        except ConfigError as e:
            raise ConfigError(f"measured[{i}] = {point!r}: {e}") from None
        if not _is_real(seconds) or not 0 <= seconds < math.inf:
            raise ConfigError(f"measured[{i}] = {point!r}: seconds must be a finite number >= 0, got {seconds!r}.")
        rows.append((2.0 * (ranks - 1), 2.0 * (ranks - 1) / ranks * nbytes, float(k), float(seconds)))
    if len(rows) < 3:
        raise ConfigError(f"calibrate needs at least 3 measurements for 3 unknowns, got {len(rows)}. "
                          "Fix: time all-reduces at two or more rank counts, sizes and collective counts.")
    data = np.asarray(rows, dtype=np.float64)
    x, t = data[:, :3], data[:, 3]
    scale = np.abs(x).max(axis=0)
    xs = x / scale
    if np.linalg.matrix_rank(xs) < 3:
        raise ConfigError("the measurements cannot separate latency, bandwidth and per-collective cost (their "
                          "rank-count, size and collective-count columns are linearly dependent). Fix: vary ranks, "
                          "bytes and collectives independently, e.g. 2 and 8 ranks x 1 MB and 100 MB x 1 and 100 "
                          "collectives.")
    coef = _nnls(xs, t) / scale
    alpha, inv_bandwidth, beta = (float(c) for c in coef)
    if inv_bandwidth <= 0:
        raise ConfigError("the fitted time does not grow with bytes (1/B fitted as 0). Fix: measure sizes that differ "
                          "by 10x or more, large enough (MBs) that bandwidth, not latency, dominates some points.")
    residual = t - x @ coef
    return Calibration(alpha_s=alpha, beta_tensor_s=beta, bus_bandwidth_GBps=1.0 / inv_bandwidth / _GB,
                       rms_residual_s=float(np.sqrt(np.mean(residual**2))), points=len(rows))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a·x − b|| subject to x >= 0, for a handful of columns.

    The optimum is the unconstrained least-squares solution on some subset of
    the columns (its support); with 3 columns trying all 8 subsets is exact
    and needs no SciPy.
    """
    n = a.shape[1]
    best, best_cost = np.zeros(n), float(b @ b)
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sub < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = sub
            cost = float(np.sum((a @ x - b) ** 2))
            if cost < best_cost:
                best, best_cost = x, cost
    return best


def local_sgd_bytes_per_step(trainable_bytes: float, local_steps: int | None, state_bytes: float = 0.0) -> float:
    """S for local SGD (``CommConfig.local_steps``): bytes all-reduced per step, averaged over a round.

    Every H-th step all-reduces the model, its trainable weights and its floating-point non-trainable state
    (batch-norm moving statistics), in their own dtype (never compressed), and the other H−1 steps nothing::

        S = (trainable_bytes + state_bytes) / H

    With an outer optimizer (DiLoCo) the bytes are the same: the outer step runs on every replica after the
    average. ``local_steps`` None is synchronous SGD: the gradients, ``trainable_bytes`` per step (batch-norm
    statistics are not reduced). Feed S to :func:`allreduce_time` with the collectives of one synchronisation
    divided by H for the time per step. A checkpoint adds one all-reduce of the optimizer's state (and of the
    model, when it falls between two synchronisations); it is not counted here.

    Args:
      trainable_bytes: the trainable weights' bytes (= the fp32 gradients' bytes).
      local_steps: H >= 1, or None.
      state_bytes: the non-trainable floating-point state averaged at each synchronisation.
    """
    _check_bytes(trainable_bytes)
    _check_bytes(state_bytes)
    if local_steps is None:
        return float(trainable_bytes)
    _check_int("local_steps", local_steps, 1)
    return (trainable_bytes + state_bytes) / local_steps
