"""A real one-node Slurm cluster on localhost for the tests: Debian's slurm-wlm, started and stopped here.

    cluster = LocalSlurm(tmp_dir)      # writes slurm.conf, gres.conf, cgroup.conf into tmp_dir
    cluster.start()                    # slurmctld -D + slurmd -D as children; waits for the node to be idle
    job = cluster.sbatch(["--ntasks=2", "slurm/single_node.sbatch", "train.max_steps=4"])
    info = cluster.wait(job, timeout=180)   # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}
    cluster.stop()                     # cancels the jobs, then SIGTERM to the two daemons started here

Everything lives in the temporary folder (configuration, state, spool, logs);
the clients find it through ``SLURM_CONF`` in :attr:`LocalSlurm.env`. Nothing
needs munge or cgroups: ``auth/none``, ``cred/none``, ``proctrack/linuxproc``,
``task/none``. There is no slurmdbd, so no ``sacct``: a job is followed with
``scontrol show job -o``, which keeps finished jobs for ``MinJobAge`` seconds.

:func:`ensure_slurm` installs ``slurm-wlm`` and ``libpmix-dev`` with apt when
they are missing; it raises :class:`SlurmUnavailable` (the tests skip with its
reason) when that cannot be done: not root, no apt-get, or apt failed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

# A node with this many CPUs, whatever the machine has (SlurmdParameters=config_overrides): the
# tests ask for 2 tasks x 1 CPU, and a larger CI machine still schedules the same way.
CPUS = 2
# GPUs that exist only for the scheduler, so the scripts' `--gpus-per-node=8` is scheduled as written.
GPUS = 8
# A requeued job may start again only after the job credential's lifetime (`AuthInfo=cred_expire`,
# default 120 s); 5 s keeps the preemption test short.
CRED_EXPIRE_SEC = 5

# Variables of an enclosing launcher that would leak into the jobs (pytest itself run inside Slurm or MPI).
_LAUNCHER_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_", "PMI_", "PMIX_", "PRTE_", "HOROVOD_")

TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE",
})


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed and cannot be installed here; the message says why."""


class SlurmError(RuntimeError):
    """A Slurm command or daemon failed; the message carries its output and the daemons' logs."""


def _pmix_loadable() -> bool:
    """Whether Slurm's mpi/pmix plugin can load: it dlopen()s the unversioned libpmix.so (libpmix-dev)."""
    res = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    return any(line.strip().startswith("libpmix.so ") for line in res.stdout.splitlines())


def ensure_slurm(timeout: float = 600) -> None:
    """Installs Debian's slurm-wlm (and libpmix-dev, for srun --mpi=pmix) when they are missing.

    Raises:
      SlurmUnavailable: not root, no apt-get, or apt failed (the message ends with apt's output).
    """
    have = all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "scontrol"))
    if have and _pmix_loadable():
        return
    missing = "slurm-wlm" if not have else "libpmix-dev (Slurm's mpi/pmix plugin loads libpmix.so)"
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{missing} is not installed and installing it needs root (apt-get).")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{missing} is not installed and there is no apt-get to install it with.")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]  # another apt run may hold the lock for a while
    for cmd in (["apt-get", *lock, "update", "-q"],
                ["apt-get", *lock, "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "libpmix-dev"]):
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` took over {timeout:.0f} s.") from None
        if res.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed ({res.returncode}): {(res.stdout + res.stderr)[-1500:]}")
    if shutil.which("slurmctld") is None or not _pmix_loadable():
        raise SlurmUnavailable("apt-get installed slurm-wlm and libpmix-dev, but slurmctld or libpmix.so is missing.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mpi_default() -> str:
    """"pmix" when Slurm's PMIx plugin can load (Open MPI's direct launch under srun), else "none"."""
    return "pmix" if _pmix_loadable() else "none"


def clean_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without any launcher's variables."""
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in env.items() if not k.startswith(_LAUNCHER_PREFIXES)}


class LocalSlurm:
    """slurmctld + slurmd on 127.0.0.1, one node with :data:`CPUS` CPUs and :data:`GPUS` count-only GPUs."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**clean_env(), "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    # Set-up ---------------------------------------------------------------------------------------------

    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "dev"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=hvreptest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire={CRED_EXPIRE_SEC}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault={_mpi_default()}
MailProg=/bin/true
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# Finished jobs stay visible to `scontrol show job` (there is no accounting database).
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# Look at pending jobs every 2 s, not every 60 s: a requeued job becomes eligible on a timer, not an event.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
# SIGTERM to SIGKILL when a job is cancelled: hvrep saves within a step; the tests do not wait 30 s.
KillWait=10
InactiveLimit=0
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        # Slurm 22.05 drops a GPU without a device file ("Removing file-less GPU") and wants a character
        # device: links to /dev/null stand in. Nothing opens them (no cgroup device constraint, task/none).
        for i in range(GPUS):
            link = r / "dev" / f"gpu{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        (r / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.node} Name=gpu File={r}/dev/gpu[0-{GPUS - 1}]\n")
        # Read even with proctrack/linuxproc and task/none; nothing in it is used.
        (r / "cgroup.conf").write_text("# no cgroup plugins: proctrack/linuxproc, task/none\n")

    def start(self, timeout: float = 60) -> None:
        """Starts both daemons in the foreground mode (-D) as children; waits until the node is idle.

        Raises:
          SlurmError: a daemon exited or the node did not become idle (the daemons are stopped again).
        """
        self.write_config()
        log = self.root / "log"
        try:
            for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", self.node]):
                with open(log / f"{argv[0]}.stdout", "w") as out:
                    self._procs.append(subprocess.Popen([*argv, "-f", str(self.conf)], stdout=out,
                                                        stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                                                        start_new_session=True))
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise SlurmError(f"{p.args[0]} exited with {p.returncode} while starting.\n{self.logs()}")
            state = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        raise SlurmError(f"the node is not idle after {timeout:.0f} s (sinfo: {state!r}).\n{self.logs()}")

    def stop(self) -> None:
        """Cancels every job, then stops the daemons started here, by PID.

        A job's processes belong to slurmstepd, which outlives slurmd; jobs are cancelled and waited
        for first, and any of their processes still alive afterwards (found by this cluster's
        ``SLURM_CONF`` in their environment) are killed by PID.
        """
        if self._procs and all(p.poll() is None for p in self._procs):
            jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if jobs:
                self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                    time.sleep(1)
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self._procs.clear()
        for proc in self._job_processes():
            proc.kill()

    def _job_processes(self) -> list[psutil.Process]:
        mine = str(self.conf)
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == mine:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    # Clients --------------------------------------------------------------------------------------------

    def run(self, argv: list[str], check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        res = subprocess.run(argv, capture_output=True, text=True, env=env or self.env, cwd=cwd, timeout=timeout)
        if check and res.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stdout}{res.stderr}\n{self.logs()}")
        return res

    def sbatch(self, args: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        """Submits ``sbatch --parsable ARGS``; returns the job id."""
        res = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, StdOut, ...)."""
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        fields: dict[str, str] = {}
        for token in res.stdout.split():
            key, eq, value = token.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Polls the job until it has ended (not COMPLETING); returns its record.

        Raises:
          SlurmError: still not ended after ``timeout`` seconds; with its output and the daemons' logs.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] in TERMINAL_STATES:
                return job
            time.sleep(1)
        raise SlurmError(f"job {job_id} has not ended after {timeout:.0f} s.\n{self.describe(job_id)}")

    def describe(self, job_id: int) -> str:
        """The job's record, its output file and the daemons' logs: what a failing test prints."""
        res = self.run(["scontrol", "show", "job", str(job_id)], check=False)
        parts = [f"--- scontrol show job {job_id}\n{res.stdout}{res.stderr}"]
        out = next((t.partition("=")[2] for t in res.stdout.split() if t.startswith("StdOut=")), "")
        if out and Path(out).is_file():
            parts.append(f"--- job output {out} (last 8000 characters)\n{Path(out).read_text()[-8000:]}")
        return "\n".join([*parts, self.logs()])

    def logs(self, tail: int = 4000) -> str:
        """The daemons' log files; a daemon's own output only when it has no log file yet (it failed early)."""
        log = self.root / "log"
        paths = [log / f"{d}.log" for d in ("slurmctld", "slurmd")]
        paths = [p if p.is_file() and p.stat().st_size else p.with_suffix(".stdout") for p in paths]
        return "\n".join(f"--- {p} (last {tail} characters)\n{p.read_text(errors='replace')[-tail:]}"
                         for p in paths if p.is_file())
