"""Two hosts on one machine (hvrep.cluster.netbed): the bed itself, and real jobs launched across it.

(a) the bed: hosts reach each other by name over shaped links, and nothing is
    left behind, after a clean exit, a raising body or a killed owner;
(b, c) one launch per launcher, ``mpirun --host h1,h2`` (Open MPI's remote agent
    pointed at the bed's ssh stand-in) and ``horovodrun -H h1:1,h2:1 --gloo``
    (the stand-in first on PATH), each running tests/multihost/worker.py:
    all-reduce correctness and a short training run checked against a
    1-process reference, with the link counters showing the gradient bytes
    crossed the links;
(d) ``hvrep launch --hosts h1:1,h2:1`` unchanged, under both launchers.

Root only (namespaces, veths, tc); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hvrep.cluster import netbed

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WORKER = Path(__file__).with_name("worker.py")
_REASON = netbed.unavailable_reason()

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(_REASON is not None, reason=f"netbed: {_REASON}"),
]

# Small enough that each launch's Python start-up dominates, large enough that the 16 MB all-reduce takes
# a measurable time at this rate (~0.13 s).
LINK_GBIT = 1.0


def _job_env(bed: netbed.NetBed, with_bed: bool = True) -> dict[str, str]:
    env = bed.env() if with_bed else dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTEROP_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@pytest.fixture(scope="module")
def bed():
    with netbed.NetBed(hosts=2, link_gbit=LINK_GBIT) as b:
        yield b


_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5701)); s.listen()
print("ready", flush=True)
c, peer = s.accept(); n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
print(socket.gethostname(), peer[0], n, flush=True)
"""
_CLIENT = """
import socket, sys, time
s = socket.create_connection(("h2", 5701)); t = time.perf_counter()
s.sendall(b"x" * int(sys.argv[1])); s.shutdown(socket.SHUT_WR); s.recv(1)
print(socket.gethostname(), time.perf_counter() - t, flush=True)
"""


def _transfer(b: netbed.NetBed, nbytes: int) -> tuple[str, str, float]:
    """Sends ``nbytes`` from h1 to h2 by host name; returns (h2's report, h1's host name, seconds)."""
    server = subprocess.Popen(b.argv_on("h2", [sys.executable, "-c", _SERVER]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = b.run_on("h1", [sys.executable, "-c", _CLIENT, str(nbytes)], capture_output=True, text=True,
                          timeout=30)
        assert client.returncode == 0, client.stderr
        report = server.stdout.readline().strip()
        name, seconds = client.stdout.split()
        return report, name, float(seconds)
    finally:
        server.kill()
        server.wait()


def test_hosts_reach_each_other_by_name_over_shaped_links_and_teardown_leaves_nothing():
    with netbed.NetBed(hosts=2, link_gbit=0.1) as b:
        prefix = b.prefix
        assert netbed.leftovers(prefix), "the bed made nothing"
        before = b.counters()
        nbytes = 5_000_000
        report, client_name, seconds = _transfer(b, nbytes)
        after = b.counters()
        assert report == f"h2 {b.address('h1')} {nbytes}", report
        assert client_name == "h1"
        # 5 MB at 0.1 Gbit/s needs 0.4 s; tbf's 128 KiB bucket lets ~10 ms through early.
        assert seconds >= 0.38, f"{nbytes} B took {seconds:.3f} s: the link is not shaped to 0.1 Gbit/s"
        assert (after["h1"] - before["h1"]).tx_bytes >= nbytes
        assert (after["h2"] - before["h2"]).rx_bytes >= nbytes
    assert netbed.leftovers(prefix) == []


@pytest.mark.parametrize("planted", ["folder", "symlink"])
def test_a_folder_or_symlink_planted_at_the_beds_predictable_path_is_never_used(planted, tmp_path):
    # Root runs the bed's ssh stand-in: a local user who made /tmp/hvbed-<pid>-<n> (or a symlink there) first
    # must not choose what root executes or where it writes.
    b = netbed.NetBed(hosts=1, link_gbit=None)
    trap = Path(tempfile.gettempdir()) / b.prefix
    victim = tmp_path / "victim"
    (victim / "bin").mkdir(parents=True)
    (victim / "bin" / "ssh").write_text("#!/bin/sh\necho planted\n")
    if planted == "folder":
        shutil.copytree(victim, trap)
    else:
        trap.symlink_to(victim, target_is_directory=True)
    try:
        with b:
            assert b.dir is not None and b.dir != trap and not b.dir.is_symlink()
            assert b.dir.stat().st_mode & 0o777 == 0o700 and b.ssh.is_relative_to(b.dir)
            assert b.ssh.read_text().startswith("#!/bin/bash\n# ssh stand-in of the hvrep netbed")
            assert b.env()["PATH"].startswith(f"{b.dir}/bin:")
        for folder in ((victim,) if planted == "symlink" else (victim, trap)):
            assert (folder / "bin" / "ssh").read_text() == "#!/bin/sh\necho planted\n"
        assert trap.is_symlink() == (planted == "symlink")
        assert netbed.leftovers(b.prefix) == []  # the bed's own folder went; the planted one is not the bed's
    finally:
        if trap.is_symlink():
            trap.unlink()
        else:
            shutil.rmtree(trap, ignore_errors=True)


def test_teardown_when_the_body_raises_and_cleanup_of_a_killed_owner():
    with pytest.raises(RuntimeError, match="boom"), netbed.NetBed(hosts=2) as b:
        prefix = b.prefix
        raise RuntimeError("boom")
    assert netbed.leftovers(prefix) == []

    # An owner killed with SIGKILL runs no teardown: `cleanup_stale` finds its bed by prefix and dead pid.
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom hvrep.cluster.netbed import NetBed\n"
         "b = NetBed(hosts=2).up(); print(b.prefix, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert owner.stdout is not None
    stale = owner.stdout.readline().strip()
    assert stale.startswith(f"{netbed.PREFIX}-{owner.pid}-"), stale
    mine = netbed.NetBed(hosts=1).up()  # a live bed: cleanup must leave it alone
    try:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert netbed.leftovers(stale)
        removed = netbed.cleanup_stale()
        assert stale in removed and mine.prefix not in removed
        assert netbed.leftovers(stale) == []
        assert netbed.leftovers(mine.prefix)
    finally:
        mine.down()
    assert netbed.leftovers(mine.prefix) == []


def _launch_worker(bed: netbed.NetBed, launcher: str, out: Path) -> tuple[dict[int, dict], dict]:
    if launcher == "mpirun":
        # The cluster way, spelled out on the command line: Open MPI's remote agent and its interfaces.
        argv = [str(BIN / "mpirun"), "-np", "2", "--host", "h1,h2", "--bind-to", "none",
                "--mca", "plm_rsh_agent", str(bed.ssh), "--mca", "oob_tcp_if_include", netbed.IFACE,
                "--mca", "btl_tcp_if_include", netbed.IFACE, "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp",
                "-x", "PYTHONPATH", "-x", "TF_NUM_INTRAOP_THREADS", "-x", "TF_NUM_INTEROP_THREADS",
                sys.executable, "-m", "mpi4py", str(WORKER), "--out", str(out)]
        env = _job_env(bed, with_bed=False)
    else:
        # horovodrun runs `ssh` for h2: the bed's stand-in, first on PATH in bed.env().
        argv = [str(BIN / "horovodrun"), "-np", "2", "-H", "h1:1,h2:1", "--gloo", "--network-interface",
                netbed.IFACE, sys.executable, str(WORKER), "--out", str(out)]
        env = _job_env(bed)
    before = bed.counters()
    proc = bed.run_on("h1", argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    after = bed.counters()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1], output[-4000:]
    return ranks, {h: after[h] - before[h] for h in after}


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_allreduce_and_training_across_two_namespace_hosts(bed, launcher, tmp_path):
    ranks, moved = _launch_worker(bed, launcher, tmp_path)
    # One rank per host, each host known by its own name: Horovod sees 2 hosts of 1 rank.
    assert sorted(r["hostname"] for r in ranks.values()) == ["h1", "h2"]
    assert all(r["size"] == 2 and r["local_size"] == 1 and r["local_rank"] == 0 for r in ranks.values()), ranks
    failed = {f"rank {rank}: {name}": c["detail"] for rank, r in ranks.items()
              for name, c in r["checks"].items() if not c["ok"]}
    assert not failed, failed
    assert len(ranks[0]["checks"]) == 4
    # The gradient bytes crossed the shaped links: a 2-rank all-reduce of S bytes sends at least S from each
    # host whatever the algorithm (each half of the result needs the other rank's half: 2 x S/2).
    payload = ranks[0]["payload_bytes"]
    for host, c in moved.items():
        assert c.tx_bytes >= payload and c.rx_bytes >= payload, (host, c, payload)


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_hvrep_launch_hosts_works_unchanged_through_the_bed(bed, launcher):
    # What `hvrep launch` starts on each host: its host name, its rank, and (under mpirun, through mpi4py)
    # a 1 MB sum across the hosts, which must cross the links.
    program = ("import os, socket, numpy as np\n"
               "rank = os.environ.get('HOROVOD_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK')\n"
               "total = ''\n"
               "if 'OMPI_COMM_WORLD_RANK' in os.environ:\n"
               "    from mpi4py import MPI\n"
               "    x = np.full(262144, int(rank) + 1, np.float32); y = np.empty_like(x)\n"
               "    MPI.COMM_WORLD.Allreduce(x, y); total = f' sum={y[0]:.0f}'\n"
               "print(f'host={socket.gethostname()} rank={rank}{total}', flush=True)\n")
    argv = [str(BIN / "hvrep"), "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--launcher", launcher,
            *(["--allow-run-as-root"] if launcher == "mpirun" else []), "--", sys.executable, "-c", program]
    before = bed.counters()
    start = time.perf_counter()
    proc = bed.run_on("h1", argv, env=_job_env(bed), cwd=ROOT, capture_output=True, text=True, timeout=120)
    after = bed.counters()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    lines = sorted(line.split(">:")[-1] for line in proc.stdout.splitlines() if "host=" in line)
    suffix = " sum=3" if launcher == "mpirun" else ""
    assert lines == [f"host=h1 rank=0{suffix}", f"host=h2 rank=1{suffix}"], (lines, output[-3000:])
    if launcher == "mpirun":
        assert all((after[h] - before[h]).tx_bytes >= 1_048_576 for h in after), (before, after)
    assert time.perf_counter() - start < 120
