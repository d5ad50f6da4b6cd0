"""What combines with what: hvrep's one support table (issue 46; docs/combinations.md is generated from it).

Every setting a user combines is an axis with a closed list of values (:data:`AXES`). :data:`RULES` refuse the
combinations that cannot train right, each naming up to three settings, the reason and the fix; every other
combination is accepted and :func:`reference` names what it is checked against in
``tests/unit/replica/test_combinations.py`` and ``tests/multirank/cases_combinations.py``, with the tolerance.

:func:`check` is what ``CommConfig``, the ``Replicator``, ``Replicator.wrap_optimizer``,
``hvrep.keras.DistributedOptimizer``, ``hvrep.elastic.State`` and ``hvrep train``'s configuration call when they
are built, before any step runs: each passes the axes it knows (as :class:`Setting` values) and a refused
combination is a ``ConfigError`` naming the settings and the fix.

Pure Python (no TensorFlow, no Keras at import): the docs hook and ``hvrep train``'s configuration import it
before TensorFlow starts. Lower layers only (errors).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hvrep.errors import ConfigError

# The axes and their closed lists of values. "k", "H", "n": any value above 1 (a count of micro-batches, local
# steps, steps per host round-trip, devices). Order is the docs page's.
AXES: dict[str, tuple[str, ...]] = {
    "backend": ("horovod-mpi", "horovod-gloo", "local", "tpu"),
    "loop": ("custom", "fit", "elastic-custom", "elastic-fit"),
    "precision": ("fp32", "fp16", "bf16"),
    "compression": ("none", "fp16", "bf16", "powersgd"),
    "accumulation": ("1", "k"),
    "local_sgd": ("off", "H"),
    "clipping": ("none", "global-norm"),
    "optimizer": ("linear", "lars", "adam", "nonlinear"),
    "devices_per_replica": ("1", "k"),
    "steps_per_loop": ("1", "n"),
    "resume": ("fresh", "same-world", "other-world"),
}

# What each axis's values mean, for the docs page.
AXIS_DOCS: dict[str, str] = {
    "backend": "`Replicator(backend=...)`: horovod over MPI (`mpirun`), horovod over Gloo (`horovodrun --gloo`), "
               "`local` (in-graph `MirroredStrategy`), `tpu` (`TPUStrategy`). With every rank on one host, the "
               "horovod backends' in-step sums go through hvrep's shared memory, the same sums "
               "([Several ranks on one machine](one-host.md)): the 2-rank combination tests run through it.",
    "loop": "your own step in `repl.run` (or `hvrep train train.loop=custom`), Keras `model.fit` through "
            "`hvrep.keras` (`train.loop=fit`), and either under horovodrun's elastic driver (`hvrep.elastic`).",
    "precision": "`fp32`; `fp16`: `mixed_float16` with dynamic loss scaling (a `LossScaleOptimizer`); `bf16`: "
                 "`mixed_bfloat16` (`train.precision`).",
    "compression": "`CommConfig.compression` (`comm.compression`).",
    "accumulation": "`CommConfig.accumulation_steps`: 1, or k > 1 micro-batches per update.",
    "local_sgd": "`CommConfig.local_steps`: None (synchronous SGD), or H: average the models every H steps.",
    "clipping": "none, or clipping by the optimizer (`global_clipnorm`; Keras' `clipnorm` and `clipvalue` are "
                "classed with it: each acts on the gradient the optimizer is handed).",
    "optimizer": "`linear`: the update is linear in the gradient (SGD, heavy-ball and Nesterov momentum); `lars`: "
                 "`hvrep.optimizers.LARS`; `adam`: Adam, AdamW; `nonlinear`: any other Keras optimizer "
                 "(RMSprop, Adagrad, Lion ...), see `optimizer_family`.",
    "devices_per_replica": "`Replicator(devices_per_replica=...)`: 1, or k > 1 devices per replica.",
    "steps_per_loop": "`train.steps_per_loop` / Keras' `steps_per_execution`: 1, or n > 1 steps per host "
                      "round-trip.",
    "resume": "a fresh run, or one resumed from a checkpoint at the same world size or at another one.",
}


@dataclass(frozen=True)
class Rule:
    """One refused combination: every axis named in ``when`` holds one of its listed values.

    Attributes:
      when: (axis, values) pairs, at most three axes.
      reason: why it cannot train right (one sentence).
      fix: what to set instead.
      app_only: refused only by ``hvrep train`` (the training app does not wire it), not by the replica API.
    """

    when: tuple[tuple[str, tuple[str, ...]], ...]
    reason: str
    fix: str
    app_only: bool = False

    def __post_init__(self) -> None:
        assert 1 <= len(self.when) <= 3, self.when
        for axis, values in self.when:
            assert axis in AXES and set(values) <= set(AXES[axis]), (axis, values)

    def matches(self, combo: Mapping[str, Iterable[str]]) -> bool:
        """True when ``combo`` (axis -> the values it may hold) certainly falls under this rule: every axis of
        the rule is given and each of its possible values is one the rule lists."""
        return all(axis in combo and set(combo[axis]) <= set(values) for axis, values in self.when)


_HOROVOD = ("horovod-mpi", "horovod-gloo")
_IN_GRAPH = ("local", "tpu")
_ELASTIC = ("elastic-custom", "elastic-fit")
_FIT = ("fit", "elastic-fit")

RULES: tuple[Rule, ...] = (
    Rule((("local_sgd", ("H",)), ("accumulation", ("k",))),
         "local SGD makes no gradient all-reduce to accumulate for",
         "accumulation_steps=1 (a larger per-replica batch), or local_steps=None"),
    Rule((("local_sgd", ("H",)), ("compression", ("fp16", "bf16", "powersgd"))),
         "compression compresses gradient all-reduces, which local SGD does not make; its model averages travel "
         "in the variables' own dtype",
         "compression=\"none\", or local_steps=None"),
    Rule((("local_sgd", ("H",)), ("precision", ("fp16",))),
         "local SGD hands each replica's own gradients to the loss scaler, so each replica's finite check skips "
         "its own steps and the replicas' loss scales drift apart (on in-graph backends they share one "
         "loss-scale variable that the replicas' different decisions overwrite); no reference defines that "
         "algorithm",
         "precision bf16 or fp32 with local SGD, or local_steps=None"),
    Rule((("accumulation", ("k",)), ("backend", _IN_GRAPH)),
         "the collectives cannot sit inside the conditional update of a tf.distribute replica context",
         "accumulation_steps=1 (a k-times larger per-replica batch), or the horovod backend"),
    Rule((("accumulation", ("k",)), ("loop", _FIT)),
         "hvrep.keras.DistributedOptimizer reduces and applies at every step of fit (it would ignore "
         "accumulation_steps and update every micro-batch)",
         "accumulation_steps=1 with a k-times larger batch, or a custom loop with Replicator.wrap_optimizer"),
    Rule((("compression", ("bf16",)), ("backend", _HOROVOD)),
         "Horovod cannot reduce bfloat16 tensors",
         "compression=\"fp16\" (half the bytes, works on every backend) or \"none\", or the local/tpu backend "
         "for bf16"),
    Rule((("devices_per_replica", ("k",)), ("backend", ("tpu",))),
         "a TPU replica is one core here (spanning cores needs TPUStrategy's device assignment, not built)",
         "devices_per_replica=1, or the local or horovod backend"),
    Rule((("loop", _ELASTIC), ("backend", _IN_GRAPH)),
         "only the horovod backend re-forms its world when a worker is lost or hosts change",
         "launch with horovodrun --min-np/--max-np --host-discovery-script (backend 'auto' then picks horovod)"),
    Rule((("loop", _ELASTIC), ("backend", ("horovod-mpi",))),
         "horovodrun's elastic driver starts Horovod over Gloo only",
         "horovodrun --gloo with --min-np/--max-np, or a non-elastic mpirun launch"),
    Rule((("loop", _ELASTIC), ("local_sgd", ("H",))),
         "an in-memory commit would hold only one rank's diverged model, and local SGD's round counter and "
         "outer state are not part of it",
         "local_steps=None under horovodrun's elastic driver, or a non-elastic launch"),
    # hvrep train's own limits: the replica API does these (hvrep.keras.DistributedOptimizer(opt, repl,
    # model=model) with local SGD, hvrep.keras.callbacks' elastic State in fit), the app does not wire them.
    Rule((("loop", _FIT), ("local_sgd", ("H",))),
         "hvrep train's fit loop does not build local SGD's state (your own model.fit takes it through "
         "hvrep.keras.DistributedOptimizer(opt, repl, model=model))",
         "train.loop=custom, or comm.local_steps=None", app_only=True),
    Rule((("loop", ("elastic-fit",)),),
         "hvrep train's fit loop is not elastic yet (your own model.fit is, with hvrep.keras.callbacks)",
         "train.loop=custom under horovodrun's elastic driver", app_only=True),
)


@dataclass(frozen=True)
class Reference:
    """What an accepted combination is checked against.

    Attributes:
      kind: "exact" (N replicas x B equal 1 x N*B in one process) or "simulated".
      simulation: for "simulated": which one ("" for exact).
      tolerance: the largest difference allowed, after ``steps`` few steps.
      relative: ``tolerance`` is relative to the weights' magnitude (else absolute).
    """

    kind: str
    simulation: str
    tolerance: float
    relative: bool

    def describe(self) -> str:
        what = "exact (N x B = 1 x N·B)" if self.kind == "exact" else f"simulated: {self.simulation}"
        return f"{what}, {'relative' if self.relative else 'absolute'} {self.tolerance:g}"


SIM_REPLICAS = "the same N replicas in one process, at the same precision"
SIM_POWERSGD = ("PowerSGD's Algorithm 1 (Vogels et al. 2019) on the replicas' gradients (the combination test runs "
                "it at full rank, where P^ P^T M = M: the replicas' mean; low ranks against NumPy: "
                "tests/powersgd_sim.py)")
SIM_LOCAL_SGD = "local SGD's N workers simulated in one process (Lin et al. 2018)"


def reference(combo: Mapping[str, str]) -> Reference:
    """The reference and tolerance of an accepted combination (axis -> one value; absent axes: their first).

    fp32 1e-5 absolute; fp16 (precision or compression) 2e-3 relative; bf16 1e-2 relative (issue 46's).
    """
    c = {axis: combo.get(axis, values[0]) for axis, values in AXES.items()}
    if c["local_sgd"] == "H":
        kind, sim = "simulated", SIM_LOCAL_SGD
    elif c["compression"] == "powersgd":
        kind, sim = "simulated", SIM_POWERSGD
    elif c["precision"] != "fp32" or c["compression"] in ("fp16", "bf16"):
        kind, sim = "simulated", SIM_REPLICAS
    else:
        kind, sim = "exact", ""
    if "bf16" in (c["precision"], c["compression"]):
        return Reference(kind, sim, 1e-2, True)
    if "fp16" in (c["precision"], c["compression"]):
        return Reference(kind, sim, 2e-3, True)
    return Reference(kind, sim, 1e-5, False)


def refusal(combo: Mapping[str, Iterable[str]], app: bool = False) -> Rule | None:
    """The first rule that refuses ``combo`` (axis -> the values it may hold), or None. ``app``: include the
    rules of hvrep train's own limits."""
    combo = {axis: tuple(values) for axis, values in combo.items()}
    for axis, values in combo.items():
        unknown = set(values) - set(AXES.get(axis, ()))
        assert not unknown, f"support table: {axis} has no value(s) {sorted(unknown)}"
    return next((r for r in RULES if (app or not r.app_only) and r.matches(combo)), None)


def accepted(combo: Mapping[str, str], app: bool = False) -> bool:
    """Whether a full or partial combination (axis -> one value) is accepted."""
    return refusal({a: (v,) for a, v in combo.items()}, app) is None


@dataclass(frozen=True)
class Setting:
    """One axis's value as a caller knows it.

    Attributes:
      axis: a key of :data:`AXES`.
      values: the values it may hold (one, or several where the caller cannot tell yet: "horovod" before
        Horovod says which controller it runs).
      label: how the user wrote it, for the error (``"accumulation_steps=2"``).
    """

    axis: str
    values: tuple[str, ...]
    label: str


def check(settings: Iterable[Setting], where: str, app: bool = False) -> None:
    """Raises ``ConfigError`` when the settings fall under a rule of the table.

    Args:
      settings: what the caller knows.
      where: what is being built ("CommConfig", "Replicator"), for the message; "" for none (hvrep train's
        messages start with its name already).
      app: include hvrep train's own limits.
    """
    given = {s.axis: s for s in settings}
    rule = refusal({axis: s.values for axis, s in given.items()}, app)
    if rule is None:
        return
    labels = [given[axis].label for axis, _ in rule.when]
    what = f"{labels[0]} is not supported" if len(labels) == 1 else f"{' with '.join(labels)} cannot be combined"
    raise ConfigError(f"{where + ': ' if where else ''}{what}: {rule.reason}. Fix: {rule.fix}.")


# ---- classifying a caller's values ------------------------------------------------------------------------------

def count(axis: str, n: int | None, label: str) -> Setting:
    """A counting axis (accumulation, local_sgd, devices_per_replica, steps_per_loop) from its number."""
    low, high = AXES[axis]
    return Setting(axis, (low if n is None or (axis != "local_sgd" and n <= 1) else high,), label)


def comm_settings(config: Any, prefix: str = "") -> list[Setting]:
    """The axes a ``CommConfig`` sets (``prefix``: "comm." in hvrep train's messages)."""
    return [Setting("compression", (config.compression,), f"{prefix}compression={config.compression!r}"),
            count("accumulation", config.accumulation_steps, f"{prefix}accumulation_steps={config.accumulation_steps}"),
            count("local_sgd", config.local_steps, f"{prefix}local_steps={config.local_steps}")]


def backend_setting(name: str, controller: str | None = None) -> Setting:
    """The backend axis from a backend's name; "horovod" is MPI or Gloo as ``controller`` says ("mpi", "gloo";
    None: either)."""
    if name == "horovod":
        values = (f"horovod-{controller}",) if controller else _HOROVOD
        return Setting("backend", values, f"backend='horovod'{f' (over {controller})' if controller else ''}")
    return Setting("backend", (name,), f"backend={name!r}")


# Keras optimizers whose update is linear in the gradient (for a fixed state): w -= lr * f(g) with f linear.
# SGD covers plain SGD, heavy-ball and Nesterov momentum. Any optimizer not named here is classed nonlinear
# (Adagrad, RMSprop, Adadelta, Adamax, Nadam, Ftrl, Lion, Lamb, Muon ...: they divide by or take the sign of
# gradient statistics).
LINEAR_OPTIMIZERS = ("SGD",)
ADAM_OPTIMIZERS = ("Adam", "AdamW")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under hvrep's and Keras' wrappers (DistributedOptimizer, CrossReplicaOptimizer,
    LossScaleOptimizer)."""
    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "inner_optimizer", None) or getattr(optimizer, "inner", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer, seen = inner, seen + 1
    return optimizer


def optimizer_family(optimizer: Any) -> str:
    """"linear", "lars", "adam" or "nonlinear": whether and how ``optimizer``'s update depends on the gradient
    (by its class and its bases, unwrapped)."""
    names = [c.__name__ for c in type(unwrap_optimizer(optimizer)).__mro__]
    if "LARS" in names:
        return "lars"
    if any(n in ADAM_OPTIMIZERS for n in names):
        return "adam"
    if any(n in LINEAR_OPTIMIZERS for n in names):
        return "linear"
    return "nonlinear"


def clipping(optimizer: Any) -> str:
    """"global-norm" when the optimizer (unwrapped) clips its gradients (``global_clipnorm``, ``clipnorm`` or
    ``clipvalue``), else "none"."""
    inner = unwrap_optimizer(optimizer)
    clips = any(getattr(inner, a, None) is not None for a in ("global_clipnorm", "clipnorm", "clipvalue"))
    return "global-norm" if clips else "none"


def loss_scaled(optimizer: Any) -> bool:
    """Whether ``optimizer`` or one it wraps is a Keras ``LossScaleOptimizer``."""
    seen = 0
    while optimizer is not None and seen < 8:
        if any(c.__name__ == "LossScaleOptimizer" for c in type(optimizer).__mro__):
            return True
        nxt = getattr(optimizer, "inner_optimizer", None) or getattr(optimizer, "inner", None)
        optimizer = None if nxt is optimizer else nxt
        seen += 1
    return False


def optimizer_settings(optimizer: Any, policy: str | None = None) -> list[Setting]:
    """The optimizer family, clipping and precision of a (wrapped) Keras optimizer: fp16 when a
    ``LossScaleOptimizer`` is in it, else bf16 under a ``mixed_bfloat16`` global policy (``policy``: its name)."""
    inner = unwrap_optimizer(optimizer)
    name = type(inner).__name__
    precision = "fp16" if loss_scaled(optimizer) else ("bf16" if policy == "mixed_bfloat16" else "fp32")
    return [Setting("optimizer", (optimizer_family(optimizer),), f"optimizer={name}"),
            Setting("clipping", (clipping(optimizer),), f"{name}'s clipping" if clipping(optimizer) != "none"
                    else "no clipping"),
            Setting("precision", (precision,), f"precision={precision}")]


# What the combination test can train on this project's machines (a 2-core CPU machine): no TPU, and one launch
# has one world, so a resume at another world size goes on in an in-graph Replicator, which refuses accumulation.
TESTED_BACKENDS = ("horovod-mpi", "horovod-gloo", "local")
NOT_TESTABLE: tuple[Rule, ...] = (
    Rule((("accumulation", ("k",)), ("resume", ("other-world",))),
         "the test's other world is an in-graph Replicator of one process, which refuses accumulation", ""),
)


def tested_cases() -> list[dict[str, str]]:
    """The covering array the combination test trains: :func:`pairwise_cases` over the backends it can run
    (``TESTED_BACKENDS``) less ``NOT_TESTABLE``; each case runs where its backend does (in-graph, mpirun,
    horovodrun --gloo)."""
    return pairwise_cases(fixed={"backend": TESTED_BACKENDS}, also_refuse=NOT_TESTABLE)


def all_combinations() -> Iterable[dict[str, str]]:
    """Every combination of every axis's values (for the tests: a few hundred thousand; iterate, do not list)."""
    axes = list(AXES)
    for values in itertools.product(*(AXES[a] for a in axes)):
        yield dict(zip(axes, values, strict=True))


def refused_pairs(app: bool = False) -> list[tuple[tuple[str, str], tuple[str, str], Rule]]:
    """Every pair of two axes' values that a rule naming those two axes (or one of them) refuses outright."""
    out = []
    axes = list(AXES)
    for i, a in enumerate(axes):
        for b in axes[i + 1:]:
            for va in AXES[a]:
                for vb in AXES[b]:
                    rule = refusal({a: (va,), b: (vb,)}, app)
                    if rule is not None:
                        out.append(((a, va), (b, vb), rule))
    return out


def pairwise_cases(app: bool = False, fixed: Mapping[str, Iterable[str]] | None = None,
                   also_refuse: tuple[Rule, ...] = ()) -> list[dict[str, str]]:
    """A covering array: accepted combinations such that every pair of two axes' values that some accepted
    combination holds appears in at least one case. Greedy and deterministic (AETG-like: each new case is built
    value by value, taking the value that covers the most pairs still missing, ties to the table's order).

    ``fixed``: axis -> the only values allowed there (e.g. the backends one launch can run); ``also_refuse``:
    rules of what a test cannot run there, left out like refused combinations.
    """
    axes = list(AXES)
    domain = {a: tuple(v for v in AXES[a] if not fixed or a not in fixed or v in tuple(fixed[a])) for a in axes}

    def ok(partial: dict[str, str]) -> bool:
        combo = {a: (v,) for a, v in partial.items()}
        return refusal(combo, app) is None and not any(r.matches(combo) for r in also_refuse)

    def completable(partial: dict[str, str]) -> bool:
        # Depth-first search for a full accepted combination extending `partial` (rules name <= 3 axes, so
        # this ends fast).
        rest = [a for a in axes if a not in partial]
        if not rest:
            return ok(partial)
        a = rest[0]
        return any(ok({**partial, a: v}) and completable({**partial, a: v}) for v in domain[a])

    missing = set()
    for i, a in enumerate(axes):
        for b in axes[i + 1:]:
            for va in domain[a]:
                for vb in domain[b]:
                    if ok({a: va, b: vb}) and completable({a: va, b: vb}):
                        missing.add(((a, va), (b, vb)))
    cases: list[dict[str, str]] = []
    while missing:
        seed = min(missing, key=lambda p: (axes.index(p[0][0]), AXES[p[0][0]].index(p[0][1]),
                                           axes.index(p[1][0]), AXES[p[1][0]].index(p[1][1])))
        case = {seed[0][0]: seed[0][1], seed[1][0]: seed[1][1]}
        for a in axes:
            if a in case:
                continue
            best, best_gain = None, -1
            for v in domain[a]:
                trial = {**case, a: v}
                if not ok(trial) or not completable(trial):
                    continue
                gain = sum(1 for b, vb in case.items()
                           if ((a, v), (b, vb)) in missing or ((b, vb), (a, v)) in missing)
                if gain > best_gain:
                    best, best_gain = v, gain
            assert best is not None, (case, a)
            case[a] = best
        covered = {((a, case[a]), (b, case[b])) for i, a in enumerate(axes) for b in axes[i + 1:]}
        assert covered & missing, case
        missing -= covered
        cases.append({a: case[a] for a in axes})
    return cases
