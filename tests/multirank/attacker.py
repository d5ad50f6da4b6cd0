"""A third party that can reach hvrep's watchdog port but holds no secret (issue 29), as its own process.

    python tests/multirank/attacker.py HOST PORT --seconds 20 --marker INJECTED-1234

For ``--seconds`` it keeps 50 idle connections open (reopening those the server drops), keeps two more
open on which it sends forged heartbeats 5 times a second as a rank would (reconnecting when dropped), and,
on fresh connections, sends: heartbeats in the format an unauthenticated watchdog accepted (rank 1 stuck in a
collective for a day; ranks 0 and 1 in different collectives), the same lines behind made-up MAC fields
(64 hex digits, a "mac" key), garbage bytes, and every few seconds a 4 MB line. Every text field carries
``--marker``, so a test can check that none of it reached the job's output or metrics.jsonl. It prints one
JSON line of what it sent (its own counts; it never learns what the server did with them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time


def _heartbeats(marker: str) -> list[bytes]:
    """Rank 1 inside a collective for a day; rank 0 in another one: a hang and a mismatch, if believed."""
    stuck = {"rank": 1, "call": 1, "what": f"{marker} run", "in": True, "age": 86400.0, "step": marker,
             "host": marker, "pid": 1, "seq": 1, "waiting": [marker]}
    other = {**stuck, "rank": 0, "what": f"{marker} reduce", "waiting": [f"{marker} reduce"], "age": 600.0}
    return [json.dumps(stuck).encode() + b"\n", json.dumps(other).encode() + b"\n"]


def _forged(marker: str) -> list[bytes]:
    stuck = {"rank": 1, "call": 1, "what": f"{marker} run", "in": True, "age": 86400.0, "step": marker,
             "host": marker, "pid": 1, "seq": 1, "waiting": [marker]}
    other = {**stuck, "rank": 0, "what": f"{marker} reduce", "waiting": [f"{marker} reduce"], "age": 600.0}
    lines = []
    for state in (stuck, other):
        body = json.dumps(state).encode()
        lines += [body + b"\n", b"0" * 64 + b" " + body + b"\n", os.urandom(32).hex().encode() + b" " + body + b"\n",
                  json.dumps({**state, "mac": "ab" * 32, "hmac": "cd" * 32}).encode() + b"\n"]
    lines += [os.urandom(200) + b"\n", b"\xff\xfe" + marker.encode() * 20 + b"\n", b"\n" * 10]
    return lines


def _send(host: str, port: int, payload: bytes) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.sendall(payload)
            with contextlib.suppress(OSError):
                s.recv(4096)  # whatever the server says (its hello), then it hangs up
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--marker", default="INJECTED")
    parser.add_argument("--idle", type=int, default=50, help="idle connections kept open")
    parser.add_argument("--rate", type=float, default=5, help="rounds of forged lines per second")
    args = parser.parse_args()
    lines = _forged(args.marker)
    beats = _heartbeats(args.marker)
    forgers: list[socket.socket | None] = [None, None]
    idle: list[socket.socket] = []
    sent = {"forged_lines": 0, "huge_lines": 0, "idle_opened": 0, "refused": 0}
    deadline = time.monotonic() + args.seconds
    next_huge = time.monotonic()
    i = 0
    while time.monotonic() < deadline:
        # Keep `idle` connections open: drop those the server closed, open new ones.
        alive = []
        for s in idle:
            try:
                s.setblocking(False)
                gone = s.recv(4096) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                s.close()
            else:
                alive.append(s)
        idle = alive
        while len(idle) < args.idle:
            try:
                idle.append(socket.create_connection((args.host, args.port), timeout=2))
                sent["idle_opened"] += 1
            except OSError:
                sent["refused"] += 1
                break
        if time.monotonic() >= next_huge:
            # Sent until the server hangs up (a server that reads it whole would take all 4 MB).
            _send(args.host, args.port, args.marker.encode() * (4 * 1024 * 1024 // len(args.marker)) + b"\n")
            sent["huge_lines"] += 1
            next_huge = time.monotonic() + 3
        for k, beat in enumerate(beats):
            try:
                if forgers[k] is None:
                    forgers[k] = socket.create_connection((args.host, args.port), timeout=2)
                forgers[k].sendall(beat)
                sent["forged_lines"] += 1
            except OSError:
                if forgers[k] is not None:
                    forgers[k].close()
                forgers[k] = None
        sent["forged_lines"] += _send(args.host, args.port, lines[i % len(lines)])
        i += 1
        time.sleep(1 / args.rate)
    for s in idle + [f for f in forgers if f is not None]:
        s.close()
    print(json.dumps(sent), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
