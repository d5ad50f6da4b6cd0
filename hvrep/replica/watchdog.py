"""A collective that never completes ends the job with a report, instead of hanging it (``CommConfig.timeout_s``).

Horovod's stall inspector cannot do this: a stopped or deadlocked rank also
stops Horovod's own per-cycle coordination, so the inspector never gets to
run. The watchdog is a thread per rank with an out-of-band heartbeat that does
not go through Horovod:

* rank 0 hosts a small TCP server; its address is broadcast once at start-up
  (one Horovod broadcast, when the backend starts);
* every rank keeps one connection to it and sends a line every ``interval``
  seconds saying what it is doing (its collective call number, which call,
  since when; the step the training loop noted); the server answers each
  line with "ok" or with the verdict. That is O(ranks) small messages per
  interval, all at rank 0 (512 ranks at one line a second each is nothing),
  never O(ranks^2);
* the server decides: a rank that has waited in a collective call for more
  than ``timeout_s`` ends the job, with one report naming the ranks that did
  not join (no heartbeat: stopped, dead, or hung holding Python's GIL; or
  busy elsewhere, with what each was doing). Two ranks whose collective call
  number N is a different call (``run`` of one step on one rank, ``reduce``
  on the other) can never meet: that is reported at once, without waiting
  for the timeout (uneven input across ranks ends this way);
* every rank that hears the verdict prints it (rank 0 the whole report, the
  others its first line) and leaves with ``os._exit(EXIT_CODE)``: Horovod's
  threads are blocked in the collective and would keep a clean exit waiting.
  A rank that cannot reach rank 0 (rank 0 stopped or dead) decides alone
  once its own call has waited ``timeout_s`` plus a grace period.

The training step that timed out never returns, so nothing after it runs: no
checkpoint is written from it, and the last complete checkpoint stays the
newest (checkpoints are written to a temporary folder and renamed).

Port: rank 0 listens on an ephemeral port (chosen by the kernel), on every
interface, as Gloo and Open MPI's TCP transport already do between the
job's nodes; ``HVREP_WATCHDOG_PORT`` fixes the port (a firewall that opens a
range) and ``HVREP_WATCHDOG_ADDR`` the address the other ranks dial (by
default they try rank 0's interface addresses in turn, loopback first on its
own host).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hvrep import _env

# What a rank exits with when the watchdog ends the job: EX_TEMPFAIL ("try again later"), which
# slurm/preemptible.sbatch requeues on. Distinct from 1 (a Python error) and 2 (hvrep train's usage errors).
EXIT_CODE = 75


def _now() -> float:
    return time.monotonic()


@dataclass
class Activity:
    """What this rank is doing, updated by the backend (cheap: attribute writes, no lock, no I/O)."""

    call: int = 0  # collective calls entered so far (run, reduce, broadcast at start-up)
    what: str = "starting"  # the current or last call
    inside: bool = False  # inside a collective call now
    since: float = field(default_factory=_now)
    step: str = ""  # the step the training loop noted, if any

    def snapshot(self) -> dict[str, Any]:
        return {"call": self.call, "what": self.what, "in": self.inside, "age": round(_now() - self.since, 2),
                "step": self.step}


def describe(rank: int, state: dict[str, Any], heard_ago: float) -> str:
    """One line for one rank: what it was doing and when it was last heard from."""
    where = "inside" if state["in"] else "after"
    step = f", {state['step']}" if state.get("step") else ""
    host = f" on {state['host']} (pid {state['pid']})" if state.get("host") else ""
    return (f"rank {rank}{host}: {where} collective call #{state['call']} {state['what']}{step} for "
            f"{state['age'] + heard_ago:.0f} s; last heartbeat {heard_ago:.0f} s ago")


def verdict(states: dict[int, tuple[float, dict[str, Any]]], size: int, timeout_s: float, stale_s: float,
            now: float, gone: dict[int, str] | None = None) -> str | None:
    """The report that ends the job, or None while nothing is stuck. Pure: tested without processes.

    Args:
      states: rank -> (monotonic time its last heartbeat arrived, its snapshot).
      size: ranks in the job.
      timeout_s: how long a rank may wait inside one collective call.
      stale_s: a rank not heard from for this long is not heartbeating (stopped, dead, or holding the GIL).
      now: the current monotonic time.
      gone: rank -> why its connection ended, for ranks that disconnected.
    """
    gone = gone or {}
    heard = {r: now - t for r, (t, _) in states.items()}
    live = {r: s for r, (t, s) in states.items() if heard[r] < stale_s and r not in gone}
    waiting = {r: s for r, s in live.items() if s["in"]}
    # Same call number, different call, both waiting longer than a call takes: these ranks can never meet in
    # that collective. (For a moment, two ranks may legitimately be in different calls, e.g. one still inside a
    # step whose collectives have completed while the other has moved on.)
    by_call: dict[int, dict[str, list[int]]] = {}
    settled = min(timeout_s, stale_s)
    for r, s in waiting.items():
        if s["age"] + heard[r] < settled:
            continue
        by_call.setdefault(s["call"], {}).setdefault(s["what"], []).append(r)
    mismatch = next(((c, calls) for c, calls in sorted(by_call.items()) if len(calls) > 1), None)
    stuck = {r: s for r, s in waiting.items() if s["age"] + heard[r] > timeout_s}
    if mismatch is None and not stuck:
        return None
    lines = []
    if mismatch is not None:
        call, calls = mismatch
        listing = "; ".join(f"rank(s) {', '.join(map(str, rs))} in {what}" for what, rs in sorted(calls.items()))
        lines.append(f"hvrep: the ranks are in different collectives at call #{call} ({listing}): they can never "
                     "meet, and the job would hang. Typical cause: input_fn yields different numbers of batches "
                     "on different ranks, or a collective (repl.reduce, repl.run) called on some ranks only.")
        fix = ("Fix: make every rank run the same steps and reduces in the same order: equal batch counts per "
               "rank (shard with ctx.shard, drop_remainder=True, or repeat() and a fixed number of steps).")
    else:
        first = min(stuck, key=lambda r: stuck[r]["call"])
        s = stuck[first]
        missing = sorted(r for r in range(size)
                         if r not in live or not (live[r]["in"] and live[r]["call"] == s["call"]))
        step = f" ({s['step']})" if s.get("step") else ""
        lines.append(f"hvrep: collective call #{s['call']} {s['what']}{step} has not completed within "
                     f"comm.timeout_s={timeout_s:g} s: rank(s) {', '.join(map(str, missing)) or '(none found)'} did "
                     "not join. Exiting every rank; the last complete checkpoint is kept.")
        fix = ("Fix: see README, 'When things go wrong'. A rank without heartbeat is stopped, dead, or blocked "
               "holding Python's GIL (attach `py-spy dump --pid PID` to it); a rank busy elsewhere names what it "
               "was doing. Raise comm.timeout_s if a step or checkpoint legitimately takes longer.")
    for r in range(size):
        if r in gone:
            lines.append(f"  rank {r}: {gone[r]}")
        elif r not in states:
            lines.append(f"  rank {r}: never connected to the watchdog")
        else:
            tag = "" if r in live else "  <- NO HEARTBEAT"
            lines.append("  " + describe(r, states[r][1], heard[r]) + tag)
    lines.append(fix)
    return "\n".join(lines)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Watchdog:
    """One per process on a multi-rank horovod backend; started by the backend, never by user code.

    Args:
      rank, size: this process's place in the job.
      timeout_s: ``CommConfig.timeout_s`` (> 0).
      exchange: sends rank 0's address (bytes) to every rank (a Horovod broadcast) and returns it.
      interval: seconds between heartbeats; by default timeout_s / 10 clamped to [0.5, 5] s.
      exit_fn: how a rank leaves (``os._exit``; tests replace it).
    """

    def __init__(self, rank: int, size: int, timeout_s: float, exchange: Callable[[bytes], bytes], *,
                 interval: float | None = None, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.rank, self.size, self.timeout_s = rank, size, float(timeout_s)
        self.interval = interval or min(5.0, max(0.5, self.timeout_s / 10))
        # Not heard from for 3 heartbeats (and at least 5 s): not heartbeating.
        self.stale_s = max(3 * self.interval, 5.0)
        self.activity = Activity()
        self._exit_fn = exit_fn
        self._callbacks: list[Callable[[str], None]] = []
        self._states: dict[int, tuple[float, dict[str, Any]]] = {}
        self._gone: dict[int, str] = {}
        self._verdict: str | None = None
        self._lock = threading.Lock()
        self._ended = False
        self._server: _Server | None = None
        if rank == 0:
            self._server = self._serve()
            port = self._server.server_address[1]
            address = f"{_env.watchdog_addr() or ','.join(_addresses())}|{socket.gethostname()}|{port}"
        else:
            address = ""
        self._address = exchange(address.encode()).decode()
        threading.Thread(target=self._heartbeat, name="hvrep-watchdog", daemon=True).start()
        if rank == 0:
            threading.Thread(target=self._judge, name="hvrep-watchdog-judge", daemon=True).start()

    # --- what the backend and the loop record ------------------------------------------------

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Marks a collective call (``run`` of a step, an eager ``reduce``) from entry to return."""
        a = self.activity
        a.call += 1
        a.what, a.inside, a.since = what, True, _now()
        try:
            yield
        finally:
            a.inside, a.since = False, _now()

    def note_step(self, step: str) -> None:
        """The training loop's own label for what comes next (e.g. "train step 58"); shows in the report."""
        self.activity.step = step

    def on_timeout(self, callback: Callable[[str], None]) -> None:
        """``callback(report)`` runs on this rank before it exits (e.g. hvrep train's ``final`` event)."""
        self._callbacks.append(callback)

    def close(self) -> None:
        """Stops acting (the job ended normally); the threads are daemons and end with the process."""
        self._ended = True

    # --- rank 0: the server ---------------------------------------------------------------

    def _serve(self) -> _Server:
        watchdog = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                rank = None
                for line in self.rfile:
                    try:
                        state = json.loads(line)
                        rank = int(state["rank"])
                        if not 0 <= rank < watchdog.size:
                            raise ValueError(rank)
                    except (ValueError, KeyError, TypeError):
                        return  # not one of the job's ranks (a port scanner, a stray client): hang up quietly
                    with watchdog._lock:
                        watchdog._states[rank] = (_now(), state)
                        watchdog._gone.pop(rank, None)
                        answer = watchdog._verdict
                    self.wfile.write((json.dumps({"verdict": answer}) + "\n").encode())
                if rank is not None and not watchdog._ended:
                    with watchdog._lock:
                        state = watchdog._states.get(rank, (0.0, {}))[1]
                        watchdog._gone[rank] = (f"its process ended or its connection closed, after collective "
                                                f"call #{state.get('call', '?')} {state.get('what', '')}")

        server = _Server(("", _env.watchdog_port()), Handler)
        threading.Thread(target=server.serve_forever, name="hvrep-watchdog-server", daemon=True).start()
        return server

    def _judge(self) -> None:
        while not self._ended:
            time.sleep(self.interval / 2)
            with self._lock:
                if self._verdict is None and not self._ended:
                    self._verdict = verdict(self._states, self.size, self.timeout_s, self.stale_s, _now(),
                                            self._gone)

    # --- every rank: the heartbeat ----------------------------------------------------------

    def _connect(self) -> socket.socket | None:
        hosts, host, port = self._address.split("|")
        candidates = hosts.split(",")
        if host == socket.gethostname() and not _env.watchdog_addr():
            candidates.insert(0, "127.0.0.1")
        for addr in candidates:
            with contextlib.suppress(OSError):
                return socket.create_connection((addr, int(port)), timeout=max(2.0, self.interval * 2))
        return None

    def _heartbeat(self) -> None:
        sock, reader, last_answer = None, None, _now()
        me = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid()}
        while not self._ended:
            try:
                if sock is None:
                    sock = self._connect()
                    reader = sock.makefile("rb") if sock is not None else None
                if sock is not None and reader is not None:
                    sock.sendall((json.dumps({**me, **self.activity.snapshot()}) + "\n").encode())
                    line = reader.readline()
                    if not line:
                        raise OSError("rank 0's watchdog closed the connection")
                    last_answer = _now()
                    answer = json.loads(line)["verdict"]
                    if answer and not self._ended:
                        self._end(answer)
            except (OSError, ValueError):
                with contextlib.suppress(OSError):
                    if sock is not None:
                        sock.close()
                sock = reader = None
            a = self.activity
            waited = _now() - a.since
            if a.inside and waited > self.timeout_s + 2 * self.stale_s and not self._ended:
                # Rank 0 did not decide: it is stopped, dead or unreachable. Decide alone.
                self._end(
                    f"hvrep: rank {self.rank}: collective call #{a.call} {a.what}"
                    f"{f' ({a.step})' if a.step else ''} has not completed within comm.timeout_s="
                    f"{self.timeout_s:g} s, and rank 0, which hosts hvrep's watchdog, has not answered for "
                    f"{_now() - last_answer:.0f} s: rank 0 is stopped, dead, hung holding Python's GIL, or its "
                    "host is unreachable. Exiting; the last complete checkpoint is kept. Fix: see README, "
                    "'When things go wrong'.")
            time.sleep(self.interval)

    def _end(self, report: str) -> None:
        """Prints the report (rank 0 all of it, the others its first line), runs the callbacks, exits."""
        self._ended = True
        text = report if self.rank == 0 or not report.startswith("hvrep: ") or "\n" not in report \
            else report.split("\n", 1)[0] + f" (rank {self.rank}; rank 0 prints every rank's state)"
        print(text, file=sys.stderr, flush=True)
        for callback in self._callbacks:
            with contextlib.suppress(Exception):
                callback(report)
        if self.rank == 0 and self._server is not None:
            # Rank 0 answers the others' next heartbeats with the verdict before leaving.
            time.sleep(min(2 * self.interval, 5.0))
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self._exit_fn(EXIT_CODE)


def _addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last: where the other ranks may reach rank 0."""
    import psutil  # Horovod's own dependency

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    return sorted(set(found), key=lambda a: (a.startswith("127."), a))[:8] or ["127.0.0.1"]


# The watchdog of this process (one per process, like Horovod), or None.
_CURRENT: Watchdog | None = None


def current() -> Watchdog | None:
    """This process's watchdog, or None (one rank, an in-graph backend, or timeout_s=0)."""
    return _CURRENT


def install(watchdog: Watchdog | None) -> None:
    global _CURRENT
    if _CURRENT is not None and _CURRENT is not watchdog:
        _CURRENT.close()
    _CURRENT = watchdog


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
