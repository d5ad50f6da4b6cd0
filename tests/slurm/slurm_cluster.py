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

import contextlib
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


def _cgroup_v2() -> bool:
    """Whether this machine's /sys/fs/cgroup is the cgroup v2 (unified) hierarchy."""
    return subprocess.run(
        ["stat", "-f", "-c", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip() == "cgroup2fs"


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


def write_config(root: Path, controller: tuple[str, str], nodes: list[tuple[str, str]], cpus: int = CPUS,
                 partitions: dict[str, list[str]] | None = None, extra: str = "") -> None:
    """Writes slurm.conf, gres.conf and cgroup.conf into ``root`` (and its state/spool/log/dev folders).

    Args:
      controller: slurmctld's (host name, address).
      nodes: every slurmd's (NodeName, NodeAddr); each gets :data:`GPUS` count-only GPUs and ``cpus`` CPUs.
      partitions: {name: node names}; the first is the default. None: one partition ``debug`` of every node.
      extra: lines appended to slurm.conf before the nodes.
    """
    r = root
    names = [name for name, _ in nodes]
    # %n: each slurmd's own spool folder, pid and log file (several slurmds share this folder).
    per_node = "-%n" if len(nodes) > 1 else ""
    spools = [f"{d}-{name}" for name in names for d in ("spool", "tmp")] if per_node else ["spool"]
    spools = spools if per_node else [*spools, "tmp"]
    for d in ("state", "log", "dev", *spools):
        (r / d).mkdir(parents=True, exist_ok=True)
    partitions = partitions or {"debug": names}
    node_lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory=1000 Gres=gpu:{GPUS} "
                         "State=UNKNOWN\n" for name, addr in nodes)
    part_lines = "".join(f"PartitionName={p} Nodes={'ALL' if members == names else ','.join(members)} "
                         f"Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP\n"
                         for i, (p, members) in enumerate(partitions.items()))
    (r / "slurm.conf").write_text(f"""\
ClusterName=hvreptest
SlurmctldHost={controller[0]}({controller[1]})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire={CRED_EXPIRE_SEC}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool{per_node}
# The mpi/pmix plugin makes its client folders (spmix_appdir_<uid>_<job>.<step>) in TmpFS, /tmp by default: a
# predictable path where a folder left by a killed run of another cluster (job ids restart at 1) stops the step
# ("Cannot create directory ... File exists"). Each cluster, and each host of a bed, gets its own.
TmpFS={r}/tmp{per_node}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd{per_node}.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd{per_node}.log
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
{extra}{node_lines}{part_lines}""")
    # Slurm 22.05 drops a GPU without a device file ("Removing file-less GPU") and wants a character
    # device: links to /dev/null stand in. Nothing opens them (no cgroup device constraint, task/none).
    for i in range(GPUS):
        link = r / "dev" / f"gpu{i}"
        if not link.is_symlink():
            link.symlink_to("/dev/null")
    (r / "gres.conf").write_text("AutoDetect=off\n" + "".join(
        f"NodeName={name} Name=gpu File={r}/dev/gpu[0-{GPUS - 1}]\n" for name in names))
    # Read even with proctrack/linuxproc and task/none; nothing in it is used.
    (r / "cgroup.conf").write_text("# no cgroup plugins: proctrack/linuxproc, task/none\n")


class LocalSlurm:
    """slurmctld + slurmd on 127.0.0.1, one node with :data:`CPUS` CPUs and :data:`GPUS` count-only GPUs."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**clean_env(), "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []  # slurmctld first, then the slurmds
        self.node_count = 1

    # Set-up ---------------------------------------------------------------------------------------------

    def write_config(self) -> None:
        write_config(self.root, controller=(self.node, "127.0.0.1"), nodes=[(self.node, "127.0.0.1")])

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

    def __enter__(self) -> LocalSlurm:
        """Starts the cluster (:meth:`start`); leaving the block stops it, also after an error."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise SlurmError(f"{p.args[0]} exited with {p.returncode} while starting.\n{self.logs()}")
            state = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
            if state.split() == ["idle"] * self.node_count:
                return
            time.sleep(0.5)
        raise SlurmError(f"the nodes are not idle after {timeout:.0f} s (sinfo: {state!r}).\n{self.logs()}")

    def stop(self) -> None:
        """Cancels every job, then stops the daemons started here, by PID.

        A job's processes belong to slurmstepd, which outlives slurmd; jobs are cancelled and waited
        for first, and any of their processes still alive afterwards (found by this cluster's
        ``SLURM_CONF`` in their environment) are killed by PID.
        """
        if self._procs and self._procs[0].poll() is None:  # slurmctld answers
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


class BedSlurm(LocalSlurm):
    """A Slurm cluster on the hosts of an :class:`hvrep.cluster.netbed.NetBed`: slurmctld on ``h1``, a slurmd on
    every host (``h1`` ... ``hN``, each its own NodeName, NodeAddr, spool folder, pid and log file).

        cluster = BedSlurm(tmp_dir, hosts=2, link_gbit=1.0)
        cluster.start()              # the bed, then slurmctld and the slurmds, each in its host's namespace
        job = cluster.sbatch(["--nodes=2", "slurm/multi_node.sbatch", ...])
        cluster.bed.counters()       # bytes through each host's shaped link
        cluster.kill_host("h2")      # a node crash: every process in h2's namespace, slurmd included
        cluster.stop()               # cancels the jobs, stops the daemons, removes the bed

    Each daemon runs under :meth:`NetBed.argv_on`: in its host's network namespace, with the host's name
    (a UTS namespace) and the bed's /etc/hosts, so slurmd and everything it starts (slurmstepd, the
    ranks) are on that host; the jobs' ranks reach each other over the shaped ``hv0`` links only. The
    clients (sbatch, scontrol, ...) run on ``h1``, where slurmctld listens; the jobs' environment is the
    bed's (:meth:`NetBed.env`: Open MPI and Gloo on ``hv0``). Same authentication as :class:`LocalSlurm`
    (``auth/none``, ``cred/none``), same process tracking (``proctrack/linuxproc``, which reads /proc and
    works in any namespace, where ``proctrack/cgroup`` would need a cgroup tree per slurmd).
    """

    CONTROLLER = "h1"

    def __init__(self, root: Path, hosts: int = 2, link_gbit: float | None = 1.0, cpus: int = CPUS,
                 partitions: dict[str, list[str]] | None = None, slurmd_timeout: int = 10) -> None:
        from hvrep.cluster.netbed import NetBed

        super().__init__(root)
        self.bed = NetBed(hosts, link_gbit)
        self.node = self.CONTROLLER
        self.node_count = hosts
        self.cpus = cpus
        self.partitions = partitions
        self.slurmd_timeout = slurmd_timeout
        self.slurmds: dict[str, subprocess.Popen] = {}

    def write_config(self) -> None:
        bed = self.bed
        # SlurmdTimeout: a host that stops answering is DOWN after this long (its jobs are requeued or end with
        # NODE_FAIL); Slurm's default, 300 s, is for real machines.
        write_config(self.root, controller=(self.CONTROLLER, bed.address(self.CONTROLLER)),
                     nodes=[(h, bed.address(h)) for h in bed.hosts], cpus=self.cpus, partitions=self.partitions,
                     extra=f"SlurmdTimeout={self.slurmd_timeout}\n")

    def start(self, timeout: float = 60) -> None:
        """Brings the bed up, then slurmctld on h1 and a slurmd on every host; waits until every node is idle.

        Raises:
          SlurmError: a daemon exited or a node did not become idle (the daemons and the bed are removed again).
        """
        from hvrep.cluster.netbed import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise SlurmUnavailable(f"no namespace hosts for a Slurm cluster: {reason}")
        try:
            self.bed.up()
            self.env = self.bed.env({**clean_env(), "SLURM_CONF": str(self.conf)})
            self.write_config()
            self._procs.append(self._daemon(self.CONTROLLER, ["slurmctld", "-D", "-i"], "slurmctld"))
            for host in self.bed.hosts:
                self.start_slurmd(host)
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _daemon(self, host: str, argv: list[str], name: str) -> subprocess.Popen:
        # `ip netns exec` mounts a fresh /sys for the namespace, with nothing on /sys/fs/cgroup, and slurmd
        # 22.05 initialises its cgroup plugin even with proctrack/linuxproc and task/none ("No filesystem mounted
        # on /sys/fs/cgroup"; then "can't stat /sys/fs/cgroup/systemd/"). An empty tmpfs there with the existing
        # name=systemd hierarchy mounted on it (cgroup v1, as this machine has), in the daemon's own mount
        # namespace, satisfies it; nothing is created in either. `ip netns exec`, `unshare`, bash and sh each exec
        # the next: the Popen's pid is the daemon's.
        cgroup = ("mount -t tmpfs -o size=1m,mode=755 cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
                  "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd")
        if _cgroup_v2():  # a machine with the unified hierarchy only (not tried here: this machine has v1)
            cgroup = "mount -t cgroup2 none /sys/fs/cgroup"
        wrapped = ["/bin/sh", "-c", f'{cgroup} && exec "$@"', "sh", *argv, "-f", str(self.conf)]
        with open(self.root / "log" / f"{name}.stdout", "w") as out:
            return subprocess.Popen(self.bed.argv_on(host, wrapped), stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env, cwd=self.root, start_new_session=True)

    def start_slurmd(self, host: str) -> None:
        """Starts ``host``'s slurmd (again, after :meth:`kill_host`); with ReturnToService=2 its node comes back."""
        proc = self._daemon(host, ["slurmd", "-D", "-N", host], f"slurmd-{host}")
        self.slurmds[host] = proc
        self._procs.append(proc)

    def kill_host(self, host: str) -> list[int]:
        """A crash of ``host``: SIGKILL to every process in its namespace (slurmd, slurmstepd, the ranks); returns
        their pids. slurmctld marks the node DOWN once it has not answered for SlurmdTimeout seconds."""
        ns = self.bed.namespace(host)
        killed: list[int] = []
        for _ in range(3):  # a process may fork while the others die
            res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True)
            pids = [int(p) for p in res.stdout.split() if p.isdigit() and int(p) != os.getpid()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += pids
            time.sleep(0.2)
        if host in self.slurmds:
            self.slurmds[host].wait(timeout=10)
        return killed

    def run(self, argv: list[str], check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """A client command (sbatch, scontrol, ...), run on h1 where slurmctld listens."""
        return super().run(self.bed.argv_on(self.CONTROLLER, argv), check=check, timeout=timeout, env=env, cwd=cwd)

    def stop(self) -> None:
        """Cancels every job, stops the daemons, then removes the bed (which kills whatever is left in it)."""
        try:
            super().stop()
        finally:
            self.bed.down()

    def logs(self, tail: int = 4000) -> str:
        log = self.root / "log"
        paths = [log / "slurmctld.log", *(log / f"slurmd-{h}.log" for h in self.bed.hosts)]
        paths = [p if p.is_file() and p.stat().st_size else p.with_suffix(".stdout") for p in paths]
        return "\n".join(f"--- {p} (last {tail} characters)\n{p.read_text(errors='replace')[-tail:]}"
                         for p in paths if p.is_file())
