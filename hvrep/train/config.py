"""The training app's configuration: frozen dataclasses, presets, and ``section.key=value`` overrides.

    cfg = configs.build("resnet50_imagenet", ["data.data_dir=/data/imagenet-tfr", "train.global_batch=4096"])

Only ``hvrep train`` parses command lines; this module turns strings into a
validated, frozen :class:`RunConfig`. An unknown section or key, or a value of
the wrong type or out of range, is a ``ConfigError`` naming the key and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvrep.data.config import DataConfig
from hvrep.errors import ConfigError
from hvrep.replica import support
from hvrep.replica.comm import CommConfig

MODELS = ("resnet50", "small_resnet")
OPTIMIZERS = ("recipe", "lars", "momentum_sgd")
PRECISIONS = ("fp32", "fp16", "bf16")
LOOPS = ("custom", "fit")
MLLOG_DIVISIONS = ("open", "closed")
MLLOG_STATUSES = ("cloud", "onprem", "preview", "research")  # MLPerf's submission_status values


@dataclass(frozen=True)
class ModelConfig:
    """Which network.

    Attributes:
      name: "resnet50" (v1.5) or "small_resnet" (demo-sized).
      num_classes: output classes.
      data_format: "channels_last" or "channels_first".
      zero_init_residual: zero the last BN gamma of each block (Goyal et al.).
      width: small_resnet's first-stage width.
    """

    name: str = "resnet50"
    num_classes: int = 1000
    data_format: str = "channels_last"
    zero_init_residual: bool = True
    width: int = 16

    def __post_init__(self) -> None:
        _choice("model.name", self.name, MODELS)
        _choice("model.data_format", self.data_format, ("channels_last", "channels_first"))
        _at_least("model.num_classes", self.num_classes, 1)
        _at_least("model.width", self.width, 1)


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and learning-rate schedule.

    Attributes:
      optimizer: "recipe" (``hvrep.recipes.imagenet_resnet50`` picks by global
        batch), "lars" or "momentum_sgd" (then the fields below apply).
      peak_lr: LR after warmup (explicit optimizers).
      warmup_epochs: linear warmup from 0.
      decay: "polynomial", "cosine", "step" or "constant" (explicit optimizers).
      momentum, weight_decay: as in ``hvrep.optimizers``.
      label_smoothing: for the loss; None = the recipe's (explicit: 0).
      exclude_bn_and_bias: no weight decay / LARS adaptation on BN and biases.
    """

    optimizer: str = "recipe"
    peak_lr: float = 0.1
    warmup_epochs: float = 0.0
    decay: str = "polynomial"
    momentum: float = 0.9
    weight_decay: float = 5e-5
    label_smoothing: float | None = None
    exclude_bn_and_bias: bool = True

    def __post_init__(self) -> None:
        _choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        _choice("optim.decay", self.decay, ("polynomial", "cosine", "step", "constant"))
        if not self.peak_lr > 0:
            raise ConfigError(f"optim.peak_lr must be > 0, got {self.peak_lr!r}.")
        if self.warmup_epochs < 0:
            raise ConfigError(f"optim.warmup_epochs must be >= 0, got {self.warmup_epochs!r}.")
        if self.label_smoothing is not None and not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"optim.label_smoothing must be in [0, 1), got {self.label_smoothing!r}.")


@dataclass(frozen=True)
class TrainConfig:
    """The loop.

    Attributes:
      global_batch: images per step over all replicas (divides by the replicas); times
        ``comm.accumulation_steps`` it is the batch per update that picks the recipe and its LR.
      epochs: epochs to train (None: the recipe's).
      eval_every: evaluate every this many epochs (and at the end).
      target_accuracy: stop once validation top-1 reaches it (MLPerf: 0.759); None: never.
      precision: "fp32", "fp16" (mixed, with dynamic loss scaling) or "bf16" (mixed).
      jit_compile: XLA for the forward/backward/update compute (never the collectives).
      seed: model init, shuffling and augmentation.
      max_steps: stop after this many steps in total (smoke tests); None: no limit.
      log_every: steps between metric lines.
      steps_per_loop: steps between the loop's host round-trips (Orbit's name; Keras' steps_per_execution):
        the loss and accuracy are summed on the device and read, with the agreement on stopping (signals),
        once per loop; loops also end at log, checkpoint and max_steps boundaries. A signal is acted on
        within this many steps. With ``loop="fit"``: Keras' ``steps_per_execution``.
      threads: CPU threads per rank: each rank's TensorFlow intra- and inter-op pools and its tf.data
        pool get this many. None (default): the rank's share, from the cores it may use
        (``hvrep/replica/cores.py``, ``default_budget``): the cores its launcher bound it to alone, else the
        cores the node's ranks share (the node's, a container's or Slurm allocation's) divided by its ranks on
        the node; one rank alone keeps TensorFlow's own pools.
      bind_cores: bind each rank's threads to ``threads`` cores of its own (local rank k: the k-th block of the
        node's cores), as ``mpirun --bind-to core`` does and ``horovodrun --gloo`` does not. None (default):
        where several ranks share a node that no launcher bound them on. A process a launcher or Slurm has
        bound already keeps its binding. false for two independent jobs on one node (both would bind to the
        first cores).
      loop: "custom" (hvrep's loop: ``controller.py``) or "fit" (Keras' ``model.fit`` through ``hvrep.keras``:
        ``fitloop.py``; no gradient accumulation, local SGD or elastic driver). Both resume (--resume) from
        either loop's checkpoints and stop cleanly on a signal.
      mllog: write an MLPerf Training log (``mlperf_logging.mllog`` lines) of the run to this file, from the
        chief only (``hvrep/train/mlperf.py``, docs/mlperf.md). An existing file is refused; a ``--resume``d
        attempt writes the next free ``<stem>.<k><suffix>`` (k = 2, 3 ...). None (default): no MLPerf log.
      mllog_division: the log's ``submission_division``: "open" (default) or "closed".
      mllog_org: the log's ``submission_org``.
      mllog_platform: the log's ``submission_platform``; None (default): "<replicas>x<CPU|GPU>", e.g. "8xGPU".
      mllog_status: the log's ``submission_status``: "cloud", "onprem", "preview" or "research" (default).
      mllog_cache_clear: the log's ``cache_clear``: true only when the launch script dropped the OS page cache
        before this run (hvrep never does).
    """

    global_batch: int = 256
    epochs: int | None = None
    eval_every: int = 1
    target_accuracy: float | None = None
    precision: str = "fp32"
    jit_compile: bool = False
    seed: int = 0
    max_steps: int | None = None
    log_every: int = 50
    steps_per_loop: int = 10
    threads: int | None = None
    bind_cores: bool | None = None
    loop: str = "custom"
    mllog: str | None = None
    mllog_division: str = "open"
    mllog_org: str = "hvrep"
    mllog_platform: str | None = None
    mllog_status: str = "research"
    mllog_cache_clear: bool = False

    def __post_init__(self) -> None:
        _at_least("train.global_batch", self.global_batch, 1)
        _choice("train.loop", self.loop, LOOPS)
        if self.mllog is not None and not self.mllog.strip():
            raise ConfigError(f"train.mllog must be a file path or none, got {self.mllog!r}. Fix: e.g. "
                              "train.mllog=mlperf.log.")
        _choice("train.mllog_division", self.mllog_division, MLLOG_DIVISIONS)
        _choice("train.mllog_status", self.mllog_status, MLLOG_STATUSES)
        for key, value in (("train.mllog_org", self.mllog_org), ("train.mllog_platform", self.mllog_platform)):
            if value is not None and not value.strip():
                raise ConfigError(f"{key} must not be empty, got {value!r} (MLPerf's checker refuses an empty one).")
        if self.epochs is not None:
            _at_least("train.epochs", self.epochs, 1)
        _at_least("train.eval_every", self.eval_every, 1)
        _choice("train.precision", self.precision, PRECISIONS)
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"train.target_accuracy must be in (0, 1], got {self.target_accuracy!r}.")
        if self.max_steps is not None:
            _at_least("train.max_steps", self.max_steps, 1)
        _at_least("train.log_every", self.log_every, 1)
        _at_least("train.steps_per_loop", self.steps_per_loop, 1)
        if self.threads is not None:
            _at_least("train.threads", self.threads, 1)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints (written by the chief, atomically).

    Attributes:
      every_epochs: save at the end of every this many epochs.
      every_steps: also save every this many steps; None: only per epoch.
      keep: checkpoints kept (>= 2 leaves one to fall back to when the newest is found damaged at a resume).
    """

    every_epochs: int = 1
    every_steps: int | None = None
    keep: int = 3

    def __post_init__(self) -> None:
        _at_least("checkpoint.every_epochs", self.every_epochs, 1)
        if self.every_steps is not None:
            _at_least("checkpoint.every_steps", self.every_steps, 1)
        _at_least("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training (``horovodrun --min-np A --max-np B --host-discovery-script S hvrep train ...``; only
    read under horovodrun's elastic driver).

    Attributes:
      commit_every_steps: steps between in-memory commits (a lost worker costs the steps since the last one;
        an epoch's end commits too). 20: a demo step's commit copies ~0.7 MB, well under the 2% goal
        (``benchmarks/elastic.py``).
      min_np, max_np: the launch's --min-np and --max-np (horovodrun does not tell its workers): every world
        size between them must divide ``train.global_batch``, which elastic training keeps.
    """

    commit_every_steps: int = 20
    min_np: int | None = None
    max_np: int | None = None

    def __post_init__(self) -> None:
        _at_least("elastic.commit_every_steps", self.commit_every_steps, 1)
        for name in ("min_np", "max_np"):
            if getattr(self, name) is not None:
                _at_least(f"elastic.{name}", getattr(self, name), 1)
        if self.min_np is not None and self.max_np is not None and self.min_np > self.max_np:
            raise ConfigError(f"elastic.min_np={self.min_np} is above elastic.max_np={self.max_np}. Fix: give "
                              "horovodrun's --min-np and --max-np.")

    def unused_warning(self, global_batch: int) -> str | None:
        """Outside horovodrun's elastic driver: what to tell a user who gave elastic settings (they are ignored
        there), with what :meth:`check_batch` would refuse under it; None when every setting is its default."""
        given = [f"elastic.{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        if not given:
            return None
        msg = (f"{' '.join(given)}: elastic settings apply only under horovodrun's elastic driver (horovodrun "
               "--min-np A --max-np B --host-discovery-script S); this launch is not elastic and ignores them.")
        if self.min_np is not None and self.max_np is not None:
            try:
                self.check_batch(global_batch)
            except ConfigError as e:
                msg += f" Under the driver it would stop: {e}"
        return msg

    def check_batch(self, global_batch: int) -> None:
        """Refuses a global batch some world size in [min_np, max_np] does not divide.

        Raises:
          hvrep.errors.ConfigError: min_np or max_np not given, or a world size that does not divide.
        """
        if self.min_np is None or self.max_np is None:
            raise ConfigError("this run is elastic (horovodrun's elastic driver started it), and hvrep needs the "
                              "launch's world sizes to check the global batch against them. Fix: add "
                              "elastic.min_np=A elastic.max_np=B with horovodrun's --min-np A --max-np B.")
        bad = [n for n in range(self.min_np, self.max_np + 1) if global_batch % n]
        if bad:
            lcm = math.lcm(*range(self.min_np, self.max_np + 1))
            fit = max(lcm, global_batch // lcm * lcm)
            raise ConfigError(
                f"train.global_batch={global_batch} does not divide by world size(s) {bad} of elastic.min_np="
                f"{self.min_np}..elastic.max_np={self.max_np}: elastic training keeps the global batch at every "
                f"size. Fix: train.global_batch={fit} (a multiple of {lcm}), or narrow --min-np/--max-np.")


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs.

    Attributes:
      name: the run's name, in its logs and ``metrics.jsonl``.
      output_dir: where the run writes its checkpoints, ``metrics.jsonl`` and TensorBoard logs.
      model: which network (``model.*``).
      data: the input pipeline (``data.*``, ``hvrep.data.DataConfig``).
      optim: the optimizer and learning-rate schedule (``optim.*``).
      train: the loop (``train.*``).
      comm: how values cross replicas (``comm.*``, ``hvrep.CommConfig``).
      checkpoint: when checkpoints are written and how many are kept (``checkpoint.*``).
    """

    name: str = "resnet50_imagenet"
    output_dir: str = "runs/resnet50_imagenet"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=lambda: DataConfig(data_dir=""))
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    def __post_init__(self) -> None:
        # Checked here too (optim.py checks the length a checkpoint gives), so that `hvrep train` refuses it
        # before TensorFlow starts.
        o, epochs = self.optim, self.train.epochs
        if o.optimizer != "recipe" and epochs is not None and o.warmup_epochs > epochs:
            raise ConfigError(f"optim.warmup_epochs={o.warmup_epochs:g} is longer than training (train.epochs="
                              f"{epochs}). Fix: a shorter optim.warmup_epochs or a larger train.epochs.")
        check_combinations(self)
        # Local SGD: a checkpoint is taken at a synchronisation point. A save off the cadence synchronises early
        # (the epoch's end, a stop); a regular cadence that is not a multiple of H would do so every time.
        h, every = self.comm.local_steps, self.checkpoint.every_steps
        if h is not None and every is not None and every % h:
            raise ConfigError(f"checkpoint.every_steps={every} is not a multiple of comm.local_steps={h}: local SGD "
                              "checkpoints at a synchronisation point, and each save between two would synchronise "
                              f"the replicas early. Fix: checkpoint.every_steps={max(1, round(every / h)) * h}.")


SECTIONS = ("model", "data", "optim", "train", "comm", "checkpoint", "elastic")


def check_combinations(cfg: RunConfig, elastic: bool = False) -> None:
    """Refuses a combination of settings the support table (``hvrep.replica.support``, docs/combinations.md)
    refuses, hvrep train's own limits included; ``elastic``: the run is under horovodrun's elastic driver (known
    at start-up only). hvrep train exits 2 on it, before TensorFlow starts.

    Raises:
      hvrep.errors.ConfigError: naming the settings and the fix.
    """
    t, o = cfg.train, cfg.optim
    loop = f"elastic-{t.loop}" if elastic else t.loop
    # "recipe" picks LARS or momentum SGD by the global batch (hvrep.recipes.imagenet_resnet50).
    family = {"lars": ("lars",), "momentum_sgd": ("linear",), "recipe": ("lars", "linear")}[o.optimizer]
    support.check([support.Setting("loop", (loop,), f"train.loop={t.loop}" + (" (elastic)" if elastic else "")),
                   support.Setting("precision", (t.precision,), f"train.precision={t.precision}"),
                   support.Setting("optimizer", family, f"optim.optimizer={o.optimizer}"),
                   support.Setting("clipping", ("none",), "no clipping"),
                   support.count("steps_per_loop", t.steps_per_loop, f"train.steps_per_loop={t.steps_per_loop}"),
                   *support.comm_settings(cfg.comm, "comm.")], "", app=True)


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {allowed}, got {value!r}.")


def _at_least(key: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}.")


def preset(name: str) -> RunConfig:
    """A named starting point: "resnet50_imagenet" or "demo"."""
    from hvrep import _env

    if name == "resnet50_imagenet":
        # ResNet-50 v1.5 on ImageNet TFRecords with DALI, the recipe for the batch, MLPerf's target.
        return RunConfig(
            data=DataConfig(data_dir="", format="tfrecord", backend="dali"),
            train=TrainConfig(global_batch=256, target_accuracy=0.759, precision="fp16"),
        )
    if name == "demo":
        # The digits (hvrep data demo) at 32 px: a small ResNet, LARS with warmup. Their augmentation is
        # milder than ImageNet's: no flips (a mirrored 3 is not a 3), crops of 80-100% near square.
        data_dir = _env.cache_dir() / "demo-data" / "tfrecord"
        return RunConfig(
            name="demo",
            output_dir="runs/demo",
            model=ModelConfig(name="small_resnet", num_classes=10, width=16),
            data=DataConfig(data_dir=str(data_dir), format="tfrecord", backend="tfdata", image_size=32,
                            resize_size=32, crop_scale=(0.8, 1.0), crop_ratio=(0.9, 1.1), flip=False),
            # peak_lr from a sweep at 12 epochs, 1 replica (val top-1): 1.0 -> 95.8%, 4.0 -> 98.9%, 10.0 -> 98.6%.
            optim=OptimConfig(optimizer="lars", peak_lr=5.0, warmup_epochs=2.0, decay="polynomial",
                              momentum=0.9, weight_decay=5e-4, label_smoothing=0.0),
            train=TrainConfig(global_batch=64, epochs=15, eval_every=1, target_accuracy=None, log_every=10),
        )
    raise ConfigError(f"--config must be a preset ('resnet50_imagenet', 'demo') or a JSON file, got {name!r}.")


def _coerce(key: str, raw: Any, hint: Any) -> Any:
    """Converts an override string (or JSON value) to the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, raw, inner[0])
    if origin is tuple:
        parts = raw if isinstance(raw, list | tuple) else str(raw).split(",")
        if len(parts) != len(args):
            raise ConfigError(f"{key} takes {len(args)} comma-separated values, got {raw!r}.")
        return tuple(_coerce(key, p, a) for p, a in zip(parts, args, strict=True))
    try:
        if hint is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("true", "1", "yes", "on"):
                return True
            if str(raw).lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(raw)
        if hint is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        if hint is float:
            return float(raw)
        if hint is str:
            return str(raw)
    except ValueError:
        pass
    else:
        return raw
    raise ConfigError(f"{key} must be {getattr(hint, '__name__', hint)}, got {raw!r}.")


def _section_fields(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """Returns ``cfg`` with ``{"section.key": value}`` applied, validated."""
    changes: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, raw in overrides.items():
        if key in ("name", "output_dir"):
            top[key] = str(raw)
            continue
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(
                f"unknown setting {key!r}. Settings are name, output_dir, or section.key with section one of "
                f"{SECTIONS}, e.g. train.global_batch=4096."
            )
        fields = _section_fields(getattr(cfg, section))
        if name not in fields:
            raise ConfigError(f"{section} has no setting {name!r}; it has: {', '.join(sorted(fields))}.")
        changes.setdefault(section, {})[name] = _coerce(key, raw, fields[name])
    for section, values in changes.items():
        try:
            top[section] = dataclasses.replace(getattr(cfg, section), **values)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(section + ".") else f"{section}.{msg}") from None
    return dataclasses.replace(cfg, **top)


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.global_batch=4096.")
        out[key.strip()] = value.strip()
    return out


def build(config: str, overrides: list[str] | None = None) -> RunConfig:
    """A preset name or a JSON file (``{"train.global_batch": 4096, ...}`` on top of a ``"preset"``), then overrides."""
    path = Path(config)
    if path.suffix == ".json" and path.is_file():
        spec = _read_json(path)
        base = preset(spec.pop("preset", "resnet50_imagenet"))
        cfg = apply_overrides(base, spec)
    else:
        cfg = preset(config)
    return apply_overrides(cfg, parse_overrides(overrides or []))


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON config file's settings; a file that is not a JSON object is one ConfigError naming where."""
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {path}: line {e.lineno}, column {e.colno}: {e.msg}. Fix: correct the JSON "
                          "there (keys and strings in double quotes, no trailing comma), e.g. "
                          '{"preset": "demo", "train.epochs": 5}.') from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} cannot be read ({e}). Fix: a readable UTF-8 JSON file.") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--config {path} holds a JSON {type(spec).__name__}, not an object of settings. Fix: "
                          '{"preset": "demo", "train.epochs": 5} (a preset and section.key settings).')
    return spec


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as plain JSON-able data (recorded with every run)."""
    return dataclasses.asdict(cfg)
