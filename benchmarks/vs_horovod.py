"""Training-step throughput, hvrep's replica API vs plain Horovod, launched alternately in one run.

    python benchmarks/vs_horovod.py --hvrep default= --hvrep fuse0=fusion_threshold_bytes=0 \\
        --out results/vs_horovod.jsonl
    python benchmarks/vs_horovod.py --model small --rounds 1 --warmup 1 --steps 2   # smoke test, about a minute

Contenders (``_vs_horovod_worker.py`` holds both steps):

* ``horovod``: Horovod's own example (examples/tensorflow2/tensorflow2_synthetic_benchmark.py)
  on legacy Keras: ``TF_USE_LEGACY_KERAS=1``, ``tf.keras.applications.ResNet50``,
  ``tf.keras.optimizers.SGD(0.01, momentum=0.9)``, ``hvd.DistributedGradientTape``
  in a ``tf.function``, ``hvd.broadcast_variables`` after the first step, and
  Horovod's stock settings (no ``HOROVOD_*`` variable reaches it, nor
  ``OMPI_MCA_mpi_yield_when_idle``: Open MPI busy-polls, as it does for a
  user who launches with ``mpirun`` and sets nothing). It runs in
  a separate interpreter that has tf_keras: a venv under hvrep's cache folder
  (``~/.cache/hvrep/legacy-keras-venv-tf<V>-tfkeras<V>-<hash of this venv's site-packages>``), created on first
  use, whose site-packages also lists this venv's (a ``.pth`` file), so
  TensorFlow, Horovod and mpi4py are the very same files; only tf_keras is
  installed there. Nothing is installed into this venv.
* ``horovod-keras3`` (with ``--horovod-keras3``): the same Horovod step on
  Keras 3, in this venv: the framework hvrep runs on, without hvrep.
* ``hvrep:NAME``, one per ``--hvrep NAME=k=v,k=v``: hvrep's step on Keras 3
  (``Replicator(config=CommConfig(k=v, ...))``, model and optimizer in
  ``scope()``, ``hvrep.all_reduce(grads, "mean")``, ``Replicator.run``).
  ``--hvrep default=`` is ``CommConfig()`` as it is (the record shows its
  fields). ``fusion_threshold_bytes`` is hvrep's own bucket size (0: one
  collective per tensor); Horovod's fusion buffer is
  ``horovod_fusion_threshold_bytes`` (None: Horovod's stock value, as for the
  ``horovod`` contender). Two keys are not CommConfig fields:
  ``batch_norm=keras`` is ``Replicator(batch_norm="keras")`` (Keras 3's own
  batch-norm ops inside ``run``; default ``fused``, the Replicator's
  default: TensorFlow's fused kernel), and ``bn=fused`` builds the model as
  ``hvrep.models.with_fused_batch_norm(model)`` (``bn=keras``, the default,
  leaves the ``keras.applications`` model as it is). Without ``--hvrep``:
  ``default=`` alone.

Every launch is one contender on ``--np`` ranks (``--launcher mpirun``, the
default: ``mpirun --bind-to none``, oversubscribed, ``python -m mpi4py``,
Horovod's MPI controller; ``--launcher horovodrun``: ``horovodrun --gloo -H
localhost:N``, Horovod's Gloo controller, no MPI, the barrier and gather
around the timed loop over Horovod's own collectives), each rank with ``--threads-per-rank``
TensorFlow intra- and inter-op threads, the same synthetic in-memory batch
per rank for every contender. In a launch: one untimed first step (tracing;
Horovod's broadcast), ``--warmup`` untimed steps, a barrier, ``--steps``
timed steps, each timed until the rank holds its loss. A launch's images/s is
every rank's images over the slowest rank's timed loop; its best-step images/s
is one step's images over its fastest timed step (the slowest rank's time),
the figure least disturbed by other processes on a shared machine (the
summary prints the load average when each launch started).

Alternation: round r runs every contender once, the order rotated by r, so
that each contender takes each position and load drifting over the run hits
all alike; the ratio hvrep/horovod is taken per round (launches minutes apart
at most) and of the medians over rounds. A ratio above 1 means hvrep is
faster. A launch that fails or passes ``--timeout`` is recorded with its
error text and the run goes on; the exit code is then 1.

Every launch imports hvrep afresh: its record carries the checkout's commit
and modified files (``source``), and the summary warns when they changed
during the run.

Output: one JSON line per launch as it ends (``record: "launch"``), then one
per contender (``record: "summary"``), all appended to ``--out`` with one
``run_id``; a table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hvrep
from hvrep import _env
from hvrep.cluster import launch
from hvrep.errors import ConfigError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before _common.environment() imports TensorFlow

# Benchmarks run as scripts: their folder holds the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_jsonl, fmt_ratio, percentiles, ratio
from _common import environment as common_environment
from _common import run_id as new_run_id
from _vs_horovod_worker import BATCH_NORMS, MODELS, RESULT_PREFIX

WORKER = Path(__file__).resolve().parent / "_vs_horovod_worker.py"
HOROVOD = "horovod"
HOROVOD_KERAS3 = "horovod-keras3"
HVREP_PREFIX = "hvrep:"
DEFAULT_IMAGE_SIZE = {"resnet50": 224, "small": 32}
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Not passed to any launch: Horovod's knobs (the horovod contender runs at its stock settings; hvrep's come
# from its CommConfig), a parent launcher's rank variables, and how Open MPI waits (hvrep's CommConfig sets it
# in its own process; plain Horovod runs with Open MPI's stock busy polling, as its users launch it).
_STRIPPED_PREFIXES = ("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_", "OMPI_MCA_mpi_yield_when_idle")
LEGACY_KERAS = "TF_USE_LEGACY_KERAS"
TF_NUM_INTRAOP_THREADS = "TF_NUM_INTRAOP_THREADS"
TF_NUM_INTEROP_THREADS = "TF_NUM_INTEROP_THREADS"
_ERROR_TAIL = 3000  # characters of a failed launch's output kept in its record


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way to run the step: ``horovod``, ``horovod-keras3``, or hvrep with the CommConfig ``comm_config``
    (keyword arguments), the model's batch-norm layers ``batch_norm`` ("keras": as built; "fused":
    ``with_fused_batch_norm``) and ``Replicator(batch_norm=replicator_batch_norm)``."""

    name: str
    kind: str  # "horovod", "horovod-keras3" or "hvrep"
    comm_config: dict[str, Any] | None = None
    batch_norm: str = "keras"
    replicator_batch_norm: str = "fused"


# --- --hvrep NAME=k=v,k=v ---------------------------------------------------------------------

def _coerce(field: dataclasses.Field, text: str) -> Any:
    """``text`` as a value of CommConfig's ``field``, by its annotation ("int", "float | None", "bool", "str")."""
    kind = str(field.type)
    if "None" in kind and text.lower() == "none":
        return None
    if kind.startswith("bool"):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--hvrep {field.name}={text!r}: expected true or false.")
    try:
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise ConfigError(f"--hvrep {field.name}={text!r}: expected {kind}.") from None
    return text


def parse_hvrep(spec: str) -> Contender:
    """``NAME=k=v,k=v`` (``NAME=`` for CommConfig()) as a contender, validated by CommConfig itself.

    Raises:
      hvrep.errors.ConfigError: no name, a bad name, an unknown field or value.
    """
    name, sep, rest = spec.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise ConfigError(f"--hvrep {spec!r} is not NAME=k=v,k=v (NAME of letters, digits, _ . -). "
                          "Fix: e.g. --hvrep default= or --hvrep fuse0=fusion_threshold_bytes=0.")
    fields = {f.name: f for f in dataclasses.fields(hvrep.CommConfig)}
    kwargs: dict[str, Any] = {}
    norms = {"bn": "keras", "batch_norm": "fused"}  # the model's layers; Replicator(batch_norm=...)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key in norms and eq:
            if value not in BATCH_NORMS:
                raise ConfigError(f"--hvrep {spec!r}: {key}={value!r} is not one of {', '.join(BATCH_NORMS)}. "
                                  f"Fix: {key}=fused or {key}=keras.")
            norms[key] = value
            continue
        if not eq or key not in fields:
            raise ConfigError(f"--hvrep {spec!r}: {item!r} is not FIELD=VALUE with a CommConfig field. "
                              f"Fix: use one of {', '.join(fields)}.")
        kwargs[key] = _coerce(fields[key], value)
    hvrep.CommConfig(**kwargs)  # its own validation, its own message
    return Contender(HVREP_PREFIX + name, "hvrep", kwargs, norms["bn"], norms["batch_norm"])


# --- the legacy-Keras interpreter -------------------------------------------------------------

def _tensorflow_version() -> str:
    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ConfigError(f"TensorFlow is not installed for {sys.executable}. Fix: run `make setup`.")


def legacy_keras_python(tf_version: str) -> Path:
    """The Python of a venv with tf_keras beside this venv's packages; created on first use.

    The venv holds tf_keras only; a ``.pth`` file lists this venv's
    site-packages, so TensorFlow and the Horovod built against it are shared,
    not installed twice. It is keyed by the versions and by the site-packages
    it shares (a venv made from one checkout's ``.venv`` imports nothing once
    that checkout is gone), and marked ready only once it imports ``tf.keras``
    as tf_keras, so a half-built one is rebuilt.
    """
    shared = sysconfig.get_path("purelib")
    tag = hashlib.sha256(shared.encode()).hexdigest()[:10]
    root = _env.cache_dir() / f"legacy-keras-venv-tf{tf_version}-tfkeras{tf_version}-{tag}"
    python, ready = root / "bin" / "python", root / ".hvrep-ready"
    root.parent.mkdir(parents=True, exist_ok=True)
    # One creator at a time (two benchmarks, or two test workers, starting on a fresh cache): the others wait for
    # it here and then find the venv ready, instead of deleting it under each other.
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (ready.is_file() and python.exists() and json.loads(ready.read_text()).get("shares") == shared):
            _create_legacy_venv(root, tf_version, shared)
    return python


def _create_legacy_venv(root: Path, tf_version: str, shared: str) -> None:
    python, ready = root / "bin" / "python", root / ".hvrep-ready"
    if root.exists():
        shutil.rmtree(root)
    # This venv's own base interpreter: the shared packages are built for its version.
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    print(f"vs_horovod: creating the legacy-Keras venv {root} (once)", flush=True)
    _run_checked([str(base), "-m", "venv", str(root)], "create the venv")
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    (site / "hvrep_shared_site_packages.pth").write_text(shared + "\n")
    # --no-deps: tf_keras requires tensorflow, which the .pth already provides.
    _run_checked([str(python), "-m", "pip", "install", "--no-deps", "--quiet", f"tf_keras=={tf_version}"],
                 f"install tf_keras=={tf_version} (its version must match TensorFlow's)")
    check = ("import tensorflow as tf, horovod.tensorflow, mpi4py; "
             "assert tf.keras.optimizers.SGD.__module__.startswith('tf_keras'), tf.keras.optimizers.SGD.__module__")
    _run_checked([str(python), "-c", check], "import tf.keras as tf_keras with Horovod",
                 env={**os.environ, LEGACY_KERAS: "1", "TF_CPP_MIN_LOG_LEVEL": "2"})
    ready.write_text(json.dumps({"tensorflow": tf_version, "tf_keras": tf_version, "shares": shared}) + "\n")


def _run_checked(argv: list[str], what: str, env: Mapping[str, str] | None = None) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        raise ConfigError(f"could not {what}: `{shlex.join(argv)}` exited {res.returncode}:\n"
                          f"{(res.stdout + res.stderr)[-2000:]}\nFix: the error above; then run again "
                          "(the half-built venv is replaced).")


# --- launches ---------------------------------------------------------------------------------

def round_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """Round r runs every contender once, the list rotated left by r."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


def launch_env(contender: Contender, base: Mapping[str, str], threads: int, launcher: str = "mpirun"
               ) -> dict[str, str]:
    """The environment of one launch: ``base`` less Horovod's knobs and rank variables, plus the thread caps.

    Under horovodrun the legacy-Keras switch is not in it: horovodrun imports Horovod's TensorFlow module
    itself, in this venv, which has no tf_keras; ``launch_argv`` puts it on the ranks' command instead."""
    env = {k: v for k, v in base.items() if not k.startswith(_STRIPPED_PREFIXES) and k != LEGACY_KERAS}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[TF_NUM_INTRAOP_THREADS] = env[TF_NUM_INTEROP_THREADS] = str(threads)
    if contender.kind == HOROVOD:
        if launcher != "horovodrun":
            env[LEGACY_KERAS] = "1"
        # mpi4py looks for libmpi beside the running venv's prefix; the legacy
        # venv has none, so point it at the one Horovod was built against.
        env["MPI4PY_LIBMPI"] = str(Path(sys.prefix) / "lib" / "libmpi.so.40")
    return env


def launch_argv(contender: Contender, python: str, args: argparse.Namespace, environ: Mapping[str, str]
                ) -> list[str]:
    """``mpirun -np N --bind-to none --map-by slot:OVERSUBSCRIBE ... python -m mpi4py worker ...``, or with
    ``--launcher horovodrun``, ``horovodrun -np N -H localhost:N --gloo python worker ... --ranks-via horovod``
    (pure)."""
    command = [python, str(WORKER), "--contender", contender.kind, "--model", args.model, "--batch",
               str(args.batch), "--image-size", str(args.image_size), "--warmup", str(args.warmup), "--steps",
               str(args.steps), "--seed", str(args.seed)]
    if contender.comm_config is not None:
        command += ["--comm-config", json.dumps(contender.comm_config), "--batch-norm", contender.batch_norm,
                    "--replicator-batch-norm", contender.replicator_batch_norm]
    if args.launcher == "horovodrun":
        legacy = ("env", f"{LEGACY_KERAS}=1") if contender.kind == HOROVOD else ()
        spec = launch.LaunchSpec(np=args.np, command=(*legacy, *command, "--ranks-via", "horovod"),
                                 launcher="horovodrun", gloo=True)
    else:
        spec = launch.LaunchSpec(np=args.np, command=tuple(command), launcher="mpirun", overcommit=True,
                                 allow_run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    return launch.build_argv(spec, environ)


def _stop(proc: subprocess.Popen) -> None:
    """Ends a launch that ran out of time: mpirun and its ranks (its own session) get SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


# The worker's result line, as mpirun passes it on, or behind horovodrun's "[0]<stdout>:" prefix.
_RESULT_LINE = re.compile(r"^(\[\d+\]<stdout>:)?" + re.escape(RESULT_PREFIX))


def run_launch(argv: list[str], env: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """Runs one launch; returns its worker result, or the error with the output's tail."""
    argv = [launch.find_launcher(argv[0], env), *argv[1:]]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
        out, err = proc.communicate()
    wall = time.perf_counter() - start
    results = [json.loads(line.split(RESULT_PREFIX, 1)[1]) for line in out.splitlines()
               if _RESULT_LINE.match(line)]
    record: dict[str, Any] = {"argv": argv, "returncode": proc.returncode, "timed_out": timed_out, "wall_s": wall}
    if proc.returncode == 0 and len(results) == 1 and not timed_out:
        return {**record, "ok": True, "error": None, "result": results[0]}
    why = (f"timed out after {timeout_s:.0f} s" if timed_out else
           f"exit code {proc.returncode}" if proc.returncode else f"{len(results)} result lines, expected 1")
    tail = (f"--- stderr ---\n{err}\n--- stdout ---\n{out}")[-_ERROR_TAIL:]
    return {**record, "ok": False, "error": f"{why}\n{tail}", "result": None}


def source_state() -> dict[str, Any] | None:
    """The checkout's commit and whether it has changes: hvrep is imported afresh by every launch, so an edit
    or a commit landing during a run changes what later launches measure. None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0 or status.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "modified_files": sorted(line[3:] for line in status.stdout.splitlines())}


# --- summary ----------------------------------------------------------------------------------

def _slowest_step_ms(result: dict[str, Any]) -> list[float]:
    """Per timed step, the slowest rank's time, in ms."""
    per_rank = [r["step_s"] for r in result["per_rank"]]
    return [1e3 * max(step) for step in zip(*per_rank, strict=True)]


def summarize(contenders: Sequence[Contender], launches: Sequence[dict[str, Any]], rounds: int
              ) -> list[dict[str, Any]]:
    """One record per contender: images/s over rounds (median, min, max) and its ratio to horovod's."""
    ips = {c.name: [None] * rounds for c in contenders}
    firsts: dict[str, list[float]] = {c.name: [] for c in contenders}
    best: dict[str, list[float]] = {c.name: [] for c in contenders}
    for rec in launches:
        if rec["ok"]:
            ips[rec["contender"]][rec["round"]] = rec["images_per_sec"]
            firsts[rec["contender"]].append(max(r["first_step_s"] for r in rec["result"]["per_rank"]))
            best[rec["contender"]].append(rec["best_step_images_per_sec"])
    out = []
    for c in contenders:
        mine = ips[c.name]
        ok = [v for v in mine if v is not None]
        rec: dict[str, Any] = {
            "record": "summary", "contender": c.name, "kind": c.kind, "comm_config": c.comm_config,
            "rounds": rounds, "rounds_ok": len(ok),
            "images_per_sec": ({"median": statistics.median(ok), "min": min(ok), "max": max(ok), "per_round": mine}
                               if ok else None),
            # The fastest single step of every round: the least disturbed by other load on a shared machine.
            "best_step_images_per_sec": max(best[c.name]) if best[c.name] else None,
            "first_step_s_median": statistics.median(firsts[c.name]) if firsts[c.name] else None,
            "errors": [r["error"] for r in launches if r["contender"] == c.name and not r["ok"]],
            "loadavg_at_launches": [r["result"]["worker_env"]["loadavg_before"][0] for r in launches
                                    if r["contender"] == c.name and r["ok"]],
            "vs_horovod": None,
        }
        base = ips.get(HOROVOD)
        if c.kind != HOROVOD and base is not None:
            per_round = [a / b if a is not None and b is not None else None for a, b in zip(mine, base, strict=True)]
            pairs = [(a, b) for a, b in zip(mine, base, strict=True) if a is not None and b is not None]
            both = [r for r in per_round if r is not None]
            rec["vs_horovod"] = {
                "what": "images/s this contender / horovod (> 1: faster than horovod), over the rounds where both ran",
                "per_round": per_round,
                "min": min(both) if both else None, "max": max(both) if both else None,
                **(ratio([a for a, _ in pairs], [b for _, b in pairs]) or {}),
            }
        out.append(rec)
    return out


def _print_summary(summaries: Sequence[dict[str, Any]], orders: Sequence[Sequence[str]], config: dict[str, Any],
                   out: Path, run_id: str) -> None:
    launcher = "horovodrun --gloo" if config.get("launcher") == "horovodrun" else "mpirun"
    print(f"\nvs_horovod {run_id}: {config['model']} {config['image_size']} px, {config['ranks']} ranks "
          f"({launcher}) x batch "
          f"{config['per_rank_batch']}, {config['threads_per_rank']} TF thread(s) per rank; {config['rounds']} "
          f"round(s) of 1 first + {config['warmup']} warm-up + {config['steps']} timed steps per launch")
    for r, order in enumerate(orders):
        print(f"  round {r + 1} order: {', '.join(order)}")
    header = (f"{'contender':<20} {'images/s median [min-max]':<28} {'ok':>5} {'best step':>9} {'first step s':>12}  "
              f"{'vs horovod: of medians [p10-p90]':<34} per round")
    print(header)
    print("-" * len(header))
    for s in summaries:
        ips = s["images_per_sec"]
        spread = f"{ips['median']:.3f} [{ips['min']:.3f}-{ips['max']:.3f}]" if ips else "FAILED"
        first = f"{s['first_step_s_median']:.1f}" if s["first_step_s_median"] is not None else "-"
        best = f"{s['best_step_images_per_sec']:.3f}" if s["best_step_images_per_sec"] is not None else "-"
        vs = s["vs_horovod"]
        rounds = " ".join("-" if x is None else f"{x:.3f}" for x in vs["per_round"]) if vs else ""
        print(f"{s['contender']:<20} {spread:<28} {s['rounds_ok']:>2}/{s['rounds']:<2} {best:>9} {first:>12}  "
              f"{fmt_ratio(vs if vs and 'of_medians' in vs else None):<34} {rounds}")
    print("ratios: images/s hvrep / horovod, > 1 means hvrep is faster; 'best step': images/s of the fastest "
          "timed step of all rounds; 'first step' traces (and, for horovod, broadcasts).")
    loads = [load for s in summaries for load in s["loadavg_at_launches"]]
    if loads:
        cpus = os.cpu_count() or 1
        # The 1-minute average still counts the previous launch's ranks, about one per thread.
        own = config["ranks"] * config["threads_per_rank"]
        print(f"load average (1 min) when launches started: {min(loads):.1f}-{max(loads):.1f} on {cpus} CPUs, "
              f"about {own} of it the previous launch's ranks"
              + (": other processes competed for the CPUs, expect noisy ratios" if max(loads) > cpus + own else ""))
    for s in summaries:
        for e in s["errors"]:
            print(f"{s['contender']} FAILED: {e.splitlines()[0]}")
    print(f"appended to {out}")


# --- main -------------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hvrep", action="append", default=[], metavar="NAME=k=v,k=v",
                   help="an hvrep contender with CommConfig(k=v, ...); repeatable (default: default=)")
    p.add_argument("--horovod-keras3", action="store_true",
                   help="also run Horovod's step on Keras 3 (tells Keras 3's cost from hvrep's)")
    p.add_argument("--rounds", type=int, default=3, help="alternations: every contender once per round (default 3)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per launch (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first, tracing one (default 2)")
    p.add_argument("--batch", type=int, default=8, help="per-rank batch (default 8)")
    p.add_argument("--image-size", type=int, default=None, help="pixels (default: 224 for resnet50, 32 for small)")
    p.add_argument("--model", choices=MODELS, default="resnet50", help="small: a 3-conv CNN for smoke tests")
    p.add_argument("--np", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--launcher", choices=("mpirun", "horovodrun"), default="mpirun",
                   help="mpirun (Horovod's MPI controller; default) or horovodrun --gloo (its Gloo controller)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="TF intra- and inter-op threads (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one launch may take (default 1800)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/vs_horovod.jsonl"),
                   help="JSON lines file to append to; its folder is created (default results/vs_horovod.jsonl)")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "batch", "np", "threads_per_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0 (the untimed first step comes anyway), got {args.warmup}.")
    if args.timeout <= 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout}.")
    args.image_size = args.image_size or DEFAULT_IMAGE_SIZE[args.model]
    try:
        hvreps = [parse_hvrep(s) for s in args.hvrep or ["default="]]
    except ConfigError as e:
        p.error(str(e))
    names = [c.name for c in hvreps]
    if len(set(names)) != len(names):
        p.error(f"--hvrep names must differ, got {', '.join(names)}.")
    args.contenders = [Contender(HOROVOD, HOROVOD), *([Contender(HOROVOD_KERAS3, HOROVOD_KERAS3)]
                                                      if args.horovod_keras3 else []), *hvreps]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        legacy_python = legacy_keras_python(_tensorflow_version())
    except ConfigError as e:
        print(f"vs_horovod: error: {e}", file=sys.stderr)
        return 2
    contenders: list[Contender] = args.contenders
    by_name = {c.name: c for c in contenders}
    python = {HOROVOD: str(legacy_python), HOROVOD_KERAS3: sys.executable, "hvrep": sys.executable}
    base_env = _env.environ_snapshot()
    stripped = sorted(k for k in base_env if k.startswith(_STRIPPED_PREFIXES))
    run_id = new_run_id()
    env = {**common_environment(), "legacy_keras_python": str(legacy_python), "variables_not_passed": stripped,
           "loadavg_start": list(os.getloadavg())}
    orders = round_orders([c.name for c in contenders], args.rounds)
    config = {
        "model": args.model, "image_size": args.image_size, "ranks": args.np, "launcher": args.launcher,
        "per_rank_batch": args.batch,
        "global_batch": args.np * args.batch, "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
        "first_steps": 1, "threads_per_rank": args.threads_per_rank, "seed": args.seed, "timeout_s": args.timeout,
        "contenders": [dataclasses.asdict(c) for c in contenders], "orders": orders, "data": "synthetic, in memory",
        "schedule": "round r runs every contender once, the order rotated left by r",
        "timing": "per launch: 1 untimed first step, warmup untimed steps, barrier, steps timed steps each read "
                  "back; images/s = ranks x batch x steps / the slowest rank's timed loop",
    }
    launches: list[dict[str, Any]] = []
    total = args.rounds * len(contenders)
    for r, order in enumerate(orders):
        for pos, name in enumerate(order):
            c = by_name[name]
            lenv = launch_env(c, base_env, args.threads_per_rank, args.launcher)
            source = source_state()
            outcome = run_launch(launch_argv(c, python[c.kind], args, lenv), lenv, args.timeout)
            result = outcome["result"]
            rec = {"benchmark": "vs_horovod", "record": "launch", "run_id": run_id, "round": r, "position": pos,
                   "order": order, "contender": name, "kind": c.kind, "comm_config": c.comm_config,
                   "images_per_sec": result["images_per_sec"] if result else None,
                   "step_ms": percentiles(_slowest_step_ms(result)) if result else None,
                   "best_step_images_per_sec": (args.np * args.batch / (min(_slowest_step_ms(result)) / 1e3)
                                                if result else None),
                   **outcome, "source": source, "config": config, "env": env}
            launches.append(rec)
            append_jsonl(args.out, [rec])
            done = f"{rec['images_per_sec']:.3f} images/s" if rec["ok"] else f"FAILED ({rec['error'].splitlines()[0]})"
            print(f"[{len(launches)}/{total}] round {r + 1} #{pos + 1} {name}: {done}, launch {rec['wall_s']:.0f} s",
                  flush=True)
    summaries = [{"benchmark": "vs_horovod", "run_id": run_id, **s, "config": config, "env": env}
                 for s in summarize(contenders, launches, args.rounds)]
    append_jsonl(args.out, summaries)
    _print_summary(summaries, orders, config, args.out, run_id)
    sources = {json.dumps(r["source"], sort_keys=True) for r in launches}
    if len(sources) > 1:
        print(f"WARNING: the checkout changed during the run ({len(sources)} states: commits or edits); the "
              "launches' 'source' fields say which launch ran which.")
    return 0 if all(r["ok"] for r in launches) else 1


if __name__ == "__main__":
    sys.exit(main())
