"""A test bed that makes this machine behave like several hosts on a shaped network (root only).

    with NetBed(hosts=2, link_gbit=1.0) as bed:
        bed.run_on("h1", ["mpirun", "--host", "h1,h2", "-np", "2", "python", "train.py"], env=bed.env())

    hvrep netbed run --hosts 2 --link-gbit 1 -- hvrep launch --np 2 --hosts h1:1,h2:1 -- python train.py
    hvrep netbed cleanup            # remove beds left behind by a killed process

The layout, and why:

* **One network namespace per host** (``h1`` ... ``hN``), each with one
  veth named ``hv0`` (:data:`IFACE`) and its own address, and a **switch
  namespace** holding a bridge that joins the other ends. Every host sees
  the same interface name, so ``btl_tcp_if_include=hv0``,
  ``oob_tcp_if_include=hv0`` and ``HOROVOD_GLOO_IFACE=hv0`` are one setting
  for the whole job, as on a cluster whose nodes all name their NIC alike.
  Nothing is created in the machine's own namespace: the veths are made
  directly inside their namespaces, so deleting the namespaces removes every
  link, and no traffic can leave the bed (its namespaces have no route out).
* **tc tbf on both directions of each host link**: egress of ``hv0`` inside
  the host (host -> switch) and egress of the switch-side port (switch ->
  host). A ring all-reduce sends and receives at once on every link, so
  shaping one direction only would let half of the traffic through
  unshaped. This kernel has tbf but no netem: bandwidth is shaped, latency
  is not added (the links keep the sub-millisecond latency of a veth).
* **Its own host name per host** (a UTS namespace per command, see
  :meth:`NetBed.argv_on`), and ``/etc/netns/<ns>/hosts`` (which ``ip netns
  exec`` mounts over ``/etc/hosts``) naming every host. Open MPI and Horovod
  group ranks into hosts by host name (local rank, shared memory between
  ranks of one host): with the machine's one name, both would treat the
  "hosts" as one and let ranks talk through shared memory, bypassing the
  shaped links.
* **No sshd**: an ``ssh`` stand-in (``<bed dir>/bin/ssh``) enters the named
  host's namespace and runs the command there, with that host name. Put
  first on PATH it serves ``horovodrun`` (which runs ``ssh`` for every host
  that is not this one and has no option to choose another agent), and
  Open MPI 5 runs it as its remote agent (``PRTE_MCA_plm_ssh_agent``, or
  ``--mca plm_rsh_agent``) to start its daemon on the other hosts.
  :meth:`NetBed.env` sets all of that, so ``hvrep launch --hosts
  h1:1,h2:1`` works unchanged when started on ``h1`` with that environment.
* **Open MPI kept on TCP over hv0**: ``pml=ob1`` and ``btl=self,sm,tcp``.
  The Open MPI wheel also carries UCX and OFI, which would pick their own
  transport (UCX may choose shared memory between processes of one machine
  whatever their network namespace), and ``sm`` serves only ranks that Open
  MPI places on one host, which the host names keep apart.

Each bed has a unique prefix, ``hvbed-<pid>-<n>``, on its namespaces,
``/etc/netns`` entries and folder, so beds of parallel processes never
collide and a teardown removes only its own. The folder, which holds the
executable ``ssh`` stand-in that root runs, is made by
``tempfile.mkdtemp`` (``<tmp>/hvbed-<pid>-<n>-<random>``, mode 0700, created
anew, never an existing path): a predictable ``/tmp`` name made with
``exist_ok`` would let any local user pre-create it (or a symlink) and choose
what root executes or overwrites. Teardown runs on leaving the
``with`` block (also when its body raises) and at interpreter exit; a bed
whose process was killed (SIGKILL) is removed by :func:`cleanup_stale`
(``hvrep netbed cleanup``), which matches the prefix and a pid no longer alive.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hvrep import _env
from hvrep.errors import ConfigError, SetupError

IFACE = "hv0"  # the one interface name inside every host namespace
PREFIX = "hvbed"
MAX_HOSTS = 16
_SUBNET = "10.201.0"  # host i is 10.201.0.i/24; private to each bed's namespaces, so parallel beds may share it
_BRIDGE = "br0"
_NETNS_ETC = Path("/etc/netns")
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)(?:-|$)")
# tbf's queue: packets wait up to this long before being dropped. Long enough for TCP to fill a 0.1 Gbit/s
# link without drops (50 ms = 625 KB at 0.1 Gbit/s), short enough to keep round trips sane.
_TBF_LATENCY = "50ms"
_TOOLS = ("ip", "tc", "unshare", "hostname")
_counter = itertools.count()


def unavailable_reason() -> str | None:
    """Why a bed cannot be built here (not root, a tool missing), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"needs root (network namespaces, veth links and tc); running as uid {os.geteuid()}"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found on PATH (iproute2 and util-linux provide them)"
    return None


def tbf_burst_bytes(link_gbit: float) -> int:
    """tbf's bucket for ``link_gbit``: 1 ms of traffic, at least 128 KiB.

    The floor is measured: a veth hands tbf GSO segments of up to 64 KiB,
    and with a 64 KiB bucket (which tc rounds to 65,500 bytes) a 4-host ring
    all-reduce on 0.5 Gbit/s links reached 50% of the rate; with 128 or
    256 KiB, 85-87% (8 MB, horovodrun --gloo, 2026-11-24). A bucket lets a
    burst exceed the rate by its size: 128 KiB is 10 ms at 0.1 Gbit/s, 1 ms
    at 1 Gbit/s, noise against all-reduces of tens to hundreds of ms.
    """
    return max(128 * 1024, int(link_gbit * 1e9 / 8 * 1e-3))


@dataclass(frozen=True)
class LinkCounters:
    """Bytes through one host's link, as counted by the kernel on its ``hv0``.

    Attributes:
      tx_bytes: sent by the host (onto its link).
      rx_bytes: received by the host.
    """

    tx_bytes: int
    rx_bytes: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SetupError(f"netbed: `{shlex.join(argv)}` failed with exit code {proc.returncode}: "
                         f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NetBed:
    """``hosts`` network namespaces joined by a bridge, each link shaped to ``link_gbit``; a context manager.

    Args:
      hosts: how many hosts, 1 to 16; named h1 ... hN.
      link_gbit: each host link's rate in Gbit/s (1e9 bit/s), both directions;
        None leaves the links unshaped (a veth: several GB/s on this CPU).
    """

    def __init__(self, hosts: int = 2, link_gbit: float | None = 1.0) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ConfigError(f"hosts={hosts!r} must be an integer in [1, {MAX_HOSTS}]. Fix: e.g. hosts=2.")
        _check_rate(link_gbit)
        self.hosts: tuple[str, ...] = tuple(f"h{i}" for i in range(1, hosts + 1))
        self.link_gbit = link_gbit
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        # The bed's private folder: made by up() (see the module docstring), None until then.
        self.dir: Path | None = None
        self._up = False

    # --- names ---
    @property
    def switch_namespace(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, host: str) -> str:
        """The network namespace of ``host`` (h1 ... hN)."""
        self._check_host(host)
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        """``host``'s IPv4 address on the bed."""
        self._check_host(host)
        return f"{_SUBNET}.{self.hosts.index(host) + 1}"

    @property
    def bin_dir(self) -> Path:
        """The folder holding the ``ssh`` stand-in; first on PATH in :meth:`env`. Exists once the bed is up."""
        if self.dir is None:
            raise SetupError(f"netbed {self.prefix} is not up: its folder and ssh stand-in do not exist yet. Fix: "
                             "use the bed inside `with NetBed(...) as bed:` (or call bed.up() first).")
        return self.dir / "bin"

    @property
    def ssh(self) -> Path:
        return self.bin_dir / "ssh"

    def _check_host(self, host: str) -> None:
        if host not in self.hosts:
            raise ConfigError(f"host {host!r} is not in this bed. Fix: use one of {', '.join(self.hosts)}.")

    # --- life cycle ---
    def __enter__(self) -> NetBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> NetBed:
        """Creates the namespaces, bridge, links, shaping, hosts files and the ssh stand-in."""
        reason = unavailable_reason()
        if reason is not None:
            raise SetupError(f"netbed: cannot build a bed: {reason}.")
        if self._up:
            return self
        self._up = True  # from here on, down() has something to remove
        atexit.register(self.down)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _make_dir(self) -> Path:
        """Creates the bed's private folder (0700, a fresh name: ``mkdtemp`` never reuses an existing path)."""
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        return self.dir

    def _build(self) -> None:
        self._make_dir()
        sw = self.switch_namespace
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", _BRIDGE, "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", _BRIDGE, "up"])
        for i, host in enumerate(self.hosts, start=1):
            ns = self.namespace(host)
            _run(["ip", "netns", "add", ns])
            # Made in place: one end in the switch, the other in the host, none in the machine's namespace.
            _run(["ip", "-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", IFACE, "netns", ns])
            _run(["ip", "-n", sw, "link", "set", f"p{i}", "master", _BRIDGE, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFACE])
            _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            etc = _NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file())
        self.set_rate(self.link_gbit)
        self._write_ssh()

    def down(self) -> None:
        """Stops the bed's processes and removes everything it made; safe to call twice."""
        if not self._up:
            return
        self._up = False
        atexit.unregister(self.down)
        _remove(self.prefix)

    def set_rate(self, link_gbit: float | None) -> None:
        """Shapes every host link to ``link_gbit`` Gbit/s in both directions (None: unshaped)."""
        _check_rate(link_gbit)
        for i, host in enumerate(self.hosts, start=1):
            for ns, dev in ((self.namespace(host), IFACE), (self.switch_namespace, f"p{i}")):
                if link_gbit is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", f"{round(link_gbit * 1e9)}bit", "burst", str(tbf_burst_bytes(link_gbit)),
                          "latency", _TBF_LATENCY])
        self.link_gbit = link_gbit

    def _hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{self.address(h)} {h}" for h in self.hosts]
        return "\n".join(lines) + "\n"

    def _write_ssh(self) -> None:
        cases = "\n".join(f"  {h}|{self.address(h)}) ns={shlex.quote(self.namespace(h))}; name={h} ;;"
                          for h in self.hosts)
        script = f"""#!/bin/bash
# ssh stand-in of the hvrep netbed {self.prefix} (hvrep/cluster/netbed.py); removed with the bed.
# `ssh [options] HOST [options] COMMAND...` runs COMMAND (one shell string, as ssh does) in HOST's
# network namespace with HOST as its host name. No sshd, no keys: the bed's hosts are this machine.
host=""
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; if [ -z "$host" ]; then host="$1"; shift; fi; break ;;
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
    -*) shift ;;
    *) if [ -z "$host" ]; then host="$1"; shift; else break; fi ;;
  esac
done
host="${{host##*@}}"
case "$host" in
{cases}
  *) echo "ssh (hvrep netbed {self.prefix}): no host '$host' in this bed ({' '.join(self.hosts)})" >&2; exit 255 ;;
esac
if [ $# -eq 0 ]; then echo "ssh (hvrep netbed): a command is needed (no interactive shells)" >&2; exit 255; fi
exec ip netns exec "$ns" unshare --uts -- /bin/bash -c 'hostname "$1" && exec /bin/bash -c "$2"' hvbed "$name" "$*"
"""
        self.bin_dir.mkdir(mode=0o700)  # inside the private folder made by _make_dir: new, or this raises
        # O_EXCL|O_NOFOLLOW: a file (or symlink) that appeared there anyway is never written through.
        fd = os.open(self.ssh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
        with os.fdopen(fd, "w") as f:
            f.write(script)

    # --- using it ---
    def argv_on(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command run on ``host``: in its namespace, with its host name (a UTS namespace)."""
        if not argv:
            raise ConfigError("argv is empty. Fix: give the command to run on the host.")
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "--", "/bin/bash", "-c",
                'hostname "$1" && shift && exec "$@"', "hvbed", host, *argv]

    def run_on(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float | None = None, **kwargs: object) -> subprocess.CompletedProcess:
        """Runs ``argv`` on ``host`` (see :meth:`argv_on`) and waits; ``kwargs`` go to ``subprocess.run``."""
        return subprocess.run(self.argv_on(host, argv), env=None if env is None else dict(env), timeout=timeout,
                              **kwargs)  # type: ignore[call-overload]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus what launchers need on the bed.

        The ssh stand-in first on PATH (horovodrun) and as Open MPI's remote
        agent; every transport on ``hv0``. Launchers pass these on to their
        ranks (``hvrep launch`` forwards PATH; mpirun's daemons and horovodrun's
        ssh inherit them here, since every host is this machine).
        """
        env = dict(_env.environ_snapshot() if base is None else base)
        env[_env.PATH] = f"{self.bin_dir}{os.pathsep}{env.get(_env.PATH, os.defpath)}"
        env[_env.PRTE_MCA_PLM_SSH_AGENT] = str(self.ssh)
        env[_env.PRTE_MCA_OOB_TCP_IF_INCLUDE] = IFACE
        env[_env.OMPI_MCA_BTL_TCP_IF_INCLUDE] = IFACE
        env[_env.OMPI_MCA_PML] = "ob1"
        env[_env.OMPI_MCA_BTL] = "self,sm,tcp"
        env[_env.HOROVOD_GLOO_IFACE] = IFACE
        return env

    def counters(self) -> dict[str, LinkCounters]:
        """Bytes sent and received so far on each host's link, {host: LinkCounters}."""
        out = {}
        for host in self.hosts:
            proc = _run(["ip", "-n", self.namespace(host), "-j", "-s", "link", "show", "dev", IFACE])
            stats = json.loads(proc.stdout)[0]["stats64"]
            out[host] = LinkCounters(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out


def _check_rate(link_gbit: float | None) -> None:
    if link_gbit is None:
        return
    if isinstance(link_gbit, bool) or not isinstance(link_gbit, int | float) or not 0.001 <= link_gbit <= 100:
        raise ConfigError(f"link_gbit={link_gbit!r} must be a number of Gbit/s in [0.001, 100], or None for "
                          "unshaped links. Fix: e.g. link_gbit=1.0.")


def list_beds() -> dict[str, int]:
    """Prefixes of the beds on this machine (namespaces, /etc/netns entries, folders): {prefix: owner pid}."""
    names = _run(["ip", "netns", "list"], check=False).stdout.split()
    if _NETNS_ETC.is_dir():
        names += [p.name for p in _NETNS_ETC.iterdir()]
    names += [p.name for p in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*")]
    beds = {}
    for name in names:
        m = _NAME.match(name)
        if m:
            beds[f"{PREFIX}-{m.group(1)}-{m.group(2)}"] = int(m.group(1))
    return beds


def cleanup_stale(everything: bool = False) -> list[str]:
    """Removes the beds whose process is gone (all of them with ``everything``); returns their prefixes."""
    removed = []
    for prefix, pid in sorted(list_beds().items()):
        if everything or not _pid_alive(pid):
            _remove(prefix)
            removed.append(prefix)
    return removed


def _remove(prefix: str) -> None:
    """Kills the processes in ``prefix``'s namespaces, then deletes them, their /etc/netns entries and folder."""
    namespaces = [n for n in _run(["ip", "netns", "list"], check=False).stdout.split()
                  if n == prefix or n.startswith(prefix + "-")]
    # A namespace lives on while a process holds it: stop the ranks, daemons and shells the bed started.
    for _ in range(2):
        pids = {int(p) for ns in namespaces
                for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()}
        pids.discard(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            break
        time.sleep(0.2)
    for ns in namespaces:
        _run(["ip", "netns", "delete", ns], check=False)
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    for stale in (_NETNS_ETC.glob(f"{prefix}-*") if _NETNS_ETC.is_dir() else ()):
        shutil.rmtree(stale, ignore_errors=True)
    if _NETNS_ETC.is_dir() and not any(_NETNS_ETC.iterdir()):
        _NETNS_ETC.rmdir()  # made by the bed (no system ships it); keep it when anything else lives there
    for folder in _folders(prefix):
        shutil.rmtree(folder, ignore_errors=True)


def _folders(prefix: str) -> list[Path]:
    """Bed ``prefix``'s private folders (``<tmp>/<prefix>-<random>``, made by ``mkdtemp``): this user's own
    folders only, never a symlink or what another user made under a bed's name."""
    return [p for p in Path(tempfile.gettempdir()).glob(f"{prefix}-*")
            if not p.is_symlink() and p.is_dir() and p.stat().st_uid == os.geteuid()]


def leftovers(prefix: str) -> list[str]:
    """What of bed ``prefix`` still exists (namespaces, /etc/netns entries, its folder); [] when clean."""
    found = [f"netns {n}" for n in _run(["ip", "netns", "list"], check=False).stdout.split()
             if n.startswith(prefix + "-")]
    if _NETNS_ETC.is_dir():
        found += [f"{_NETNS_ETC}/{p.name}" for p in _NETNS_ETC.iterdir() if p.name.startswith(prefix + "-")]
    found += [str(p) for p in _folders(prefix)]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``hvrep netbed run|cleanup|list``; see the module docstring."""
    import argparse

    parser = argparse.ArgumentParser(prog="hvrep netbed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="bring a bed up, run CMD on h1 with the launcher environment, tear it down",
                       usage="hvrep netbed run [--hosts N] [--link-gbit G] -- CMD...")
    r.add_argument("--hosts", type=int, default=2)
    r.add_argument("--link-gbit", type=float, default=1.0, help="each link's rate, Gbit/s; 0: unshaped")
    r.add_argument("--on", default="h1", help="the host CMD runs on (default h1)")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    c = sub.add_parser("cleanup", help="remove beds left behind by killed processes")
    c.add_argument("--all", action="store_true", help="also the beds of processes still running")
    sub.add_parser("list", help="list the beds on this machine and their owner pids")
    args = parser.parse_args(argv)
    if args.what == "list":
        for prefix, pid in sorted(list_beds().items()):
            print(f"{prefix}  pid {pid} {'running' if _pid_alive(pid) else 'gone (stale)'}")
        return 0
    if args.what == "cleanup":
        reason = unavailable_reason()
        if reason is not None:
            print(f"hvrep netbed: {reason}", file=sys.stderr)
            return 2
        removed = cleanup_stale(everything=args.all)
        print(f"hvrep netbed: removed {len(removed)} bed(s){': ' + ', '.join(removed) if removed else ''}")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("run needs a command after --")
    # SIGTERM (a timeout, a batch system) ends the process without atexit; turn it into SystemExit so the
    # bed comes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with NetBed(args.hosts, args.link_gbit or None) as bed:
        shown = ", ".join(f"{h}={bed.address(h)}" for h in bed.hosts)
        print(f"hvrep netbed: {bed.prefix}: {shown} on {IFACE}, links "
              f"{f'{bed.link_gbit} Gbit/s' if bed.link_gbit else 'unshaped'}; ssh stand-in {bed.ssh}", flush=True)
        before = bed.counters()
        code = bed.run_on(args.on, cmd, env=bed.env()).returncode
        for host, c in bed.counters().items():
            d = c - before[host]
            print(f"hvrep netbed: {host} link: sent {d.tx_bytes:,} B, received {d.rx_bytes:,} B")
    return code


if __name__ == "__main__":
    sys.exit(main())
