"""``hvrep report RESULTS...``: a scaling report (table and plots) from training runs and benchmark results.

    hvrep report runs/demo-1rank runs/demo --out results/report
    hvrep report results/scaling.jsonl --interconnect ndr

Each RESULT is one of:

* an ``hvrep train`` output folder (or its ``metrics.jsonl``): one run. Its
  last ``config`` event gives the replicas, model and global batch; its
  throughput is ``hvrep.perf.summary.throughput`` (the median over epochs, the
  first, compiling, epoch left out when there are several); a
  ``step_time_breakdown`` in its ``final`` event is used when present.
* a benchmark JSON-lines file, one result per line, in the layout of
  ``benchmarks/`` (config, env, raw timings, summary). A line is read as::

      {"ok": true,                                   # false: the line is skipped
       "config": {"model": "resnet50" | {...}, "ranks" (or "replicas"): 2,
                  "global_batch": 512 and/or "per_replica_batch": 256,
                  "image_size": 224, "backend": "horovod"},      # optional
       "env": {"platform": ..., "cpu_count": ..., "gpus": [names]},  # optional
       "summary": {"images_per_sec": 1234.5,
                   "step_time_breakdown": {"compute_s": .., "communication_s": ..,
                                           "input_wait_s": ..}}}    # optional

Results are only compared when they measure the same thing (``check_comparable``):
one model, one batch rule (strong scaling: one global batch; weak scaling: one
per-replica batch) and one machine type (platform, CPU count, GPU names where
recorded). ``--allow-mixed`` reports them anyway and lists the differences.

``--interconnect`` adds what ``hvrep.perf.costmodel`` predicts for 8 to 1,024 H100
GPUs on that link, labelled as a model, next to published measurements.

Lines of ``benchmarks/multihost.py`` (``"benchmark": "multihost"``; its
``kind: "scaling"`` lines carry ``hosts``, ``link_gbit``, the setting,
``measured_efficiency`` and ``predicted_efficiency``) go to their own page,
``multihost.md``, with a plot of measured against predicted efficiency
(``load_multihost``, ``render_multihost``); its calibration lines are read there only.

Lines of ``benchmarks/slow_links.py`` (``"benchmark": "slow_links"``: accuracy against wall time per scheme,
link rate and seed) go to ``slow-links.md``, with one plot per link rate (``hvrep.perf.slowlinks``).
Lines of ``benchmarks/step_overhead.py`` go to ``step-overhead.md`` (``hvrep.perf.stepoverhead``), and those of
``benchmarks/faults.py`` to ``faults.md`` (``hvrep.perf.faults``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvrep.errors import ConfigError, DataError, HvrepError
from hvrep.perf import costmodel
from hvrep.perf.faults import FAULTS, load_faults, render_faults
from hvrep.perf.slowlinks import SLOW_LINKS, load_slow_links, render_slow_links
from hvrep.perf.stepoverhead import STEP_OVERHEAD, load_step_overhead, render_step_overhead
from hvrep.perf.summary import throughput
from hvrep.train.metrics import read_json_lines

_METRICS = "metrics.jsonl"
_THROUGHPUT_PNG, _EFFICIENCY_PNG, _BREAKDOWN_PNG = "throughput.png", "efficiency.png", "breakdown.png"
MULTIHOST = "multihost"  # benchmarks/multihost.py's lines
# Benchmarks whose lines get a page of their own, not the scaling table.
_OWN_PAGES = (MULTIHOST, SLOW_LINKS, STEP_OVERHEAD, FAULTS)
_MULTIHOST_MD, _MULTIHOST_PNG = "multihost.md", "multihost.png"
_MIB = 1024 * 1024
_NOT_RECORDED = "not recorded"
# The model table: powers of two from one 8-GPU node to 1,024 GPUs.
_MODEL_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
_GPUS_PER_NODE = 8  # DGX/HGX H100
# The fusion buffer the model assumes: hvrep's in-graph bucket (ResNet-50's 102 MB in one collective). The
# horovod backend's 25 MiB buckets make it 5: 4 more β_tensor, microseconds against a step's milliseconds.
_FUSION_THRESHOLD_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Hardware:
    """The machine a result was measured on, as far as it was recorded (None: not recorded).

    Attributes:
      platform: ``platform.platform()`` of the machine.
      cpu_count: ``os.cpu_count()``.
      gpus: the GPU names as recorded (one per GPU, so their number may grow with the ranks).
    """

    platform: str | None
    cpu_count: int | None
    gpus: tuple[str, ...]

    @property
    def gpu_models(self) -> tuple[str, ...]:
        """The distinct GPU names: what makes two machines the same type, whatever the ranks used."""
        return tuple(sorted(set(self.gpus)))


@dataclass(frozen=True)
class StepBreakdown:
    """Where one training step's time went, in seconds per step.

    ``input_wait_s`` is None when the run did not measure it (``hvrep bench``
    feeds one in-memory synthetic batch, so there is no input to wait for).
    """

    compute_s: float
    communication_s: float
    input_wait_s: float | None
    # How much of communication_s overlapped the backward pass in the whole step (a floor); None: not recorded.
    communication_hidden_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("compute_s", "communication_s", "input_wait_s", "communication_hidden_s"):
            value = getattr(self, name)
            if name in ("input_wait_s", "communication_hidden_s") and value is None:
                continue
            if not _is_number(value) or not 0 <= value < math.inf:
                raise DataError(f"step_time_breakdown.{name} must be a finite number of seconds >= 0, got {value!r}.")

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + (self.input_wait_s or 0.0)


@dataclass(frozen=True)
class Run:
    """One measured result: a training run or one benchmark line.

    Attributes:
      source: where it came from (a run folder, or ``file:line``).
      kind: "train" or "benchmark".
      ranks: replicas that ran it.
      model: the model, with its settings and image size, as one label.
      global_batch: images per step over all ranks.
      per_replica_batch: images per step per rank.
      images_per_sec: measured throughput over all ranks.
      hardware: the machine, None where the result does not record it.
      breakdown: the step-time breakdown, None where not recorded.
      backend: the communication backend, where recorded.
    """

    source: str
    kind: str
    ranks: int
    model: str
    global_batch: int
    per_replica_batch: int
    images_per_sec: float
    hardware: Hardware | None = None
    breakdown: StepBreakdown | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("train", "benchmark"):
            raise ConfigError(f"Run.kind must be 'train' or 'benchmark', got {self.kind!r}.")
        for name in ("ranks", "global_batch", "per_replica_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DataError(f"{self.source}: {name} must be an int >= 1, got {value!r}.")
        if self.global_batch != self.per_replica_batch * self.ranks:
            raise DataError(f"{self.source}: global_batch={self.global_batch} is not per_replica_batch="
                            f"{self.per_replica_batch} x ranks={self.ranks}. Fix: record consistent batch sizes.")
        if not _is_number(self.images_per_sec) or not 0 < self.images_per_sec < math.inf:
            raise DataError(f"{self.source}: images_per_sec must be a finite number > 0, got {self.images_per_sec!r}.")


@dataclass(frozen=True)
class Comparison:
    """What ``check_comparable`` found.

    Attributes:
      mode: "strong" (one global batch), "weak" (one per-replica batch),
        "one rank count" (every result at the same ranks and batch) or
        "mixed" (neither batch is constant; only with ``allow_mixed``).
      differences: the differences ``allow_mixed`` let through, one line each.
    """

    mode: str
    differences: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScalingRow:
    """One rank count of the scaling table.

    Attributes:
      ranks: replicas.
      runs: results at this rank count.
      images_per_sec: their median throughput.
      images_per_sec_min: the lowest.
      images_per_sec_max: the highest.
      speedup: images_per_sec / that of the smallest rank count.
      efficiency: speedup / (ranks / smallest rank count), 1.0 is linear.
    """

    ranks: int
    runs: int
    images_per_sec: float
    images_per_sec_min: float
    images_per_sec_max: float
    speedup: float
    efficiency: float


# --------------------------------------------------------------------------- loading


def load_results(paths: Iterable[str | Path], allow_empty: bool = False) -> list[Run]:
    """Reads training run folders and benchmark JSON-lines files (see the module docstring).

    ``allow_empty``: return [] instead of raising when the files hold only ``multihost`` or ``slow_links`` lines.
    """
    runs: list[Run] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            metrics = path / _METRICS
            if not metrics.is_file():
                raise DataError(f"{path} is a folder without {_METRICS}. Fix: point at the output_dir of an "
                                "`hvrep train` run, or at a benchmark .jsonl file.")
            runs.append(_run_from_metrics(path, _read_jsonl(metrics, key="event")))
        elif path.is_file():
            records = _read_jsonl(path, key="event" if path.name == _METRICS else None)
            if records and "event" in records[0][1]:
                runs.append(_run_from_metrics(path.parent if path.name == _METRICS else path, records))
            else:
                runs.extend(_runs_from_benchmark(path, records))
        else:
            raise DataError(f"{path} does not exist. Fix: pass `hvrep train` output folders or benchmark .jsonl files.")
    if not runs and not allow_empty:
        raise DataError("no results given. Fix: pass at least one run folder or benchmark .jsonl file.")
    return runs


def _read_jsonl(path: Path, key: str | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The file's JSON objects (with ``key``: those holding it); a line cut off by a crash, or a foreign one, is
    skipped with a warning (:func:`hvrep.train.metrics.read_json_lines`)."""
    records = read_json_lines(path, key)
    if not records:
        raise DataError(f"{path} is empty. Fix: point at a finished run or benchmark.")
    return records


def _need(mapping: Mapping[str, Any], key: str, where: str, fix: str) -> Any:
    if not isinstance(mapping, Mapping) or mapping.get(key) is None:
        raise DataError(f"{where} has no {key!r}. Fix: {fix}.")
    return mapping[key]


def _run_from_metrics(run_dir: Path, records: list[tuple[int, dict[str, Any]]]) -> Run:
    source = str(run_dir)
    where = f"{run_dir / _METRICS if run_dir.is_dir() else run_dir}"
    events = [record for _, record in records]
    starts = [i for i, e in enumerate(events) if e.get("event") == "config"]
    if not starts:
        raise DataError(f"{where} has no `config` event. Fix: point at the metrics.jsonl of an `hvrep train` run.")
    last = events[starts[-1]:]  # a resumed run appends; the last run is the one to report
    header = last[0]
    fix = "re-run with a current `hvrep train`, which records it"
    config = _need(header, "config", f"{where} `config` event", fix)
    ranks = _need(header, "replicas", f"{where} `config` event", fix)
    global_batch = _need(_need(config, "train", f"{where} config", fix), "global_batch", f"{where} config.train", fix)
    model = _model_label(_need(config, "model", f"{where} config", fix), (config.get("data") or {}).get("image_size"))
    images_per_sec = throughput(events)
    if images_per_sec is None:
        raise DataError(f"{where} records no throughput (no `epoch` or `final` event with images_per_sec). "
                        "Fix: let the run finish at least one epoch.")
    final = next((e for e in reversed(last) if e.get("event") == "final"), {})
    if not isinstance(ranks, int) or ranks < 1 or not isinstance(global_batch, int) or global_batch % ranks:
        raise DataError(f"{where}: replicas={ranks!r} and global_batch={global_batch!r} must be ints with "
                        "global_batch a multiple of replicas.")
    return Run(source=source, kind="train", ranks=ranks, model=model, global_batch=global_batch,
               per_replica_batch=global_batch // ranks, images_per_sec=float(images_per_sec),
               hardware=_hardware(header.get("env") or header.get("environment")),
               breakdown=_breakdown(final.get("step_time_breakdown"), where),
               backend=header.get("backend"))


def _runs_from_benchmark(path: Path, records: list[tuple[int, dict[str, Any]]]) -> list[Run]:
    runs = []
    fix = "write scaling benchmark lines with config.model, config.ranks, a batch size and summary.images_per_sec"
    for number, record in records:
        if record.get("ok") is False:  # a failed case; benchmarks record it and carry on
            continue
        if record.get("benchmark") in _OWN_PAGES:  # read by load_multihost / load_slow_links, on their own page
            continue
        where = f"{path}:{number}"
        config = _need(record, "config", where, fix)
        ranks = config.get("ranks", config.get("replicas"))
        if ranks is None:
            raise DataError(f"{where} has no config.ranks (or config.replicas). Fix: {fix}.")
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise DataError(f"{where}: config.ranks must be an int >= 1, got {ranks!r}.")
        global_batch, per_replica = config.get("global_batch"), config.get("per_replica_batch")
        if global_batch is None and per_replica is None:
            raise DataError(f"{where} has neither config.global_batch nor config.per_replica_batch. Fix: {fix}.")
        if global_batch is None:
            if not isinstance(per_replica, int) or isinstance(per_replica, bool):
                raise DataError(f"{where}: config.per_replica_batch must be an int, got {per_replica!r}.")
            global_batch = per_replica * ranks
        if per_replica is None:
            if not isinstance(global_batch, int) or global_batch % ranks:
                raise DataError(f"{where}: config.global_batch={global_batch!r} is not a multiple of ranks={ranks}.")
            per_replica = global_batch // ranks
        summary = _need(record, "summary", where, fix)
        runs.append(Run(source=where, kind="benchmark", ranks=ranks,
                        model=_model_label(_need(config, "model", f"{where} config", fix), config.get("image_size")),
                        global_batch=global_batch, per_replica_batch=per_replica,
                        images_per_sec=_need(summary, "images_per_sec", f"{where} summary", fix),
                        hardware=_hardware(record.get("env") or record.get("environment")),
                        breakdown=_breakdown(summary.get("step_time_breakdown"), where),
                        backend=config.get("backend")))
    if not runs and not any(record.get("benchmark") in _OWN_PAGES for _, record in records):
        raise DataError(f"{path} has no successful result (every line has ok: false). Fix: re-run the benchmark.")
    return runs


def _model_label(model: Any, image_size: Any) -> str:
    """'resnet50' or 'small_resnet(width=16, ...)', with ' at 32 px' where the image size is known."""
    if isinstance(model, Mapping):
        rest = ", ".join(f"{k}={v}" for k, v in sorted(model.items()) if k != "name")
        label = f"{model.get('name', '?')}({rest})" if rest else str(model.get("name", "?"))
    else:
        label = str(model)
    return f"{label} at {image_size} px" if image_size is not None else label


def _hardware(env: Any) -> Hardware | None:
    if not isinstance(env, Mapping):
        return None
    gpus = env.get("gpus")
    if gpus is None:  # TensorFlow device names: the count, at least, when names were not recorded
        gpus = [d for d in env.get("devices") or [] if "GPU" in str(d).upper()]
    return Hardware(platform=env.get("platform"), cpu_count=env.get("cpu_count"), gpus=tuple(str(g) for g in gpus))


def _breakdown(value: Any, where: str) -> StepBreakdown | None:
    if value is None:
        return None
    fields = ("compute_s", "communication_s", "input_wait_s")
    if not isinstance(value, Mapping) or any(k not in value for k in fields[:2]):
        raise DataError(f"{where}: step_time_breakdown must be an object with {', '.join(fields)} (input_wait_s may "
                        f"be null: not measured), got {value!r}.")
    return StepBreakdown(*(value.get(k) for k in fields), communication_hidden_s=value.get("communication_hidden_s"))


# --------------------------------------------------------------------------- comparing


def check_comparable(runs: Sequence[Run], allow_mixed: bool = False) -> Comparison:
    """Refuses results that do not measure the same thing; decides strong or weak scaling.

    Strong scaling when every result has one global batch, weak scaling when
    every result has one per-replica batch, refused when neither holds. The
    model and the recorded hardware (platform, CPU count, GPU names) must be
    the same everywhere.

    Raises:
      hvrep.errors.ConfigError: a difference, naming the field and the value
        per result, unless ``allow_mixed``.
    """
    if not runs:
        raise ConfigError("no results to compare. Fix: pass at least one run folder or benchmark .jsonl file.")
    differences = []
    checks: list[tuple[str, list[tuple[str, Any]]]] = [("model", [(r.source, r.model) for r in runs])]
    for field, attr in (("platform", "platform"), ("cpu_count", "cpu_count"), ("gpus", "gpu_models")):
        values = [(r.source, _NOT_RECORDED if r.hardware is None else getattr(r.hardware, attr)) for r in runs]
        checks.append((f"hardware {field}", values))
    for field, values in checks:
        line = _difference(field, values)
        if line is not None:
            differences.append(line)

    one_global = len({r.global_batch for r in runs}) == 1
    one_per_replica = len({r.per_replica_batch for r in runs}) == 1
    if one_global and one_per_replica:
        mode = "one rank count"
    elif one_global:
        mode = "strong"
    elif one_per_replica:
        mode = "weak"
    else:
        mode = "mixed"
        per_source = "; ".join(f"{r.source}: global_batch={r.global_batch}, per_replica_batch={r.per_replica_batch}"
                               for r in runs)
        differences.append("batch: neither global_batch (strong scaling) nor per_replica_batch (weak scaling) is the "
                           f"same in every result: {per_source}")
    if differences and not allow_mixed:
        raise ConfigError("these results are not comparable:\n  - " + "\n  - ".join(differences)
                          + "\nFix: report results of one model, one machine type and one batch rule together "
                          "(a constant global batch for strong scaling, a constant per-replica batch for weak "
                          "scaling), or pass --allow-mixed to report them anyway with these differences listed.")
    return Comparison(mode=mode, differences=tuple(differences))


def _difference(field: str, values: list[tuple[str, Any]]) -> str | None:
    """'field differs: value in a, b; other in c', or None when every value is the same."""
    by_value: dict[str, list[str]] = {}
    for source, value in values:
        shown = (", ".join(value) or "none") if isinstance(value, tuple) else str(value)
        by_value.setdefault(shown, []).append(source)
    if len(by_value) < 2:
        return None
    return f"{field} differs: " + "; ".join(f"{v!r} in {', '.join(s)}" for v, s in by_value.items())


# --------------------------------------------------------------------------- the table


def scaling_table(runs: Sequence[Run]) -> list[ScalingRow]:
    """Throughput, speed-up and efficiency per rank count, against the smallest rank count."""
    by_ranks: dict[int, list[float]] = {}
    for r in runs:
        by_ranks.setdefault(r.ranks, []).append(r.images_per_sec)
    base_ranks = min(by_ranks)
    base = statistics.median(by_ranks[base_ranks])
    rows = []
    for ranks in sorted(by_ranks):
        values = by_ranks[ranks]
        median = statistics.median(values)
        speedup = median / base
        rows.append(ScalingRow(ranks=ranks, runs=len(values), images_per_sec=median, images_per_sec_min=min(values),
                               images_per_sec_max=max(values), speedup=speedup,
                               efficiency=speedup / (ranks / base_ranks)))
    return rows


def _breakdown_by_ranks(runs: Sequence[Run]) -> dict[int, StepBreakdown]:
    """The median of each component per rank count, over the results that recorded one."""
    grouped: dict[int, list[StepBreakdown]] = {}
    for r in runs:
        if r.breakdown is not None:
            grouped.setdefault(r.ranks, []).append(r.breakdown)
    def median_of(bs: list[StepBreakdown], attr: str) -> float | None:
        measured = [getattr(b, attr) for b in bs if getattr(b, attr) is not None]
        return statistics.median(measured) if measured else None

    return {ranks: StepBreakdown(statistics.median(b.compute_s for b in bs),
                                 statistics.median(b.communication_s for b in bs), median_of(bs, "input_wait_s"),
                                 median_of(bs, "communication_hidden_s"))
            for ranks, bs in sorted(grouped.items())}


# --------------------------------------------------------------------------- rendering


def render(runs: Sequence[Run], out_dir: str | Path, interconnect: costmodel.Interconnect | None = None,
           allow_mixed: bool = False, calibration: costmodel.Calibration | None = None) -> Path:
    """Writes out_dir/report.md and its PNG plots; returns the report's path.

    Args:
      runs: from ``load_results``.
      out_dir: created if missing; report.md, throughput.png, efficiency.png
        and (when recorded) breakdown.png are overwritten.
      interconnect: adds the cost model's predictions on this link.
      allow_mixed: report results that ``check_comparable`` would refuse.
    """
    comparison = check_comparable(runs, allow_mixed=allow_mixed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = scaling_table(runs)
    breakdown = _breakdown_by_ranks(runs)
    _plot_scaling(rows, out)
    if breakdown:
        _plot_breakdown(breakdown, out / _BREAKDOWN_PNG)
    else:
        (out / _BREAKDOWN_PNG).unlink(missing_ok=True)  # never leave an earlier report's plot beside this one
    lines = _report_lines(runs, comparison, rows, breakdown, interconnect, calibration)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _figure() -> tuple[Any, Any]:
    # An Agg canvas on a bare Figure: no pyplot, so no global backend or figure state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _rank_axis(ax: Any, ranks: list[int]) -> None:
    if ranks[-1] / ranks[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("ranks")
    ax.grid(True, alpha=0.3)


def _plot_scaling(rows: list[ScalingRow], out: Path) -> None:
    ranks = [r.ranks for r in rows]
    base = rows[0]
    fig, ax = _figure()
    ax.plot(ranks, [base.images_per_sec * r / base.ranks for r in ranks], "--", color="gray", label="ideal (linear)")
    ax.errorbar(ranks, [r.images_per_sec for r in rows],
                yerr=[[r.images_per_sec - r.images_per_sec_min for r in rows],
                      [r.images_per_sec_max - r.images_per_sec for r in rows]],
                fmt="o-", capsize=4, label="measured (median; bars: min-max)")
    ax.set_ylabel("images/s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput vs ranks")
    _rank_axis(ax, ranks)
    ax.legend()
    fig.savefig(out / _THROUGHPUT_PNG)

    fig, ax = _figure()
    ax.axhline(100, linestyle="--", color="gray", label="ideal (100%)")
    ax.plot(ranks, [100 * r.efficiency for r in rows], "o-", label="measured")
    ax.set_ylabel(f"scaling efficiency, % (vs {base.ranks} rank{'s' if base.ranks > 1 else ''})")
    ax.set_ylim(0, max(110, 5 + max(100 * r.efficiency for r in rows)))
    ax.set_title("Scaling efficiency vs ranks")
    _rank_axis(ax, ranks)
    ax.legend()
    fig.savefig(out / _EFFICIENCY_PNG)


def _plot_breakdown(breakdown: dict[int, StepBreakdown], path: Path) -> None:
    fig, ax = _figure()
    labels = [str(r) for r in breakdown]
    bottom = [0.0] * len(labels)
    for name, attr in (("compute", "compute_s"), ("communication", "communication_s"),
                       ("input wait", "input_wait_s")):
        ms = [1e3 * (getattr(b, attr) or 0.0) for b in breakdown.values()]
        ax.bar(labels, ms, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, ms, strict=True)]
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per step (median over results)")
    ax.set_title("Step-time breakdown (as recorded)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.savefig(path)


def _report_lines(runs: Sequence[Run], comparison: Comparison, rows: list[ScalingRow],
                  breakdown: dict[int, StepBreakdown], link: costmodel.Interconnect | None,
                  calibration: costmodel.Calibration | None = None) -> list[str]:
    base = rows[0]
    first = runs[0]
    mode = {
        "strong": f"strong scaling (global batch {first.global_batch} at every rank count)",
        "weak": f"weak scaling (per-replica batch {first.per_replica_batch} at every rank count)",
        "one rank count": f"one rank count ({first.ranks}; global batch {first.global_batch})",
        "mixed": "MIXED batch sizes (neither the global nor the per-replica batch is constant)",
    }[comparison.mode]
    lines = ["# Scaling report", "",
             f"Generated by `hvrep report` from {len(runs)} result(s). Measured: {mode}.", ""]
    if comparison.differences:
        lines += ["**Mixed results (`--allow-mixed`)**: these differences were let through, so the speed-ups "
                  "below compare unlike measurements:", ""]
        lines += [f"- {d}" for d in comparison.differences] + [""]
    lines += [f"- model: {', '.join(sorted({r.model for r in runs}))}", f"- hardware: {_hardware_text(runs)}", ""]

    lines += ["## Measured throughput", "",
              "| ranks | results | images/s (median) | min-max | speed-up | efficiency |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.ranks} | {r.runs} | {r.images_per_sec:,.1f} | {r.images_per_sec_min:,.1f}-"
                     f"{r.images_per_sec_max:,.1f} | {r.speedup:.2f}x | {100 * r.efficiency:.1f}% |")
    lines += ["", f"Speed-up = images/s / images/s at {base.ranks} rank(s) ({base.images_per_sec:,.1f}); "
              f"efficiency = speed-up / (ranks / {base.ranks}); 100% is linear scaling.", "",
              f"![throughput vs ranks]({_THROUGHPUT_PNG})", "", f"![efficiency vs ranks]({_EFFICIENCY_PNG})", ""]

    lines += ["## Step-time breakdown", ""]
    missing = [r.source for r in runs if r.breakdown is None]
    if not breakdown:
        lines += [f"{_NOT_RECORDED.capitalize()}: none of these results carries a `step_time_breakdown` "
                  "(compute / communication / input wait), so none is shown and none is estimated.", ""]
    else:
        lines += ["| ranks | compute ms | communication ms | of which hidden ms | input wait ms | comm. share |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for ranks, b in breakdown.items():
            share = b.communication_s / b.total_s if b.total_s else 0.0
            wait = "not measured" if b.input_wait_s is None else f"{1e3 * b.input_wait_s:.2f}"
            hidden = "-" if b.communication_hidden_s is None else f"{1e3 * b.communication_hidden_s:.2f}"
            lines.append(f"| {ranks} | {1e3 * b.compute_s:.2f} | {1e3 * b.communication_s:.2f} | {hidden} | "
                         f"{wait} | {100 * share:.1f}% |")
        lines += ["", f"![step-time breakdown]({_BREAKDOWN_PNG})", ""]
        if missing:
            lines += [f"{_NOT_RECORDED.capitalize()} in: {', '.join(missing)}.", ""]

    lines += ["## Results", "",
              "| source | kind | ranks | model | global batch | per-replica batch | images/s | backend |",
              "|---|---|---:|---|---:|---:|---:|---|"]
    lines += [f"| {r.source} | {r.kind} | {r.ranks} | {r.model} | {r.global_batch} | {r.per_replica_batch} | "
              f"{r.images_per_sec:,.1f} | {r.backend or _NOT_RECORDED} |" for r in runs]
    lines.append("")
    if link is not None:
        lines += _model_lines(link, calibration)
    return lines


def _hardware_text(runs: Sequence[Run]) -> str:
    recorded = {r.hardware for r in runs if r.hardware is not None}
    if not recorded:
        return (f"{_NOT_RECORDED} in these results (`hvrep train`'s metrics.jsonl does not record it), so they "
                "could not be checked to come from one machine type")
    parts = sorted({f"{h.platform or _NOT_RECORDED}, {h.cpu_count or '?'} CPUs, "
                    f"GPUs: {', '.join(h.gpu_models) or 'none'}" for h in recorded})
    unknown = sum(r.hardware is None for r in runs)
    return "; ".join(parts) + (f"; {_NOT_RECORDED} for {unknown} result(s)" if unknown else "")


def load_calibration(path: str | Path) -> costmodel.Calibration:
    """Fits the cost model to ``benchmarks/allreduce.py`` results (median time per case).

    Uses the hvrep and Horovod cases that ran (fused and unfused, fp32 and fp16),
    as (ranks, wire bytes, collectives, seconds).
    """
    points = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("benchmark") != "allreduce" or not rec.get("ok") or not rec.get("collectives"):
            continue
        if str(rec.get("kind", "")).startswith("mpi4py"):
            continue  # one contiguous buffer outside Horovod: another code path
        points.append((int(rec["config"]["ranks"]), float(rec["wire_bytes"]), int(rec["collectives"]),
                       float(rec["summary"]["median_ms"]) / 1000))
    if not points:
        raise DataError(f"{path} holds no all-reduce results. Fix: run `mpirun -np 2 python -m mpi4py "
                        "benchmarks/allreduce.py --out FILE` and pass FILE.")
    return costmodel.calibrate(points)


def _model_lines(link: costmodel.Interconnect, calibration: costmodel.Calibration | None = None) -> list[str]:
    """The cost model's predictions for H100 ResNet-50 on ``link``, next to the published points.

    With ``calibration``, β_tensor (the per-collective overhead fusion removes) is
    the one fitted to measured all-reduces; α and B stay the link's, since the
    measurement machine's own link is not the one being predicted.
    """
    cm = costmodel
    beta = calibration.beta_tensor_s if calibration is not None else cm.DEFAULT_BETA_TENSOR_S
    compute, nbytes = cm.H100_RESNET50_COMPUTE_S, cm.RESNET50_GRAD_BYTES
    fused = cm.collectives_for(nbytes, cm.RESNET50_TENSORS, _FUSION_THRESHOLD_BYTES)
    unfused = cm.RESNET50_TENSORS
    two_level = link != cm.NVLINK
    published: dict[int, list[cm.PublishedPoint]] = {}
    for p in cm.PUBLISHED_POINTS:
        published.setdefault(p.gpus, []).append(p)

    lines = ["## Model: predicted scaling (cost model, not a measurement)", "",
             "**MODEL.** These numbers come from the α-β cost model in `hvrep/perf/costmodel.py`, not from the runs "
             "above and not from any measurement on this machine:", "",
             "    all-reduce time = 2(N-1)·α + 2(N-1)/N · S/B + k·β_tensor",
             "    efficiency      = compute / (compute + all-reduce time)   (no overlap)", "",
             f"- link: {link.name}: B = {link.bus_bandwidth_GBps:g} GB/s per GPU, α = {link.latency_us:g} µs "
             "(assumed achievable figures; their sources are in `hvrep/perf/costmodel.py`)",
             (f"- β_tensor = {1e6 * beta:.1f} µs per collective, CALIBRATED from measured all-reduces "
              f"({calibration.points} cases; the same fit gives α = {1e6 * calibration.alpha_s:.1f} µs and "
              f"B = {calibration.bus_bandwidth_GBps:.2f} GB/s for the measuring machine's own link, not used "
              f"here; rms residual {1e3 * calibration.rms_residual_s:.1f} ms)" if calibration is not None else
              f"- β_tensor = {1e6 * beta:g} µs per collective (assumed, not calibrated: pass --calibrate)"),
             f"- compute = {1e3 * compute:.1f} ms per step: the published MLPerf 8 × H100 ResNet-50 rate of "
             f"approximately {cm.MLPERF_H100_RESNET50_IMAGES_PER_SEC_PER_GPU:,.0f} images/s per GPU at a per-GPU "
             f"batch of {cm.MLPERF_H100_RESNET50_BATCH_PER_GPU}",
             f"- S = {nbytes / 1e6:.1f} MB (ResNet-50's {cm.RESNET50_TENSORS} fp32 gradient tensors); k = {fused} "
             f"fused (128 MiB buckets) or {unfused} unfused (one per tensor)",
             "- what has been checked: the model's FORM. On namespace hosts joined by tbf-shaped links "
             "(`benchmarks/multihost.py`, docs/performance.md) the α-β model fitted at other link rates predicted the "
             "measured 2-host efficiency within 0.15 at a rate the fit never saw, over TCP with Gloo. Its "
             "constants here (NVLink, InfiniBand, NCCL, congestion at scale) are NOT checked: the rows below, "
             "and the published points beside them, stay MODEL predictions.",
             ]
    if two_level:
        lines.append(f"- two-level: {_GPUS_PER_NODE} GPUs per node on {cm.NVLINK.name} "
                     f"({cm.NVLINK.bus_bandwidth_GBps:g} GB/s), nodes on the link above, one NIC per GPU")
    lines.append("")
    header = "| GPUs | one ring: all-reduce ms (fused) | one ring: efficiency fused | one ring: efficiency unfused |"
    rule = "|---:|---:|---:|---:|"
    if two_level:
        header += " two-level: all-reduce ms | two-level: efficiency fused |"
        rule += "---:|---:|"
    header += " model images/s (fused, best) | published (other hardware) |"
    rule += "---:|---|"
    lines += [header, rule]
    for gpus in _MODEL_GPUS:
        flat = cm.predict(gpus, compute, nbytes, link, fused, beta_tensor_s=beta)
        flat_unfused = cm.predict(gpus, compute, nbytes, link, unfused, beta_tensor_s=beta)
        cells = [str(gpus), f"{1e3 * flat.communication_s:.2f}", f"{100 * flat.efficiency:.1f}%",
                 f"{100 * flat_unfused.efficiency:.1f}%"]
        best = flat.efficiency
        if two_level:
            hier = cm.predict(gpus, compute, nbytes, link, fused, gpus_per_node=_GPUS_PER_NODE, beta_tensor_s=beta)
            cells += [f"{1e3 * hier.communication_s:.2f}", f"{100 * hier.efficiency:.1f}%"]
            best = max(best, hier.efficiency)
        cells.append(f"{gpus * cm.MLPERF_H100_RESNET50_IMAGES_PER_SEC_PER_GPU * best:,.0f}")
        cells.append("; ".join(f"{_published_value(p)} ({p.label})" for p in published.get(gpus, [])))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Published points (measurements on other hardware and software; for orientation, not a check "
              "of the model):", "",
              "| source | hardware | workload | GPUs | published | note |", "|---|---|---|---:|---|---|"]
    lines += [f"| {p.source} | {p.hardware} | {p.workload} | {p.gpus} | {_published_value(p)} | {p.note} |"
              for p in cm.PUBLISHED_POINTS]
    if not two_level:
        lines += ["", "A flat NVLink ring beyond 8 GPUs assumes an NVLink Switch system; an 8-GPU node with a "
                  "network between nodes is modelled by the other presets' two-level columns."]
    lines.append("")
    return lines


def _published_value(p: costmodel.PublishedPoint) -> str:
    if p.efficiency is not None:
        return f"~{100 * p.efficiency:.0f}% efficiency"
    return f"~{p.images_per_sec_per_gpu:,.0f} images/s/GPU"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --------------------------------------------------------------------------- namespace hosts (benchmarks/multihost.py)


@dataclass(frozen=True)
class MultihostPoint:
    """One setting of ``benchmarks/multihost.py`` at one link rate: measured and predicted efficiency.

    Attributes:
      source: ``file:line``.
      hosts: namespace hosts, one rank each.
      link_gbit: the shaped rate of every host link, Gbit/s.
      fusion_threshold_bytes: hvrep's bucket size (0: one collective per gradient).
      compression: "none" or "fp16" (the wire dtype).
      overlap: whether the all-reduce could start before the backward pass ended.
      measured_efficiency: t1 / measured step time.
      predicted_efficiency: t1 / (compute + the calibrated model's all-reduce time).
    """

    source: str
    hosts: int
    link_gbit: float
    fusion_threshold_bytes: int
    compression: str
    overlap: bool
    measured_efficiency: float
    predicted_efficiency: float

    @property
    def setting(self) -> str:
        fusion = f"{self.fusion_threshold_bytes // _MIB} MiB" if self.fusion_threshold_bytes else "per tensor"
        return f"fusion {fusion}, {self.compression}, overlap {'on' if self.overlap else 'off'}"


def load_multihost(paths: Iterable[str | Path]) -> list[MultihostPoint]:
    """The ``kind: "scaling"`` lines of ``benchmarks/multihost.py`` in the given files ([] when none)."""
    points = []
    for given in paths:
        path = Path(given)
        if not path.is_file() or path.name == _METRICS:
            continue
        for number, record in _read_jsonl(path):
            if record.get("benchmark") != MULTIHOST or record.get("kind") != "scaling" or record.get("ok") is False:
                continue
            where = f"{path}:{number}"
            fix = "re-run benchmarks/multihost.py, which writes it"
            values = {k: _need(record, k, where, fix) for k in ("hosts", "link_gbit", "compression",
                                                                  "measured_efficiency", "predicted_efficiency")}
            for k in ("link_gbit", "measured_efficiency", "predicted_efficiency"):
                if not _is_number(values[k]) or not 0 <= values[k] < math.inf:
                    raise DataError(f"{where}: {k} must be a finite number >= 0, got {values[k]!r}.")
            points.append(MultihostPoint(
                source=where, hosts=int(values["hosts"]), link_gbit=float(values["link_gbit"]),
                fusion_threshold_bytes=int(record.get("fusion_threshold_bytes") or 0),
                compression=str(values["compression"]), overlap=bool(record.get("overlap")),
                measured_efficiency=float(values["measured_efficiency"]),
                predicted_efficiency=float(values["predicted_efficiency"])))
    return points


def render_multihost(points: Sequence[MultihostPoint], out_dir: str | Path, tolerance: float = 0.15) -> Path:
    """Writes out_dir/multihost.md (table) and multihost.png (efficiency vs link rate, measured and model)."""
    if not points:
        raise DataError("no benchmarks/multihost.py scaling lines. Fix: pass the --out file of that benchmark.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _plot_multihost(points, out / _MULTIHOST_PNG, tolerance)
    ordered = sorted(points, key=lambda p: (p.hosts, p.link_gbit, p.fusion_threshold_bytes, p.compression, p.overlap))
    off = [p for p in points if not p.overlap]
    worst = max((abs(p.measured_efficiency - p.predicted_efficiency) for p in off), default=None)
    lines = ["# Namespace hosts: measured vs model", "",
             f"Generated by `hvrep report` from {len(points)} line(s) of `benchmarks/multihost.py`. Measured: "
             "weak-scaling efficiency across network-namespace hosts on tbf-shaped links (one rank per host). "
             "Model: `hvrep.perf.costmodel` calibrated on the bed's all-reduce microbenchmark at the other link rates, "
             "with the compute time of all ranks computing at once; overlap 0.", "",
             "| hosts | link Gbit/s | setting | measured | model | measured - model |",
             "|---:|---:|---|---:|---:|---:|"]
    for p in ordered:
        diff = p.measured_efficiency - p.predicted_efficiency
        lines.append(f"| {p.hosts} | {p.link_gbit:g} | {p.setting} | {p.measured_efficiency:.3f} | "
                     f"{p.predicted_efficiency:.3f} | {diff:+.3f} |")
    lines.append("")
    if worst is not None:
        verdict = "within" if worst <= tolerance else "NOT within"
        lines += [f"Largest |measured - model| with overlap off (what the model describes): {worst:.3f}, "
                  f"{verdict} {tolerance}.", ""]
    lines += [f"![efficiency vs link rate]({_MULTIHOST_PNG})", ""]
    path = out / _MULTIHOST_MD
    path.write_text("\n".join(lines) + "\n")
    return path


def _plot_multihost(points: Sequence[MultihostPoint], path: Path, tolerance: float) -> None:
    """Left: efficiency vs link rate per setting (measured points, model dashed). Right: measured against
    model, one point per line, with the diagonal and the ±tolerance band (several runs read well here)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.6), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax, agree = fig.subplots(1, 2)
    settings = sorted({(p.hosts, p.setting) for p in points})
    for i, (hosts, setting) in enumerate(settings):
        color = f"C{i % 10}"
        mine = [p for p in points if (p.hosts, p.setting) == (hosts, setting)]
        rates = sorted({p.link_gbit for p in mine})
        label = f"{hosts} hosts, {setting}"
        ax.plot([p.link_gbit for p in mine], [p.measured_efficiency for p in mine], "o", color=color, label=label)
        model = [statistics.median(p.predicted_efficiency for p in mine if p.link_gbit == r) for r in rates]
        ax.plot(rates, model, "--", color=color, alpha=0.8)
        agree.plot([p.predicted_efficiency for p in mine], [p.measured_efficiency for p in mine], "o", color=color)
    ax.plot([], [], "--", color="gray", label="model (median over runs)")
    if len({p.link_gbit for p in points}) > 1:
        ax.set_xscale("log")
    ax.set_xlabel("link rate, Gbit/s (tbf, both directions)")
    ax.set_ylabel("scaling efficiency (vs 1 host)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Efficiency vs link rate: measured (points), model (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
    line = [0.0, 1.05]
    agree.plot(line, line, color="gray", label="measured = model")
    agree.fill_between(line, [v - tolerance for v in line], [v + tolerance for v in line], color="gray", alpha=0.15,
                       label=f"±{tolerance}")
    agree.set_xlim(0, 1.05)
    agree.set_ylim(0, 1.05)
    agree.set_xlabel("model (calibrated at the other link rates)")
    agree.set_ylabel("measured")
    agree.set_title("Measured against model, every setting and rate")
    agree.grid(True, alpha=0.3)
    agree.legend(fontsize=7)
    fig.savefig(path)


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    """``hvrep report RESULTS... [--out DIR] [--allow-mixed] [--interconnect PRESET]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="hvrep report",
                                     description="Scaling table and plots from training runs and benchmark results.")
    parser.add_argument("results", nargs="+", metavar="RESULT",
                        help="`hvrep train` output folders (metrics.jsonl) and/or benchmark .jsonl files")
    parser.add_argument("--out", type=Path, default=Path("results/report"),
                        help="folder for report.md and the PNG plots (default results/report)")
    parser.add_argument("--allow-mixed", action=argparse.BooleanOptionalAction, default=False,
                        help="report results that differ in model, batch rule or hardware, listing the differences")
    parser.add_argument("--interconnect", choices=list(costmodel.PRESETS), default=None,
                        help="add the cost model's predicted scaling (8-1,024 H100 GPUs) on this link, labelled model")
    parser.add_argument("--calibrate", type=Path, default=None, metavar="ALLREDUCE_JSONL",
                        help="fit the model's per-collective overhead to benchmarks/allreduce.py results")
    args = parser.parse_args(argv)
    try:
        multihost = load_multihost(args.results)
        slow = load_slow_links(args.results)
        small = load_step_overhead(args.results)
        faults = load_faults(args.results)
        runs = load_results(args.results, allow_empty=bool(multihost or slow or small or faults))
        if faults:
            print(f"hvrep report: {len(faults)} fault injection(s). Wrote {render_faults(faults, args.out)}")
        if small:
            print(f"hvrep report: {len(small)} step-overhead line(s). Wrote {render_step_overhead(small, args.out)}")
        if multihost:
            page = render_multihost(multihost, args.out)
            print(f"hvrep report: {len(multihost)} namespace-host line(s). Wrote {page} and {_MULTIHOST_PNG}")
        if slow:
            page = render_slow_links(slow, args.out)
            print(f"hvrep report: {len(slow)} slow-link run(s). Wrote {page} and its plots in {page.parent}/")
        if not runs:
            return 0
        link = costmodel.interconnect(args.interconnect) if args.interconnect else None
        calibration = load_calibration(args.calibrate) if args.calibrate else None
        if calibration is not None and link is None:
            raise ConfigError("--calibrate feeds the cost model: add --interconnect nvlink|ndr|100gbe|25gbe.")
        path = render(runs, args.out, interconnect=link, allow_mixed=args.allow_mixed, calibration=calibration)
    except HvrepError as e:
        print(f"hvrep report: error: {e}", file=sys.stderr)
        return 2
    rows = scaling_table(runs)
    print(f"hvrep report: {len(runs)} result(s), {len(rows)} rank count(s); efficiency at {rows[-1].ranks} ranks "
          f"{100 * rows[-1].efficiency:.1f}%. Wrote {path} and its plots in {path.parent}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
