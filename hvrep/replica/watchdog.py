"""A collective that never completes ends the job with a report, instead of hanging it (``CommConfig.timeout_s``).

Horovod's stall inspector cannot do this: a stopped or deadlocked rank also
stops Horovod's own per-cycle coordination, so the inspector never gets to
run. The watchdog is a thread per rank with an out-of-band heartbeat that does
not go through Horovod:

* what it watches: every Horovod collective hvrep issues, through one
  mechanism, :class:`hvrep.replica.activity.Watched`: the horovod backend
  holds Horovod's module wrapped in it, so each collective function
  (``allreduce``, ``allgather``, ``broadcast`` ...) marks itself, eagerly
  around the call, and in a traced step (``run``, Keras' ``fit`` calling
  ``Replicator.all_reduce``, any ``tf.function``) with a marker op before and
  after the collective's op, so the mark follows the op as it executes, not as
  it is traced (native ops where hvrep's kernels are built, which take a mutex
  and no Python);
* rank 0 hosts a small TCP server; its address and a random per-job secret
  travel once at start-up, in one Horovod broadcast (the secret never
  crosses the network otherwise, as in Horovod's own runner);
* every rank keeps one connection to it and sends a line every ``interval``
  seconds saying what it is doing (the collectives it is inside, since when;
  the step the training loop noted); the server answers each line with "ok"
  or the verdict. O(ranks) small messages per interval, all at rank 0, never
  O(ranks^2). Every line both ways carries an HMAC-SHA256 of the secret, the
  connection's nonce, its direction and its sequence number: a line without
  a valid one is dropped, with its connection, and only counted. Nothing an
  unauthenticated peer sends is acted on, printed or recorded;
* the server decides: a rank that has waited in a collective for more than
  ``timeout_s`` ends the job (exit 75, ``hvrep.errors.EXIT_HANG``) with one
  report naming the ranks that did not join (no heartbeat: stopped, dead, or
  hung holding Python's GIL; or busy elsewhere, with what each was doing).
  Ranks that wait in collectives none of the others wait in can never meet:
  that is reported without waiting for the timeout and exits 65
  (``EXIT_MISMATCH``: uneven input across ranks ends this way, and would
  again, so Slurm does not requeue it);
* every rank that hears the verdict prints it (rank 0 the whole report, the
  others its first line) and leaves with ``os._exit``: Horovod's threads are
  blocked in the collective and would keep a clean exit waiting. A rank that
  cannot reach rank 0 (rank 0 stopped or dead) decides alone once its own
  collective has waited ``timeout_s`` plus a grace period.

Under horovodrun's elastic driver (``hvrep.elastic``) a timeout ends only the ranks that did not join, where
rank 0 can prove which process each is: their authenticated heartbeats carry their process identity (kernel
boot id, pid namespace, pid and start time: ``hvrep.replica.identity``), and rank 0 sees the same boot and pid
namespace and that pid with that start time. Those it ends with SIGKILL, which a stopped process gets too. A
host name proves nothing (containers share one; nodes may all be ``localhost``). The driver then drops that
worker, the others' collective fails, and ``hvrep.elastic.run`` rolls them back and goes on in the smaller
world. A stuck rank rank 0 cannot prove (another host, another pid namespace), or rank 0 itself stuck, still
ends every rank, as without elasticity.

The training step that timed out never returns, so nothing after it runs: no
checkpoint is written from it, and the last complete checkpoint stays the
newest (checkpoints are written to a temporary folder and renamed).

Where rank 0 listens: ``HVREP_WATCHDOG_ADDR`` if set; 127.0.0.1 on a one-host
job; otherwise the address of the interface Horovod's transport uses
(``HOROVOD_GLOO_IFACE``, Open MPI's ``btl_tcp_if_include``), or the host
name's address. Every rank, rank 0's neighbours too, dials that address.
``HVREP_WATCHDOG_PORT`` is one port or a range tried in turn (``29500-29599``:
a second job on the node takes the next port); unset, an ephemeral port. A
peer that floods the port can at worst keep heartbeats from arriving, which
ends nothing by itself: only a rank seen waiting in a collective does.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import ipaddress
import itertools
import json
import os
import secrets
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvrep import _env
from hvrep.errors import EXIT_CODES, EXIT_HANG, EXIT_MISMATCH, ExitCode, WatchdogError
from hvrep.replica.activity import Activity, bind
from hvrep.replica.identity import ProcessIdentity

# One message, either way: a heartbeat is under 2 KiB, an answer carries at most the verdict's first line.
MAX_LINE = 64 * 1024
# Connections that have not sent a valid line yet; beyond this the oldest is dropped, so a flood cannot lock
# the ranks out for longer than it takes them to say one line.
MAX_UNAUTHENTICATED = 64
# Seconds a new connection has to send its first valid line.
AUTH_S = 5.0
# Seconds the on_end callbacks (hvrep train's final event: a checkpoint lookup and a metrics.jsonl line) may take
# before the rank exits anyway: a hung file system must not keep a hung job alive.
END_WORK_S = 10.0


def _now() -> float:
    return time.monotonic()


def describe(rank: int, state: dict[str, Any], heard_ago: float) -> str:
    """One line for one rank: what it was doing and when it was last heard from."""
    where = "inside" if state["in"] else "after"
    step = f", {state['step']}" if state.get("step") else ""
    host = f" on {state['host']} (pid {state['pid']})" if state.get("host") else ""
    return (f"rank {rank}{host}: {where} collective call #{state['call']} {state['what']}{step} for "
            f"{state['age'] + heard_ago:.0f} s; last heartbeat {heard_ago:.0f} s ago")


@dataclass(frozen=True)
class Verdict:
    """What ends the job: its exit code (``hvrep.errors.EXIT_HANG`` or ``EXIT_MISMATCH``) and the report."""

    exit: ExitCode
    report: str
    # The ranks that did not join the stuck collective (a timeout; empty for a mismatch).
    missing: tuple[int, ...] = ()


def verdict(states: dict[int, tuple[float, dict[str, Any]]], size: int, timeout_s: float, stale_s: float,
            now: float, gone: dict[int, str] | None = None, rejected: int = 0) -> Verdict | None:
    """The verdict that ends the job, or None while nothing is stuck. Pure: tested without processes.

    Args:
      states: rank -> (monotonic time its last heartbeat arrived, its snapshot).
      size: ranks in the job.
      timeout_s: how long a rank may wait inside one collective.
      stale_s: a rank not heard from for this long is not heartbeating (stopped, dead, or holding the GIL).
      now: the current monotonic time.
      gone: rank -> why its connection ended, for ranks that disconnected.
      rejected: lines and connections the server dropped for not authenticating (a count; never their content).
    """
    gone = gone or {}
    heard = {r: now - t for r, (t, _) in states.items()}
    live = {r: s for r, (t, s) in states.items() if heard[r] < stale_s and r not in gone}
    waiting = {r: s for r, s in live.items() if s["in"]}
    # Ranks that have each waited longer than a collective takes, in collectives none of the others is inside,
    # can never meet. (For a moment two ranks may legitimately be in different ones: one still inside a
    # collective that has completed elsewhere, the other already in the next.) A rank inside more collectives
    # than its heartbeat lists is left to the timeout.
    settled = min(timeout_s, stale_s)
    calm = {r: s for r, s in waiting.items() if s["age"] + heard[r] >= settled and not s.get("more")}
    inside = {r: frozenset(s.get("waiting") or [s["what"]]) for r, s in calm.items()}
    apart = any(not inside[a] & inside[b] for a, b in itertools.combinations(sorted(inside), 2))
    stuck = {r: s for r, s in waiting.items() if s["age"] + heard[r] > timeout_s}
    if not apart and not stuck:
        return None
    lines = []
    missing: list[int] = []
    if apart:
        call = min(s["call"] for s in calm.values())
        groups: dict[str, list[int]] = {}
        for r in sorted(calm):
            groups.setdefault(calm[r]["what"], []).append(r)
        listing = "; ".join(f"rank(s) {', '.join(map(str, rs))} in {what}" for what, rs in groups.items())
        lines.append(f"hvrep: the ranks are in different collectives at call #{call} ({listing}): they can never "
                     "meet, and the job would hang. Typical cause: input_fn yields different numbers of batches "
                     "on different ranks, or a collective (repl.reduce, repl.run) called on some ranks only. "
                     f"Exiting every rank with code {EXIT_MISMATCH.code}.")
        fix = ("Fix: make every rank run the same steps and reduces in the same order: equal batch counts per "
               "rank (shard with ctx.shard, drop_remainder=True, or repeat() and a fixed number of steps).")
        exit = EXIT_MISMATCH
    else:
        first = min(stuck, key=lambda r: stuck[r]["call"])
        s = stuck[first]
        ours = set(s.get("waiting") or [s["what"]])
        missing = sorted(r for r in range(size)
                         if r not in live or not (live[r]["in"] and ours & set(live[r].get("waiting")
                                                                                or [live[r]["what"]])))
        step = f" ({s['step']})" if s.get("step") else ""
        lines.append(f"hvrep: collective call #{s['call']} {s['what']}{step} has not completed within "
                     f"comm.timeout_s={timeout_s:g} s: rank(s) {', '.join(map(str, missing)) or '(none found)'} did "
                     "not join. Exiting every rank; the last complete checkpoint is kept.")
        fix = ("Fix: see docs/troubleshooting.md. A rank without heartbeat is stopped, dead, or blocked "
               "holding Python's GIL (attach `py-spy dump --pid PID` to it); a rank busy elsewhere names what it "
               "was doing. Raise comm.timeout_s if a step or checkpoint legitimately takes longer.")
        exit = EXIT_HANG
    for r in range(size):
        if r in gone:
            lines.append(f"  rank {r}: {gone[r]}")
        elif r not in states:
            lines.append(f"  rank {r}: never connected to the watchdog")
        else:
            tag = "" if r in live else "  <- NO HEARTBEAT"
            lines.append("  " + describe(r, states[r][1], heard[r]) + tag)
    if rejected:
        lines.append(f"  (the watchdog dropped {rejected} line(s) or connection(s) that did not authenticate)")
    lines.append(fix)
    return Verdict(exit, "\n".join(lines), tuple(missing))


# --- the wire: HMAC-signed lines -------------------------------------------------------------------

def _sign(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    """The hex HMAC-SHA256 of one line: its direction (b"hello", b"c" rank to server, b"s" server to rank), the
    connection's nonce and the body (whose JSON carries the sequence number)."""
    return hmac.new(secret, b"|".join((direction, nonce, body)), hashlib.sha256).hexdigest().encode()


def _line(secret: bytes, direction: bytes, nonce: bytes, body: bytes) -> bytes:
    return _sign(secret, direction, nonce, body) + b" " + body + b"\n"


def _open(secret: bytes, direction: bytes, nonce: bytes, line: bytes) -> bytes | None:
    """The body of a line whose MAC is valid, else None."""
    mac, _, body = line.rstrip(b"\n").partition(b" ")
    return body if hmac.compare_digest(mac, _sign(secret, direction, nonce, body)) else None


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "rank": int, "seq": int, "call": int, "what": str, "in": bool, "age": (int, float), "step": str, "host": str,
    "pid": int}


def _heartbeat_state(body: bytes, size: int) -> dict[str, Any]:
    """An authenticated heartbeat's fields, checked (a bug on a rank must not crash rank 0's server)."""
    state = json.loads(body)
    if not isinstance(state, dict):
        raise ValueError("not an object")
    for key, kind in _STATE_TYPES.items():
        if not isinstance(state.get(key), kind):
            raise ValueError(key)
    if not 0 <= state["rank"] < size:
        raise ValueError("rank")
    if not isinstance(state.get("proc", {}), dict):
        raise ValueError("proc")
    waiting = state.get("waiting", [])
    if not isinstance(waiting, list) or not all(isinstance(w, str) for w in waiting):
        raise ValueError("waiting")
    return state


@dataclass
class _Conn:
    sock: socket.socket
    nonce: bytes
    deadline: float  # an unauthenticated connection is dropped after this (monotonic)
    rank: int | None = None
    seq: int = 0
    buf: bytearray = field(default_factory=bytearray)  # received, not yet a whole line
    out: bytearray = field(default_factory=bytearray)  # to send


class _Server:
    """Rank 0's listener: one thread, non-blocking sockets, bounded lines and connections. Only lines that carry
    the job's HMAC have any effect; any other line, an over-long one, or silence past ``AUTH_S`` drops the
    connection and is counted (``rejected``), nothing more."""

    def __init__(self, watchdog: Watchdog, host: str, ports: tuple[int, int]) -> None:
        self._dog = watchdog
        self._listener = _bind(host, ports)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._by_rank: dict[int, _Conn] = {}
        self.rejected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvrep-watchdog-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._sel.select(timeout=0.25):
                    if key.data is None:
                        self._accept()
                        continue
                    conn = key.data
                    if mask & selectors.EVENT_READ:
                        self._read(conn)
                    if mask & selectors.EVENT_WRITE and conn.sock in self._conns:
                        self._flush(conn)
                now = _now()
                for conn in [c for c in self._conns.values() if c.rank is None and c.deadline < now]:
                    self._drop(conn, rejected=True)
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._sel.close()
            self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        waiting = [c for c in self._conns.values() if c.rank is None]
        if len(waiting) >= MAX_UNAUTHENTICATED:
            self._drop(min(waiting, key=lambda c: c.deadline), rejected=True)
        nonce = secrets.token_hex(16).encode()
        conn = _Conn(sock, nonce, _now() + AUTH_S)
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        conn.out += _line(self._dog.secret, b"hello", nonce, nonce)
        self._flush(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        while conn.sock in self._conns:
            end = conn.buf.find(b"\n")
            if end < 0:
                if len(conn.buf) > MAX_LINE:
                    self._drop(conn, rejected=True)
                return
            line = bytes(conn.buf[:end + 1])
            del conn.buf[:end + 1]
            self._message(conn, line)

    def _message(self, conn: _Conn, line: bytes) -> None:
        body = _open(self._dog.secret, b"c", conn.nonce, line) if len(line) <= MAX_LINE else None
        try:
            if body is None:
                raise ValueError("no valid MAC")
            state = _heartbeat_state(body, self._dog.size)
            if state["seq"] != conn.seq + 1 or conn.rank not in (None, state["rank"]):
                raise ValueError("out of sequence")
        except (ValueError, UnicodeDecodeError):
            self._drop(conn, rejected=True)
            return
        rank = conn.rank = state["rank"]
        conn.seq = state["seq"]
        previous = self._by_rank.get(rank)
        if previous is not None and previous is not conn:
            self._drop(previous, reconnected=True)
        self._by_rank[rank] = conn
        answer = self._dog._heard(rank, state)
        body = json.dumps({"seq": conn.seq, "verdict": answer}).encode()
        conn.out += _line(self._dog.secret, b"s", conn.nonce, body)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out) if conn.out else 0
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.out[:sent]
        if len(conn.out) > 4 * MAX_LINE:  # a peer that does not read its answers
            self._drop(conn, rejected=conn.rank is None)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.modify(conn.sock, events, conn)

    def _drop(self, conn: _Conn, rejected: bool = False, reconnected: bool = False) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        self.rejected += rejected
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
            del self._by_rank[conn.rank]
            if not reconnected and not self._stop.is_set():
                self._dog._lost(conn.rank)


def _bind(host: str, ports: tuple[int, int]) -> socket.socket:
    """A listening socket on ``host`` at the first free port of ``ports`` (first, last)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    error: OSError | None = None
    for port in range(ports[0], ports[1] + 1):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
            return sock
        except OSError as e:
            sock.close()
            error = e
    where = f"port {ports[0]}" if ports[0] == ports[1] else f"any port in {ports[0]}-{ports[1]}"
    raise WatchdogError(
        f"hvrep's watchdog cannot listen on {host} at {where} ({error}). Fix: export "
        f"{_env.HVREP_WATCHDOG_PORT} as a range with free ports (29500-29599), or unset it for an ephemeral port; "
        f"if {host} is not this host's address, export {_env.HVREP_WATCHDOG_ADDR} as one of rank 0's addresses.")


def listen_address(single_host: bool, addr: str, iface: str, interfaces: Mapping[str, Sequence[str]],
                   host_addr: str) -> str:
    """Where rank 0's watchdog listens (and every rank dials). Pure: tested without a network.

    Args:
      single_host: every rank runs on rank 0's host.
      addr: ``HVREP_WATCHDOG_ADDR`` ("" when unset): wins.
      iface: the interfaces Horovod's transport uses (``_env.transport_iface``): names or CIDR ranges.
      interfaces: this host's IPv4 addresses by interface name.
      host_addr: the address this host's name resolves to ("" when it does not).
    """
    if addr:
        return addr
    if single_host:
        return "127.0.0.1"
    for name in filter(None, (n.strip() for n in iface.split(","))):
        if "/" in name:
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(name, strict=False)
                found = [a for addrs in interfaces.values() for a in addrs if ipaddress.ip_address(a) in net]
                if found:
                    return found[0]
        elif interfaces.get(name):
            return interfaces[name][0]
    if host_addr and not host_addr.startswith("127."):
        return host_addr
    others = sorted(a for addrs in interfaces.values() for a in addrs if not a.startswith("127."))
    if others:
        return others[0]
    raise WatchdogError(f"hvrep's watchdog finds no address for the other hosts to reach rank 0 at (interfaces: "
                        f"{dict(interfaces)}). Fix: export {_env.HVREP_WATCHDOG_ADDR} as rank 0's address on the "
                        "network the ranks share.")


def _interfaces() -> dict[str, list[str]]:
    import psutil  # Horovod's own dependency

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def _host_addr() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


class _Link:
    """One rank's authenticated connection to rank 0's server."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.secret, self.seq = secret, 0
        self.reader = self.sock.makefile("rb")
        hello = self.reader.readline(MAX_LINE)
        nonce = hello.rstrip(b"\n").partition(b" ")[2]
        if _open(secret, b"hello", nonce, hello) is None:
            self.close()
            raise _Unauthenticated("the server's hello")
        self.nonce = nonce

    def ask(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Sends one heartbeat; returns the server's verdict (None: "ok")."""
        self.seq += 1
        body = json.dumps({**state, "seq": self.seq}).encode()
        self.sock.sendall(_line(self.secret, b"c", self.nonce, body))
        line = self.reader.readline(MAX_LINE + 1)
        if not line:
            raise OSError("rank 0's watchdog closed the connection")
        answer = _open(self.secret, b"s", self.nonce, line)
        if answer is None:
            raise _Unauthenticated("an answer")
        reply = json.loads(answer)
        if reply.get("seq") != self.seq:
            raise _Unauthenticated("an answer out of sequence")
        return reply.get("verdict")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.close()
            self.sock.close()


class _Unauthenticated(OSError):
    """A line from the other end without a valid MAC: the connection is dropped (and counted), nothing else."""


class Watchdog:
    """One per process on a multi-rank horovod backend; started by the backend, never by user code.

    Args:
      rank, size: this process's place in the job.
      timeout_s: ``CommConfig.timeout_s`` (> 0).
      exchange: sends rank 0's address and secret (bytes) to every rank (a Horovod broadcast) and returns them.
      single_host: every rank runs on one host (rank 0 then listens on 127.0.0.1 only).
      interval: seconds between heartbeats; by default timeout_s / 10 clamped to [0.5, 5] s.
      exit_fn: how a rank leaves (``os._exit``; tests replace it).

    Raises:
      hvrep.errors.WatchdogError: rank 0 cannot listen (no free port in ``HVREP_WATCHDOG_PORT``'s range, an
        ``HVREP_WATCHDOG_ADDR`` that is not its own).
    """

    def __init__(self, rank: int, size: int, timeout_s: float, exchange: Callable[[bytes], bytes], *,
                 single_host: bool = True, interval: float | None = None,
                 exit_fn: Callable[[int], None] = os._exit, elastic: bool = False) -> None:
        self.rank, self.size, self.timeout_s = rank, size, float(timeout_s)
        self.elastic = elastic
        self.interval = interval or min(5.0, max(0.5, self.timeout_s / 10))
        # Not heard from for 3 heartbeats (and at least 5 s): not heartbeating.
        self.stale_s = max(3 * self.interval, 5.0)
        self.activity = Activity()
        self.rejected = 0  # answers from "rank 0" that did not authenticate (the server counts its own)
        self._exit_fn = exit_fn
        self._callbacks: list[Callable[[str, str], None]] = []
        self._states: dict[int, tuple[float, dict[str, Any]]] = {}
        self._gone: dict[int, str] = {}
        self._told: set[int] = set()  # ranks the server has answered with the verdict
        self._verdict: Verdict | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ended = False
        self._server: _Server | None = None
        self.secret = b""
        if rank == 0:
            self.secret = secrets.token_bytes(32)  # as Horovod's runner makes its job secret
            host = listen_address(single_host, _env.watchdog_addr(), _env.transport_iface(), _interfaces(),
                                  _host_addr() if not single_host else "")
            self._server = _Server(self, host, _env.watchdog_ports())
            address = f"{host}|{self._server.address[1]}|{self.secret.hex()}"
        else:
            address = ""
        # Hex: the exchange pads with zero bytes and strips them, which would eat a binary secret's.
        host, port, key = exchange(address.encode()).decode().split("|")
        self.address = (host, int(port))
        self.secret = bytes.fromhex(key)
        self._link: _Link | None = None
        try:
            self._link = _Link(host, int(port), self.secret, self._io_timeout)
        except OSError as e:
            # Hang detection on this rank now rests on its own timeout alone; say so where it starts.
            print(f"hvrep: warning: rank {rank} on {socket.gethostname()} cannot reach hvrep's watchdog on rank 0 at "
                  f"{host}:{port} ({e}); a hang will end this rank only after comm.timeout_s plus a grace period, "
                  f"and rank 0's report will say it never connected. Fix: export {_env.HVREP_WATCHDOG_ADDR} as an "
                  f"address of rank 0's host that this host can reach, and open the port "
                  f"({_env.HVREP_WATCHDOG_PORT}=29500-29599 fixes a range for a firewall).", file=sys.stderr,
                  flush=True)
        self._threads = [threading.Thread(target=self._heartbeat, name="hvrep-watchdog", daemon=True)]
        if rank == 0:
            self._threads.append(threading.Thread(target=self._judge, name="hvrep-watchdog-judge", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def _io_timeout(self) -> float:
        return max(2.0, self.interval * 2)

    # --- what the backend and the loop record ------------------------------------------------

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Marks one collective, eagerly, from entry to return (``Watched`` does this for every Horovod call)."""
        with self.activity.inside(what):
            yield

    def note_step(self, step: str) -> None:
        """The training loop's own label for what comes next (e.g. "train step 58"); shows in the report."""
        self.activity.step = step

    def on_end(self, callback: Callable[[str, str], None]) -> None:
        """``callback(stopped, report)`` runs on this rank before the watchdog ends it: ``stopped`` is the exit
        code's ``stopped`` value ("timeout", "mismatch"). It gets ``END_WORK_S`` seconds, then the rank exits."""
        self._callbacks.append(callback)

    @property
    def rejected_total(self) -> int:
        """Lines and connections that did not authenticate, at this rank's end of the wire (and rank 0's server)."""
        return self.rejected + (self._server.rejected if self._server is not None else 0)

    def close(self) -> None:
        """Stops the watchdog: the heartbeat, the judge and rank 0's server (its port is free again)."""
        self._ended = True
        self._stop.set()
        if self._server is not None:
            self._server.close()
        if self._link is not None:
            self._link.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self._io_timeout + 1)

    # --- rank 0: what the server hears, and the judge -------------------------------------------

    def _heard(self, rank: int, state: dict[str, Any]) -> dict[str, str] | None:
        """Records an authenticated heartbeat; returns the answer (the verdict's exit name and first line)."""
        with self._lock:
            self._states[rank] = (_now(), state)
            self._gone.pop(rank, None)
            v = self._verdict
            if v is not None:
                self._told.add(rank)
        return None if v is None else {"exit": v.exit.name, "report": v.report.split("\n", 1)[0]}

    def _lost(self, rank: int) -> None:
        if self._ended:
            return
        with self._lock:
            state = self._states.get(rank, (0.0, {}))[1]
            self._gone[rank] = (f"its process ended or its connection closed, after collective call "
                                f"#{state.get('call', '?')} {state.get('what', '')}")

    def _judge(self) -> None:
        ended: dict[int, float] = {}  # elastic: ranks this watchdog ended, and when
        while not self._stop.wait(self.interval / 2):
            stuck = None
            with self._lock:
                if self._verdict is None:
                    found = verdict(self._states, self.size, self.timeout_s, self.stale_s, _now(), self._gone,
                                    self.rejected_total)
                    recent = {r for r, t in ended.items() if _now() - t < self.timeout_s}
                    if found is not None and found.missing and set(found.missing) <= recent:
                        continue  # those ranks are gone: the others' collective is failing into a reset
                    if found is not None and self.elastic and found.exit is EXIT_HANG and self._stuck_here(found):
                        stuck = found  # not stored: no heartbeat answer may carry it to the others
                    else:
                        self._verdict = found
                found = self._verdict
            if stuck is not None:
                self._end_stuck(stuck)
                ended.update({r: _now() for r in stuck.missing})
                continue
            if found is not None:
                self._end(found.exit, found.report)
                return

    def _stuck_here(self, found: Verdict) -> bool:
        """Elastic training: whether every rank that did not join can be ended from here: its heartbeat's process
        identity is proven to be a process rank 0 sees (same boot, same pid namespace, that pid with that start
        time). Otherwise every rank ends, as without elasticity. Called with the lock held."""
        targets = {r: self._states.get(r, (0.0, {}))[1] for r in found.missing}
        return bool(targets) and all(r != self.rank and _proven(st) is not None for r, st in targets.items())

    def _end_stuck(self, found: Verdict) -> None:
        """Ends only the ranks that did not join (SIGKILL, which a stopped process gets too), so the elastic
        driver drops them and the others' collective fails into a reset (``hvrep.elastic.run``) instead of
        hanging. Their heartbeat records go: the next verdict is about the new world. Each is proven again just
        before its signal: a rank that ended meanwhile may have left its pid to another process."""
        with self._lock:
            targets = {r: self._states.pop(r, (0.0, {}))[1] for r in found.missing}
        for r, st in targets.items():
            first = found.report.splitlines()[0].split(" Exiting every rank")[0]
            proc = _proven(st)
            if proc is None:
                print(f"{first} Elastic training: rank {r} (pid {st.get('pid')}) has ended; nothing to signal.",
                      file=sys.stderr, flush=True)
                continue
            print(f"{first} Elastic training: ending only rank {r} (pid {proc.pid}); the others go on without it.",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)

    # --- every rank: the heartbeat ----------------------------------------------------------

    def _heartbeat(self) -> None:
        me = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()}
        with contextlib.suppress(OSError):  # no /proc: rank 0 cannot prove which process this is, and ends all
            me["proc"] = ProcessIdentity.mine().to_json()
        last_answer = _now()
        while not self._ended:
            try:
                if self._link is None:
                    self._link = _Link(*self.address, self.secret, self._io_timeout)
                answer = self._link.ask({**me, **self.activity.snapshot()})
                last_answer = _now()
                if answer and not self._ended:
                    found = next((e for e in EXIT_CODES if e.name == answer.get("exit")), EXIT_HANG)
                    self._end(found, str(answer.get("report", "")))
            except (OSError, ValueError) as e:
                self.rejected += isinstance(e, _Unauthenticated)
                if self._link is not None:
                    self._link.close()
                self._link = None
            a = self.activity.snapshot()
            if a["in"] and a["age"] > self.timeout_s + 2 * self.stale_s and not self._ended:
                # Rank 0 did not decide: it is stopped, dead or unreachable. Decide alone.
                step = f" ({a['step']})" if a["step"] else ""
                self._end(EXIT_HANG,
                          f"hvrep: rank {self.rank}: collective call #{a['call']} {a['what']}{step} has not completed "
                          f"within comm.timeout_s={self.timeout_s:g} s, and rank 0, which hosts hvrep's watchdog, has "
                          f"not answered for {_now() - last_answer:.0f} s: rank 0 is stopped, dead, hung holding "
                          "Python's GIL, or its host is unreachable. Exiting; the last complete checkpoint is kept. "
                          "Fix: see docs/troubleshooting.md.")
            if self._stop.wait(self.interval):
                return

    def _end(self, exit: ExitCode, report: str) -> None:
        """Prints the report (rank 0 all of it, the others its first line), runs the callbacks for at most
        ``END_WORK_S`` seconds, exits with ``exit.code``."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
        if self._exit_fn is os._exit:
            _ignore_sigterm()
        text = report if self.rank == 0 or not report.startswith("hvrep: ") \
            else report.split("\n", 1)[0] + f" (rank {self.rank}; rank 0 prints every rank's state)"
        print(text, file=sys.stderr, flush=True)
        work = threading.Thread(target=self._run_callbacks, args=(exit.stopped or exit.name, report),
                                name="hvrep-watchdog-end", daemon=True)
        work.start()
        work.join(END_WORK_S)
        if work.is_alive():
            print(f"hvrep: rank {self.rank}: the watchdog's last words (metrics.jsonl, the checkpoint lookup) did not "
                  f"finish within {END_WORK_S:g} s (a hung file system?); exiting without them.", file=sys.stderr,
                  flush=True)
        if self.rank == 0 and self._server is not None:
            # Rank 0 answers the others' next heartbeats with the verdict before leaving: until every rank still
            # heartbeating has had it, for at most two heartbeats (5 s).
            deadline = _now() + min(2 * self.interval, 5.0)
            while _now() < deadline:
                with self._lock:
                    live = {r for r, (t, _) in self._states.items() if _now() - t < self.stale_s and r != 0}
                    if live <= self._told:
                        break
                time.sleep(0.05)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self._stop.set()
        self._exit_fn(exit.code)

    def _run_callbacks(self, stopped: str, report: str) -> None:
        for callback in self._callbacks:
            with contextlib.suppress(Exception):
                callback(stopped, report)


def _proven(state: Mapping[str, Any]) -> ProcessIdentity | None:
    """The process a heartbeat's identity names, when this process can prove it runs (same boot, pid namespace,
    pid and start time); None otherwise."""
    proc = ProcessIdentity.from_json(state.get("proc"))
    return proc if proc is not None and proc.pid == state.get("pid") and proc.alive() else None


def _ignore_sigterm() -> None:
    """Keeps a launcher's SIGTERM from replacing the verdict's exit code on its way out.

    Once one rank has left with the verdict's code, ``srun --kill-on-bad-exit`` (and mpirun) sends SIGTERM to
    the others, and srun returns the highest of its tasks' codes: a rank killed by it counts as 143 and hides
    65 or 75 from ``slurm/preemptible.sbatch``. Every rank leaves by itself within seconds of the verdict
    (END_WORK_S at most), well within Slurm's KillWait before its SIGKILL. ``signal.signal`` works from the
    main thread only, which is blocked in the collective; the C call sets the process's disposition from any.
    """
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
        libc.signal(int(signal.SIGTERM), 1)  # SIG_IGN


# --- this process's watchdog ----------------------------------------------------------------------

# The watchdog of this process (one per process, like Horovod), or None; and the backends that use it.
_CURRENT: Watchdog | None = None
_USERS: set[int] = set()


def current() -> Watchdog | None:
    """This process's watchdog, or None (one rank, an in-graph backend, or timeout_s=0)."""
    return _CURRENT


def install(watchdog: Watchdog | None, user: object | None = None) -> None:
    """Makes ``watchdog`` this process's (closing the one before), used by ``user`` (a backend)."""
    global _CURRENT
    if _CURRENT is not None and _CURRENT is not watchdog:
        _CURRENT.close()
        _USERS.clear()
    _CURRENT = watchdog
    bind(watchdog.activity if watchdog is not None else None)
    if watchdog is not None and user is not None:
        _USERS.add(id(user))


def acquire(user: object) -> None:
    """``user`` (another backend) uses this process's watchdog too."""
    if _CURRENT is not None:
        _USERS.add(id(user))


def release(user: object) -> None:
    """``user`` is done with the watchdog; the last user's release stops it."""
    _USERS.discard(id(user))
    if not _USERS and _CURRENT is not None:
        install(None)


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """``Watchdog.collective`` on this process's watchdog, or nothing when there is none."""
    if _CURRENT is None:
        yield
        return
    with _CURRENT.collective(what):
        yield


def note_step(step: str) -> None:
    """Labels what this rank does next (the training loop's step) in a timeout report; free without a watchdog."""
    if _CURRENT is not None:
        _CURRENT.activity.step = step
